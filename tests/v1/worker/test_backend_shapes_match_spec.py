"""Every registered attention backend's ``get_kv_cache_shape`` agrees with the shape the spec
derives (upstream v0.33's ``compute_layer_kv_cache_shape_bytes``: ``[B, H, N, C]``, C in
bytes), for every cache format the backend lists: the same kernel blocks, and a kernel page of
the same bytes. The worker views a page through the backend's shape, so a backend that
disagreed would read another layout than the planner sized."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.kv_quant import octave
from vllm.kv_quant.formats import find_format
from vllm.kv_quant.slot_codecs import OCTAVE_CHECK_ROPE_DIM, is_packed, slot_codec
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backends.abstract import MultipleOf
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    compute_layer_kv_cache_shape_bytes,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 3


def _backends() -> list[AttentionBackendEnum]:
    members = []
    for member in AttentionBackendEnum:
        try:
            member.get_class()
        except ValueError:  # a slot without a registered class (CUSTOM)
            continue
        members.append(member)
    return members


def _stores(cache_dtype: str, head_size: int) -> bool:
    """Whether the format has rows for this head size (``ultraquant_4bit``: multiples of 32,
    TurboQuant: powers of two; Octave's block K at the model's rotary dims the test sets)."""
    fmt = find_format(cache_dtype)
    assert fmt is not None, cache_dtype
    try:
        if is_packed(fmt):
            slot_codec(fmt, head_size, OCTAVE_CHECK_ROPE_DIM)
        else:
            fmt.last_dim(head_size)
    except ValueError:
        return False
    return True


def _cases() -> list[tuple[str, str, int]]:
    cases = []
    for member in _backends():
        backend = member.get_class()
        head_sizes = (576,) if backend.is_mla else (64, 80, 128)
        for name in backend.supported_kv_cache_dtypes:
            cases.extend(
                (member.name, name, head_size)
                for head_size in head_sizes
                if backend.supports_head_size(head_size) and _stores(name, head_size)
            )
    return cases


def _spec(mla: bool, cache_dtype: str, head_size: int) -> AttentionSpec:
    fmt = find_format(cache_dtype)
    assert fmt is not None, cache_dtype
    common = dict(
        block_size=BLOCK_SIZE,
        head_size=head_size,
        dtype=fmt.resolve_storage_dtype(torch.bfloat16),
        kv_quant_mode=fmt.quant_mode,
    )
    if mla:
        mla_str = cache_dtype if cache_dtype == "fp8_ds_mla" else None
        return MLAAttentionSpec(num_kv_heads=1, cache_dtype_str=mla_str, **common)
    return FullAttentionSpec(num_kv_heads=4, **common)


def _kernel_block_sizes(backend: type) -> list[int]:
    sizes = []
    for size in (BLOCK_SIZE, BLOCK_SIZE // 2):
        for supported in backend.get_supported_kernel_block_sizes():
            base = supported.base if isinstance(supported, MultipleOf) else supported
            if (isinstance(supported, MultipleOf) and size % base == 0) or size == supported:
                sizes.append(size)
                break
    return sizes


def test_every_registered_backend_is_covered() -> None:
    names = {name for name, _, _ in _cases()}
    assert {"REFERENCE", "CPU_ATTN", "TRITON_ATTN", "FLASHINFER", "MLA_COMMON"} <= names


@pytest.mark.parametrize(("backend_name", "cache_dtype", "head_size"), _cases())
def test_backend_shape_equals_spec_shape(
    backend_name: str, cache_dtype: str, head_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Octave's block-K slot needs the model's rotary dims, as a model registers them.
    monkeypatch.setattr(octave, "_rope_dims", {})
    octave.register_rope_dim(head_size, OCTAVE_CHECK_ROPE_DIM)
    backend = AttentionBackendEnum[backend_name].get_class()
    spec = _spec(backend.is_mla, cache_dtype, head_size)
    itemsize = get_dtype_size(spec.kv_cache_format.resolve_storage_dtype(spec.dtype))
    kernel_sizes = _kernel_block_sizes(backend)
    assert kernel_sizes, backend_name
    for kernel in kernel_sizes:
        blocks, heads, states, content = compute_layer_kv_cache_shape_bytes(
            spec, NUM_BLOCKS, kernel
        )
        shape = backend.get_kv_cache_shape(
            blocks, kernel, spec.num_kv_heads, head_size, cache_dtype
        )
        assert shape[0] == blocks == NUM_BLOCKS * (BLOCK_SIZE // kernel)
        assert math.prod(shape[1:]) * itemsize == heads * states * content
