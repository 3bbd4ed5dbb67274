"""The compiled nvfp4_ds_mla writer (``_C_cache_ops.concat_and_cache_nvfp4_ds_mla``, behind
``concat_and_cache_mla``) against the reference codec (vllm.kv_quant.ds_mla_nvfp4), byte for
byte: random latents over many magnitudes, NaN / Inf / zero / subnormal groups, strided rows,
padded inputs, skipped slots, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from kv_cache_test_utils import DEVICES

from vllm import _custom_ops as ops
from vllm.kv_quant.ds_mla_nvfp4 import concat_and_cache_nvfp4_ds_mla

NOPE, ROPE, RECORD = 512, 64, 352


def _inputs(tokens: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-8, 4, tokens).unsqueeze(-1)
    # Rows 700 wide: kv_c is a strided view, as a slice of a fused projection is.
    wide = torch.randn(tokens, 700, generator=gen) * magnitudes
    kv_c = wide.bfloat16()[:, :NOPE]
    k_pe = (torch.randn(tokens, ROPE, generator=gen) * 300).bfloat16()
    kv_c[0] = 0.0
    kv_c[1, :16] = float("nan")
    kv_c[2, 20] = float("inf")
    kv_c[3, 40:56] = -float("inf")
    kv_c[4] = 1e-39  # bf16 subnormals
    kv_c[5, ::2] = 6.0
    k_pe[6, 3] = float("nan")
    k_pe[7] = 1e6  # saturates at 448
    return kv_c.to(device), k_pe.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 37])
def test_matches_the_codec(device: str, tokens: int) -> None:
    kv_c, k_pe = _inputs(tokens + 8, device)  # padding rows past slot_mapping
    gen = torch.Generator().manual_seed(1)
    cache = torch.randint(0, 256, (6, 8, RECORD), dtype=torch.uint8, generator=gen).to(device)
    slots = torch.randperm(48, generator=gen)[:tokens]
    if tokens > 1:
        slots[1] = -1
    slots = slots.to(device)
    expected = cache.clone()
    concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, expected, slots)
    assert not torch.equal(expected, cache)
    got = cache.clone()
    torch.ops._C_cache_ops.concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, got, slots)
    assert torch.equal(got, expected)
    through_mla = cache.clone()
    ops.concat_and_cache_mla(kv_c, k_pe, through_mla, slots, "nvfp4_ds_mla", torch.ones(1))
    assert torch.equal(through_mla, expected)


def test_the_upstream_op_uses_the_compiled_writer_on_cpu() -> None:
    from vllm._extension import compiled_kernel

    assert compiled_kernel("concat_and_cache_nvfp4_ds_mla", torch.device("cpu")) is not None


@pytest.mark.parametrize(
    "change,message",
    [
        ("kv_c_dtype", "kv_c: expected dtype bfloat16, got float32"),
        ("kv_c_width", r"kv_c: expected a \[T, 512\] tensor with contiguous rows"),
        ("k_pe_tokens", "k_pe: expected 4 tokens"),
        ("cache_width", r"kv_cache: expected a \(num_blocks, block_size, 352\) tensor"),
        ("slot_range", r"slot_mapping: expected slots < num_blocks \* block_size = 16"),
    ],
)
def test_bad_arguments_name_what_is_wrong(change: str, message: str) -> None:
    kv_c = torch.zeros(4, NOPE, dtype=torch.bfloat16)
    k_pe = torch.zeros(4, ROPE, dtype=torch.bfloat16)
    cache = torch.full((2, 8, RECORD), 7, dtype=torch.uint8)
    slots = torch.arange(4)
    if change == "kv_c_dtype":
        kv_c = kv_c.float()
    elif change == "kv_c_width":
        kv_c = torch.zeros(4, NOPE + 8, dtype=torch.bfloat16)
    elif change == "k_pe_tokens":
        k_pe = k_pe[:3]
    elif change == "cache_width":
        cache = torch.full((2, 8, RECORD + 4), 7, dtype=torch.uint8)
    else:
        slots = torch.tensor([0, 16, 1, 2])
    before = cache.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops._C_cache_ops.concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, cache, slots)
    assert torch.equal(cache, before)


def test_fake_kernel_traces_and_checks_on_meta() -> None:
    meta = torch.device("meta")
    kv_c = torch.empty(4, NOPE, dtype=torch.bfloat16, device=meta)
    k_pe = torch.empty(4, ROPE, dtype=torch.bfloat16, device=meta)
    cache = torch.empty(2, 8, RECORD, dtype=torch.uint8, device=meta)
    slots = torch.empty(4, dtype=torch.int64, device=meta)
    torch.ops._C_cache_ops.concat_and_cache_nvfp4_ds_mla(kv_c, k_pe, cache, slots)
    with pytest.raises(ValueError, match="kv_c: expected a torch.bfloat16 tensor"):
        torch.ops._C_cache_ops.concat_and_cache_nvfp4_ds_mla(kv_c.float(), k_pe, cache, slots)
