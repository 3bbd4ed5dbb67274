"""Benchmark of KV-page movement through Mooncake on loopback (store put/get, P2P, memcpy).

A thin wrapper: the benchmark lives in :mod:`vllm.benchmarks.mooncake_transfer`. Usage
(``pip install -e '.[mooncake]'`` first; ``--help`` for all options)::

    unshare --net sh -c 'ip link set lo up && python benchmarks/kv_transfer/benchmark_mooncake.py'
"""

from vllm.benchmarks.mooncake_transfer import main

if __name__ == "__main__":
    raise SystemExit(main())
