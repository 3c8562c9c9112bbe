"""kvpack's operator tools: `kvpack bench`, `kvpack demo`, `kvpack soak`.

Not the product: nothing in the core (`kvpack`, folder `common/`) or in the
adapters imports this package; the `kvpack` command reaches each tool by
module name, only when it runs. The tools may import anything (the engines,
the adapters, test models).

    bench/       benchmarks that print ratios measured in one run
    soak/        the soak and fault-injection suite on the real vLLM server
    demo.py      `make demo`: a real vLLM engine with and without kvpack
    tinymodel.py the tiny Llama models built offline (no hub) for the three above
"""
