"""The packed-slot codecs: which formats are packed, round trips, and Octave's rotary dims."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import octave
from vllm.kv_quant.formats import formats, lookup
from vllm.kv_quant.slot_codecs import OCTAVE_CHECK_ROPE_DIM, is_packed, slot_codec


def test_the_packed_formats_are_turboquant_ultraquant_and_octave() -> None:
    packed = {fmt.name for fmt in formats() if is_packed(fmt)}
    assert packed == {
        "turboquant_k8v4",
        "turboquant_4bit_nc",
        "turboquant_k3v4_nc",
        "turboquant_3bit_nc",
        "ultraquant_4bit",
        "octave_k3v4",
        "octave_k3v3",
        "octave_k3v3_compact",
    }
    with pytest.raises(ValueError, match="format: expected a packed-slot format, got 'nvfp4'"):
        slot_codec(lookup("nvfp4"), 128)


@pytest.mark.parametrize(
    "name", ["turboquant_k8v4", "turboquant_3bit_nc", "ultraquant_4bit", "octave_k3v3_compact"]
)
def test_round_trip_is_close_and_the_slot_is_the_registry_page(name: str) -> None:
    fmt = lookup(name)
    codec = slot_codec(fmt, 128)
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(5, 2, 128, generator=gen) for _ in range(2))
    slots = codec.encode(key, value)
    assert slots.dtype == torch.uint8 and slots.shape[:2] == (5, 2)
    assert slots.shape[-1] <= codec.slot_bytes == 2 * fmt.last_dim(128)
    k, v = codec.decode(slots)
    for x, y in ((key, k), (value, v)):
        cos = torch.nn.functional.cosine_similarity(x.flatten(0, 1), y.flatten(0, 1), dim=-1)
        assert float(cos.min()) > 0.9


def test_octave_block_k_needs_rotary_dims(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(octave, "_rope_dims", {})
    fmt = lookup("octave_k3v4")
    with pytest.raises(ValueError, match="head_size: an Octave block-K slot depends on"):
        slot_codec(fmt, 256)
    assert slot_codec(fmt, 256, OCTAVE_CHECK_ROPE_DIM).slot_bytes == 248  # 64 rotary dims
    octave.register_rope_dim(256, 128)
    assert slot_codec(fmt, 256, OCTAVE_CHECK_ROPE_DIM).slot_bytes != 248  # the model's wins
