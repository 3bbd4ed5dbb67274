"""Kernel benchmarks, importable from an installed package.

:mod:`vllm.benchmarks.reshape_and_cache_flash` is run by ``vllm-kv bench`` and by the script
``benchmarks/kernels/benchmark_reshape_and_cache_flash.py``.
"""
