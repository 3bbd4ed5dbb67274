"""Benchmark of reshape_and_cache_flash (GB/s, % of a copy roofline, × baseline).

A thin wrapper: the benchmark lives in :mod:`vllm.benchmarks.reshape_and_cache_flash` (also run by
``vllm-kv bench``). Usage: ``python benchmarks/kernels/benchmark_reshape_and_cache_flash.py
--device cpu --threads 2 --markdown out.md --json out.json`` (``--help`` for all options).
"""

from vllm.benchmarks.reshape_and_cache_flash import main

if __name__ == "__main__":
    raise SystemExit(main())
