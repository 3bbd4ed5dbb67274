"""Ahead-of-time compile cases of the Triton cache writer
(:mod:`.triton_reshape_and_cache_flash`), built from real launches: each case plans the writer
over small CPU tensors of one geometry (8 KV heads of 128, 16-token NHD pages of one
``[B, 2, N, H, D']`` allocation, one bf16 token unless the case casts; the ``key_sinks`` cases
with one key sink row per page after its K and V rows) and compiles what that launch runs. Its
argument types, the integers equal to 1 (constants) and the arguments that are multiples of 16
(16-byte aligned pointers, divisible integers) follow Triton's launch specialisation
(:func:`~vllm.triton_utils.aot.case_from_launch`), so the compile gives the code a launch into
such a cache runs (design.md §11.4)."""

from __future__ import annotations

import torch

from vllm.kv_quant.formats import CacheKind, formats, lookup
from vllm.triton_utils.aot import TritonCompileCase, case_from_launch
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
    WriterLaunch,
    plan_per_token_head_quant,
    plan_reshape_and_cache_flash,
    reshape_and_cache_flash_kernel,
)

CASE_HEADS = 8
"""KV heads of the compile cases (a GQA model's 8 KV heads of 128)."""
CASE_HEAD_SIZE = 128
CASE_BLOCK_SIZE = 16
CASE_SINK_ROWS = 1
"""Key sink rows per page of the ``key_sinks`` cases (``key_sink_tokens=1``)."""

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

_FP8_KINDS = (CacheKind.FP8_E4M3, CacheKind.FP8_E5M2)


def _case(name: str, launch: WriterLaunch) -> TritonCompileCase:
    return case_from_launch(
        f"reshape_and_cache_flash/{name}",
        reshape_and_cache_flash_kernel,
        launch.args,
        launch.constexprs,
        num_warps=launch.num_warps,
        enable_fp_fusion=False,
    )


def _source(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, CASE_HEADS, CASE_HEAD_SIZE, dtype=dtype)


