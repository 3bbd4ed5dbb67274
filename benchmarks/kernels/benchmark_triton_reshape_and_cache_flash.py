"""The Triton cache writer against the compiled op: the same bytes (PASS / FAIL per format) and
the store bandwidth of each (GB/s of K/V, slots and scales read plus cache rows written).

    python benchmarks/kernels/benchmark_triton_reshape_and_cache_flash.py [--device cuda]
        [--tokens 4096] [--heads 8] [--kinds nvfp4,fp8] [--quick] [--no-timing]

On a GPU both writers run natively (CUDA events time them). Without one the Triton kernel runs
under Triton's interpreter (set here before the kernels are imported): ``--quick`` (2 tokens, 1
head) keeps that to seconds, and its timings only say that it ran. The inputs are those of
:mod:`vllm.benchmarks.reshape_and_cache_flash` (head size 128, bf16 K/V, pages of 16 tokens
scattered over the cache). Exits 1 when a format's bytes differ.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm import _custom_ops as ops  # noqa: E402
from vllm.benchmarks.reshape_and_cache_flash import _setup  # noqa: E402
from vllm.benchmarks.timing import time_call  # noqa: E402
from vllm.kv_quant.formats import formats  # noqa: E402
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (  # noqa: E402
    triton_reshape_and_cache_flash,
)

# Every format the compiled op writes, by canonical name.
KINDS = tuple(f.name for f in formats() if f.cache_kind is not None and f.has_kernel)


def compare(kind: str, num_tokens: int, num_heads: int, device: torch.device) -> dict:
    """One format: both writers on the same inputs into zeroed caches, bytes compared, then each
    timed (median seconds of a call) unless ``time_s`` is 0."""
    s = _setup(kind, num_tokens, num_heads, device)
    caches = {name: (s.key_cache.clone(), s.value_cache.clone()) for name in ("op", "triton")}

    def writer(name: str) -> Callable[[], None]:
        fn = ops.reshape_and_cache_flash if name == "op" else triton_reshape_and_cache_flash
        kc, vc = caches[name]
        return lambda: fn(s.key, s.value, kc, vc, s.slots, kind, s.scale, s.scale)

    calls = {name: writer(name) for name in caches}
    for call in calls.values():
        call()
    same = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(caches["op"], caches["triton"], strict=True)
    )
    return dict(kind=kind, tokens=num_tokens, heads=num_heads, same=same, calls=calls, setup=s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"default: {','.join(KINDS)}")
    parser.add_argument("--quick", action="store_true", help="2 tokens, 1 head, one timed call")
    parser.add_argument("--no-timing", action="store_true", help="compare bytes only")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := sorted(set(kinds) - set(KINDS)):
        parser.error(f"--kinds: expected some of {','.join(KINDS)}, got {','.join(unknown)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device: torch sees no CUDA device, got {args.device!r}")
    tokens, heads = (2, 1) if args.quick else (args.tokens, args.heads)

    print(f"{'format':<22} {'tokens':>6} {'heads':>5} {'bytes':<5} {'triton GB/s':>11} "
          f"{'op GB/s':>9} {'triton/op':>9}")  # fmt: skip
    failed = []
    for kind in kinds:
        r = compare(kind, tokens, heads, device)
        cells = ["", "", ""]
        if not args.no_timing:
            min_time, runs = (0.0, 1) if args.quick else (0.2, 2000)
            seconds = {n: time_call(c, device, min_time, runs) for n, c in r["calls"].items()}
            gbps = {n: r["setup"].bytes_moved / t / 1e9 for n, t in seconds.items()}
            ratio = seconds["op"] / seconds["triton"]
            cells = [f"{gbps['triton']:.2f}", f"{gbps['op']:.2f}", f"{ratio:.2f}"]
        status = "PASS" if r["same"] else "FAIL"
        print(f"{kind:<22} {tokens:>6} {heads:>5} {status:<5} {cells[0]:>11} {cells[1]:>9} "
              f"{cells[2]:>9}", flush=True)  # fmt: skip
        if not r["same"]:
            failed.append(kind)
    if failed:
        print(f"FAIL: the Triton writer's bytes differ from the op's for {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
