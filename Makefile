# The two set-up commands of the README. Both work on a fresh machine: they build
# the venvs they need (cached outside the clone, keyed by requirements/pins.txt).
.PHONY: demo test bench

demo:
	scripts/demo.sh $(ARGS)

test:
	scripts/test.sh

bench:
	scripts/bench.sh
