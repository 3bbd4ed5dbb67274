"""Ahead-of-time compile cases of the Triton cache writer
(:mod:`.triton_reshape_and_cache_flash`), built from real launches: each case plans the writer
over small CPU tensors of one geometry (8 KV heads of 128, 16-token NHD pages of one
``[B, 2, N, H, D']`` allocation, one bf16 token unless the case casts) and compiles what that
launch runs. Its argument types, the integers equal to 1 (constants) and the arguments that are
multiples of 16 (16-byte aligned pointers, divisible integers) follow Triton's launch
specialisation (:func:`~vllm.triton_utils.aot.case_from_launch`), so the compile gives the code
a launch into such a cache runs (design.md §11.4)."""

from __future__ import annotations

import torch

from vllm.kv_quant.formats import lookup
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

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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


def _caches(kv_cache_dtype: str, dtype: torch.dtype, *, shift: int = 0):
    """K and V sides of one ``[B, 2, N, H, D']`` cache; ``shift`` bytes past the allocation's
    start (a view off 4-byte boundaries)."""
    fmt = lookup(kv_cache_dtype)
    storage = fmt.resolve_storage_dtype(dtype)
    last = fmt.last_dim(CASE_HEAD_SIZE) if fmt.is_quantized else CASE_HEAD_SIZE
    shape = (2, 2, CASE_BLOCK_SIZE, CASE_HEADS, last)
    size = torch.Size(shape).numel() * torch.empty((), dtype=storage).element_size()
    raw = torch.zeros(size + shift, dtype=torch.uint8)[shift:]
    kv = raw.view(storage).view(shape)
    return kv[:, 0], kv[:, 1]


def _flash_case(
    name: str,
    kv_cache_dtype: str,
    src: str = "bf16",
    *,
    cache: str | None = None,
    per_head: bool = False,
    layout: str | None = None,
    shift: int = 0,
) -> TritonCompileCase:
    """A case of :func:`~.triton_reshape_and_cache_flash.triton_reshape_and_cache_flash`."""
    key = _source(_DTYPES[src])
    cache_dtype = _DTYPES[cache] if cache else _DTYPES[src]
    key_cache, value_cache = _caches(kv_cache_dtype, cache_dtype, shift=shift)
    scale = torch.ones(CASE_HEADS if per_head else 1)
    slots = torch.zeros(1, dtype=torch.int64)
    launch = plan_reshape_and_cache_flash(key, key.clone(), key_cache, value_cache, slots,
                                          kv_cache_dtype, scale, scale.clone(), layout,
                                          None)  # fmt: skip
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
    """The writer for every format it writes: unquantized same-dtype copies and casts, FP8 e4m3
    / e5m2 with per-tensor and per-head scales, per-token-head INT8 / FP8 with inline scales (and
    rows off 4-byte boundaries) and with separate scale caches, NVFP4 and nvfp4_mse with linear
    and interleave4 scale layouts, fp16 NVFP4 with per-head scales."""
    cases = [_flash_case(f"{s}->{d}", "auto", s, cache=d) for s in _DTYPES for d in _DTYPES]
    for fp8 in ("fp8_e4m3", "fp8_e5m2"):
        cases += [_flash_case(fp8, fp8), _flash_case(f"{fp8}/per_head", fp8, per_head=True)]
    for name in ("int8_per_token_head", "fp8_per_token_head"):
        cases += [
            _flash_case(name, name),
            _flash_case(f"{name}/unaligned_rows", name, shift=1),
            _scale_cache_case(f"{name}/scale_cache", name),
        ]
    for name in ("nvfp4", "nvfp4_mse"):
        cases += [_flash_case(f"{name}/{layout}", name, layout=layout)
                  for layout in ("linear", "interleave4")]  # fmt: skip
    cases.append(_flash_case("fp16/nvfp4/per_head", "nvfp4", "fp16", per_head=True))
    return cases