def _caches(kv_cache_dtype: str, dtype: torch.dtype, *, shift: int = 0, sink_rows: int = 0):
    """K and V sides of one ``[B, 2, N, H, D']`` cache and its key sink rows ``[B, S, H, D]``,
    ``S = sink_rows`` bytes per head after each page's K and V rows; ``shift`` bytes past the
    allocation's start (a view off 4-byte boundaries)."""
    fmt = lookup(kv_cache_dtype)
    storage = fmt.resolve_storage_dtype(dtype)
    size = torch.empty((), dtype=storage).element_size()
    last = fmt.last_dim(CASE_HEAD_SIZE) if fmt.is_quantized else CASE_HEAD_SIZE
    side = CASE_BLOCK_SIZE * CASE_HEADS * last  # elements
    page = 2 * side * size + sink_rows * CASE_HEADS * CASE_HEAD_SIZE  # bytes
    raw = torch.zeros(2 * page + shift, dtype=torch.uint8)[shift:]
    kv = torch.as_strided(raw.view(storage), (2, 2, CASE_BLOCK_SIZE, CASE_HEADS, last),
                          (page // size, side, CASE_HEADS * last, last, 1))  # fmt: skip
    sinks = torch.as_strided(raw, (2, sink_rows, CASE_HEADS, CASE_HEAD_SIZE),
                             (page, CASE_HEADS * CASE_HEAD_SIZE, CASE_HEAD_SIZE, 1),
                             raw.storage_offset() + 2 * side * size)  # fmt: skip
    return kv[:, 0], kv[:, 1], sinks


def _flash_case(
    name: str,
    kv_cache_dtype: str,
    src: str = "bf16",
    *,
    cache: str | None = None,
    per_head: bool = False,
    layout: str | None = None,
    shift: int = 0,
    sinks: bool = False,
) -> TritonCompileCase:
    """A case of :func:`~.triton_reshape_and_cache_flash.triton_reshape_and_cache_flash`
    (``sinks``: with key sink rows, their scale as the K scale)."""
    key = _source(_DTYPES[src])
    cache_dtype = _DTYPES[cache] if cache else _DTYPES[src]
    key_cache, value_cache, key_sinks = _caches(
        kv_cache_dtype, cache_dtype, shift=shift, sink_rows=CASE_SINK_ROWS if sinks else 0
    )
    scale = torch.ones(CASE_HEADS if per_head else 1)
    slots = torch.zeros(1, dtype=torch.int64)
    launch = plan_reshape_and_cache_flash(key, key.clone(), key_cache, value_cache, slots,
                                          kv_cache_dtype, scale, scale.clone(), layout, None,
                                          key_sinks if sinks else None,
                                          scale.clone() if sinks else None)  # fmt: skip
    return _case(name, launch)


def _scale_cache_case(name: str, kv_cache_dtype: str) -> TritonCompileCase:
    """A case of upstream's per-token-head writer (rows of D bytes, fp32 scale caches)."""
    key = _source(torch.bfloat16)
    storage = STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype]
    shape = (2, 2, CASE_BLOCK_SIZE, CASE_HEADS)
    kv = torch.zeros(*shape, CASE_HEAD_SIZE, dtype=storage)
    scales = torch.zeros(shape)
    slots = torch.zeros(1, dtype=torch.int64)
    launch = plan_per_token_head_quant(key, key.clone(), kv[:, 0], kv[:, 1], scales[:, 0],
                                       scales[:, 1], slots)  # fmt: skip
    return _case(name, launch)


def triton_compile_cases() -> list[TritonCompileCase]:
    """The writer for every format of the registry it writes: unquantized same-dtype copies and
    casts; each FP8 kind with per-tensor and per-head scales; each per-token-head kind with
    inline scales (and rows off 4-byte boundaries) and with separate scale caches; each NVFP4
    format (``nvfp4``, ``nvfp4_mse``) in every block-scale layout, fp16 NVFP4 with per-head
    scales; and with key sink rows: bf16, the first FP8 format (per-head), the first
    per-token-head format, each NVFP4 format (interleave4)."""
    cases = [_flash_case(f"{s}->{d}", "auto", s, cache=d) for s in _DTYPES for d in _DTYPES]
    # INT4 rows go to upstream's reshape_and_cache_int4 (its cases: ops/int4_per_token_head.py).
    written = [
        f
        for f in formats()
        if f.cache_kind not in (None, CacheKind.INT4_PER_TOKEN_HEAD) and f.has_kernel
    ]
    fp8 = [f.name for f in written if f.cache_kind in _FP8_KINDS]
    per_token_head = [f.name for f in written if f.is_per_token_head]
    nvfp4 = [f for f in written if f.is_nvfp4]
    for name in fp8:
        cases += [_flash_case(name, name), _flash_case(f"{name}/per_head", name, per_head=True)]
    for name in per_token_head:
        cases += [
            _flash_case(name, name),
            _flash_case(f"{name}/unaligned_rows", name, shift=1),
            _scale_cache_case(f"{name}/scale_cache", name),
        ]
    for fmt in nvfp4:
        cases += [_flash_case(f"{fmt.name}/{layout}", fmt.name, layout=layout)
                  for layout in fmt.scale_layouts]  # fmt: skip
    cases.append(_flash_case("fp16/nvfp4/per_head", nvfp4[0].name, "fp16", per_head=True))
    cases += [
        _flash_case("key_sinks/bf16->bf16", "auto", sinks=True),
        _flash_case(f"key_sinks/{fp8[0]}/per_head", fp8[0], per_head=True, sinks=True),
        _flash_case(f"key_sinks/{per_token_head[0]}", per_token_head[0], sinks=True),
        *(_flash_case(f"key_sinks/{f.name}/interleave4", f.name, layout="interleave4", sinks=True)
          for f in nvfp4),
    ]  # fmt: skip
    return cases
