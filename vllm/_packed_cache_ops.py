"""The extension's packed-slot cache writers. ``turboquant_store`` takes what upstream's
``triton_turboquant_store`` takes and writes the bytes of the reference codec
:mod:`vllm.kv_quant.turboquant.codec` with the compiled CPU or CUDA kernel
(``_C_cache_ops::turboquant_store``; the codec itself where the extension has no kernel for the
cache's device). :func:`ultraquant_kernel_store` is the ``ultraquant_4bit`` kernel's glue, behind
upstream's entry point ``vllm.v1.attention.ops.ultraquant.triton_store.ultraquant_store``.
:func:`compiled_packed_store` gives the compiled store of a packed format (Octave's is upstream's
op ``_C::octave_cache_store``), for the tools and the backends.

Lloyd-Max presets: the key norms and the rotation ``y = k / (|k| + 1e-8) @ PiT`` are the codec's
:func:`~vllm.kv_quant.turboquant.codec.rotate_unit_keys` (one torch matmul, shared with the
codec and the Triton store, so all see the same ``y``); the kernel codes ``y``, packs the codes
and the fp16 norm, and codes and packs the value. FP8 presets: the kernel rounds the key to e4m3.
Everything is checked before anything is written (``ValueError``, ``<arg>: expected X, got Y``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm._extension import compiled_kernel  # loads the extension: its ops before their fakes
from vllm.kv_quant.formats import KVCacheFormat
from vllm.kv_quant.octave import OctaveFormat
from vllm.kv_quant.octave_codec import sign_bits
from vllm.kv_quant.slot_codecs import compiled_store_op
from vllm.kv_quant.turboquant.centroids import turboquant_tables
from vllm.kv_quant.turboquant.codec import (
    check_turboquant_cache,
    check_turboquant_inputs,
    check_turboquant_store,
    rotate_unit_keys,
    turboquant_write_cache,
)
from vllm.kv_quant.turboquant.config import FP8_KEY_BITS, TurboQuantConfig, kernel_config
from vllm.kv_quant.ultraquant import DEFAULT_CONSTANT_C, ultraquant_slot_size
from vllm.kv_quant.ultraquant_codec import rotate_keys

__all__ = [
    "OCTAVE_MAX_HEAD_SIZE",
    "PackedStore",
    "compiled_packed_store",
    "turboquant_store",
    "ultraquant_kernel_store",
]


def turboquant_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    midpoints: torch.Tensor,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool = False,
) -> None:
    """Store ``key`` / ``value`` ``[N, H, D]`` into ``kv_cache [num_blocks, block_size, H, slot
    bytes]`` (uint8, contiguous slots) at ``slot_mapping [N]`` (negative: skipped), as
    :func:`~vllm.kv_quant.turboquant.codec.turboquant_write_cache`; bytes past the slot (the
    padding) are left as they are. ``PiT`` (fp32 ``[D, D]``) and ``midpoints`` (fp32
    ``[2**mse_bits - 1]``, ascending) serve Lloyd-Max keys; the bit widths and
    ``key_packed_size`` (bytes) are those of a :class:`TurboQuantConfig`."""
    cfg, n, h = check_turboquant_store(
        key,
        value,
        kv_cache,
        slot_mapping,
        PiT,
        midpoints,
        mse_bits,
        key_packed_size,
        value_quant_bits,
        key_fp8,
    )
    op = compiled_kernel("turboquant_store", kv_cache.device)
    if op is None:
        turboquant_write_cache(key, value, kv_cache, slot_mapping, cfg, PiT, midpoints)
        return
    norms = mids = None
    if cfg.key_fp8:
        if key.dtype != value.dtype:  # the kernel reads both in one type: fp32 holds either
            key, value = key.float(), value.float()
    else:
        y, norms = rotate_unit_keys(key, PiT.to(key.device))
        key = y.reshape(n, h, -1)
        mids = midpoints.to(kv_cache.device).contiguous()
    key_bits = FP8_KEY_BITS if cfg.key_fp8 else mse_bits
    op(
        _rows(key),
        _rows(value),
        kv_cache,
        slot_mapping.to(torch.int64).contiguous(),
        norms,
        mids,
        key_bits,
        value_quant_bits,
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` when its rows are contiguous (what the kernel reads), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def ultraquant_kernel_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    constant_c: float,
) -> bool:
    """Write ``ultraquant_4bit`` slots with the extension's kernel: keys rotated by the codec's
    matmul (:func:`~vllm.kv_quant.ultraquant_codec.rotate_keys`), the rest in the kernel. The
    arguments are those of upstream's ``ultraquant_store``, already checked by it. False, with
    nothing written, when the extension has no kernel for the cache's device or the cache's
    slots are not contiguous (the caller then writes with the codec)."""
    op = compiled_kernel("ultraquant_store", kv_cache.device)
    if op is None or kv_cache.stride(3) != 1:
        return False
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    op(rotate_keys(key), value.contiguous(), kv_cache, slots, constant_c)
    return True


PackedStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``store(key, value, kv_cache, slot_mapping)``: ``[N, H, D]`` K and V into a cache
``(num_blocks, block_size, H, slot bytes)`` uint8 at ``slot_mapping`` (negative: skipped)."""


