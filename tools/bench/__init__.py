"""Benchmarks that print ratios measured in the same run (never timed asserts).

Each module has `main(argv: list[str]) -> int`, reached through `kvpack bench NAME`."""
