"""Offline throughput of the inflight engine against transformers generate(); see
`inflight.bench.engine_bench`. Run `python benchmarks/bench_engine.py --help`."""

import sys

from inflight.bench.engine_bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
