"""Prints which dispatch keys have a kernel for every op of ``torch.ops._C_cache_ops`` (and of
``torch.ops._C``, where upstream's Octave store lives) and exits 1 if one lacks a required key.

    python tools/check_op_registrations.py [--require CPU,CUDA,Meta]

Imports ``vllm._custom_ops`` (which loads the built extension and registers the fake/Meta
implementations), lists every op of the namespace from torch's dispatcher (so an op added later is
checked without touching this file) and, per op, the registered keys among CPU, CUDA and Meta.
Default requirement: CPU and Meta, plus CUDA when the installed torch is a CUDA build (whether or
not a GPU is present). A composite kernel (an op without tensor arguments) serves every key; an op
of :data:`DEVICE_SCOPED_OPS` is required only on the keys listed there.
"""

from __future__ import annotations

import argparse
import sys

import torch

NAMESPACE = "_C_cache_ops"
NAMESPACES = (NAMESPACE, "_C")
KEYS = ("CPU", "CUDA", "Meta")
COMPOSITE_KEYS = ("CompositeExplicitAutograd", "CompositeImplicitAutograd")
DEVICE_SCOPED_OPS: dict[str, tuple[str, ...]] = {
    # The CPU attention backend's kernel (CPU_ATTN); GPUs attend with FlashInfer.
    f"{NAMESPACE}::paged_attention": ("CPU", "Meta"),
    f"{NAMESPACE}::packed_paged_attention": ("CPU", "Meta"),
    # Address descriptors are CPU tensors whatever memory they name; the CUDA build's CPU kernel
    # copies device memory too.
    f"{NAMESPACE}::swap_blocks_batch": ("CPU", "Meta"),
}


def namespace_ops() -> list[str]:
    """Qualified names (``<namespace>::name``) of every op of :data:`NAMESPACES` the dispatcher
    knows, sorted."""
    prefixes = tuple(f"{n}::" for n in NAMESPACES)
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefixes))


def registered_keys(op: str) -> list[str]:
    """The keys of ``KEYS`` that have a kernel for ``op`` (all of them for a composite kernel)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if any(has(op, k) for k in COMPOSITE_KEYS):
        return list(KEYS)
    return [k for k in KEYS if has(op, k)]


def main() -> int:
    default = "CPU,CUDA,Meta" if torch.version.cuda else "CPU,Meta"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require", default=default, help=f"comma-separated keys ({default})")
    args = parser.parse_args()
    required = [k for k in args.require.split(",") if k]
    unknown = sorted(set(required) - set(KEYS))
    if unknown:
        parser.error(f"--require: expected keys among {', '.join(KEYS)}, got {', '.join(unknown)}")

    import vllm._custom_ops  # noqa: F401  (loads vllm/_C, registers the Meta kernels)

    ops = namespace_ops()
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), required: {', '.join(required)}")
    if not ops:
        print(f"FAIL: no op registered in the {NAMESPACE} namespace")
        return 1
    failures = 0
    for op in ops:
        keys = registered_keys(op)
        scope = DEVICE_SCOPED_OPS.get(op, KEYS)
        missing = [k for k in required if k in scope and k not in keys]
        row = "  ".join(f"{k}={'yes' if k in keys else 'no'}" for k in KEYS)
        print(f"{'FAIL' if missing else 'PASS'} {op:<40} {row}")
        if missing:
            print(f"     missing: {', '.join(missing)}")
            failures += 1
    print(f"{len(ops)} op(s), {failures} with a missing kernel")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
