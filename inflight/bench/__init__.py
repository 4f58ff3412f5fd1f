"""Measured benchmarks: the engine against baselines, on the hardware at hand.

Each benchmark module exposes `main(argv: list[str]) -> int` (wired to `inflight bench <name>`)
and a `run_benchmark(...)` function that returns a JSON-serialisable dict.
"""
