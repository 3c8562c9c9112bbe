"""kvpack's soak and fault-injection suite on the real vLLM OpenAI server.

A vLLM server with kvpack (memory, disk and Mooncake tiers) on 127.0.0.1
serves a shared-prefix workload from several tenants through bounded
concurrent streaming clients, while faults are injected on a schedule
(Mooncake master and segment holder killed, stopped; the disk directory
replaced by a file; the disk full; objects corrupted; pickle bombs planted;
invalid tenant names and salts). Every greedy output is compared token by
token with a no-cache reference, and a table of the targets is printed.

    kvpack soak                      # short form (~90 s of load)
    kvpack soak --duration 600 --cycle 120 --clients 16

Modules: `runner` (the run), `workload` (prompts and the streaming client),
`faults` (the schedule), `server` (the vLLM process), `procs` (processes,
RSS, Mooncake, tmpfs), `reference` (the no-cache run), `report`.
"""

from __future__ import annotations

import argparse
import json
import sys

from .runner import Soak, SoakConfig, SoakReport

__all__ = ["Soak", "SoakConfig", "SoakReport", "main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpack soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load (default 90)")
    p.add_argument("--cycle", type=float, default=0.0, help="seconds per fault cycle (default: one cycle)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--tenants", default="acme,globex,initech", help="comma-separated tenant names")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default="", help="model directory (default: the tiny test Llama)")
    p.add_argument("--workdir", default="", help="folder for logs and stores (default: a new temp folder)")
    p.add_argument("--no-mooncake", action="store_true", help="memory and disk tiers only")
    p.add_argument("--no-faults", action="store_true", help="load only (a baseline)")
    p.add_argument("--delay-bound", type=float, default=0.5, help="target for the step delay while a tier is down (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the counts to this JSON file")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        p.error("--clients must be >= 1 and --duration > 0")
    cfg = SoakConfig(
        duration_s=args.duration,
        cycle_s=args.cycle,
        clients=args.clients,
        tenants=tuple(t for t in args.tenants.split(",") if t),
        max_tokens=args.max_tokens,
        model=args.model,
        workdir=args.workdir,
        mooncake=not args.no_mooncake,
        faults=not args.no_faults,
        delay_bound_s=args.delay_bound,
        seed=args.seed,
    )
    report = Soak(cfg).run()
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"passed": report.passed, **report.counts}, f, indent=2, default=str)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
