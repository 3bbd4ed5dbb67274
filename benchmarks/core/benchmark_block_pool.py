"""Benchmark of the block pool (allocate / cache / prefix lookup / free, µs per block) beside
upstream vLLM's. A thin wrapper: the benchmark lives in :mod:`vllm.benchmarks.block_pool`.
Usage (``--help`` for all options)::

    python benchmarks/core/benchmark_block_pool.py --upstream /path/to/vllm-0.22.0
"""

from vllm.benchmarks.block_pool import main

if __name__ == "__main__":
    raise SystemExit(main())