def compiled_packed_store(
    fmt: KVCacheFormat, head_size: int, device: torch.device
) -> PackedStore | None:
    """The extension's store of the packed-slot format ``fmt`` (TurboQuant's presets with their
    tables, ``ultraquant_4bit`` with its constant, Octave with its signs) for heads of
    ``head_size`` on ``device``, or None where it has no kernel (Octave: heads over
    :data:`OCTAVE_MAX_HEAD_SIZE`)."""
    op_name = compiled_store_op(fmt)
    op = None if op_name is None else compiled_kernel(op_name, device)
    if op is None:
        return None
    if fmt.quant_mode.is_octave:
        return _octave_store(op, fmt, head_size, device)
    if fmt.quant_mode.is_ultraquant:

        def ultraquant(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
            if not ultraquant_kernel_store(k, v, c, s, DEFAULT_CONSTANT_C):
                raise ValueError(f"kv_cache: expected contiguous slots, got strides {c.stride()}")

        return ultraquant
    cfg = TurboQuantConfig.from_cache_dtype(fmt.name, head_size)
    tables = turboquant_tables(head_size, cfg.centroid_bits)
    pit, mids = tables.rotation.to(device), tables.midpoints.to(device)

    def turboquant(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
        turboquant_store(
            k, v, c, s, pit, mids, cfg.key_mse_bits, cfg.key_packed_size, cfg.value_quant_bits,
            cfg.key_fp8,
        )  # fmt: skip

    return turboquant


OCTAVE_MAX_HEAD_SIZE = 512
"""The largest head the compiled Octave store takes (its scratch, ``kOctaveMaxHeadDim``)."""


def _octave_store(
    op: Callable[..., None], fmt: KVCacheFormat, head_size: int, device: torch.device
) -> PackedStore | None:
    if head_size > OCTAVE_MAX_HEAD_SIZE:
        return None
    code = OctaveFormat.from_cache_dtype(fmt.name, head_size, 0).kernel_code
    signs = sign_bits(head_size).to(device)

    def octave(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
        if k.dtype != v.dtype:  # the op reads both in one type: fp32 holds either
            k, v = k.float(), v.float()
        op(_rows(k), _rows(v), c.transpose(1, 2), s.to(torch.int64).contiguous(), signs, signs,
           code)  # fmt: skip

    return octave


@torch.library.register_fake("_C::octave_cache_store")
def _octave_cache_store_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_signs: torch.Tensor,
    v_signs: torch.Tensor,
    fmt: int,
) -> None:
    # Tracing rejects what the kernel would (shapes, dtypes); slot values are the kernel's own.
    if value.dim() != 3 or key.shape != value.shape or key.dtype != value.dtype:
        raise ValueError(
            f"key: expected value's shape and dtype {list(value.shape)} {value.dtype}, got "
            f"{list(key.shape)} {key.dtype}"
        )
    n, h, d = value.shape
    if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[1] != h:
        raise ValueError(
            f"cache: expected a uint8 (num_blocks, {h}, block_size, slot bytes) tensor, got "
            f"{cache.dtype} of shape {list(cache.shape)}"
        )
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping: expected [{n}], got {list(slot_mapping.shape)}")
    for name, t in (("k_signs", k_signs), ("v_signs", v_signs)):
        if t.dtype != torch.int32 or tuple(t.shape) != (d // 32,):
            raise ValueError(f"{name}: expected int32 [{d // 32}], got {t.dtype} {list(t.shape)}")


@torch.library.register_fake("_C_cache_ops::turboquant_store")
def _turboquant_store_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_norms: torch.Tensor | None,
    midpoints: torch.Tensor | None,
    key_bits: int,
    value_bits: int,
) -> None:
    # Tracing rejects what the kernel would (shapes, dtypes); slot values are the kernel's own.
    d = value.shape[-1] if value.dim() else 0
    cfg = TurboQuantConfig(head_dim=d, key_quant_bits=key_bits, value_quant_bits=value_bits)
    kernel_config(d, cfg.key_mse_bits, cfg.key_packed_size, value_bits, cfg.key_fp8)  # the bits
    n, h, _ = check_turboquant_inputs(value, value, cfg)
    check_turboquant_cache(kv_cache, slot_mapping, n, h, cfg, check_range=False)


@torch.library.register_fake("_C_cache_ops::ultraquant_store")
def _ultraquant_store_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    constant_c: float,
) -> None:
    # Tracing rejects what the kernel would (shapes, dtypes); slot values are the kernel's own.
    if key.dtype != torch.float32 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key: expected float32 [N, H, D] (the rotated keys) of value's shape "
            f"{list(value.shape)}, got {key.dtype} {list(key.shape)}"
        )
    n, h, d = key.shape
    need = ultraquant_slot_size(d)
    shape = tuple(kv_cache.shape)
    if kv_cache.dtype != torch.uint8 or len(shape) != 4 or shape[2] != h or shape[3] < need:
        raise ValueError(
            f"kv_cache: expected uint8 [num_blocks, block_size, {h}, >= {need}], got "
            f"{kv_cache.dtype} {list(kv_cache.shape)}"
        )
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping: expected [{n}], got {list(slot_mapping.shape)}")
