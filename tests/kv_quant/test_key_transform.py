"""KeyTransform: the one definition of what a cache does to keys and queries (offset, rotation),
used by AttentionKVCache and the model report."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import KeyTransform, hadamard_rotate


def test_identity_passes_tensors_through() -> None:
    k = torch.randn(3, 2, 8)
    t = KeyTransform()
    assert t.is_identity and t.stored_key(k) is k and t.reader_query(k) is k


def test_offset_then_rotation_then_rounding() -> None:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 16, generator=gen).to(torch.bfloat16)
    q = torch.randn(5, 4, 16, generator=gen).to(torch.bfloat16)
    offset = torch.randn(2, 16, generator=gen)
    t = KeyTransform("hadamard", offset)
    assert torch.equal(t.stored_key(k), hadamard_rotate(k.float() - offset).to(torch.bfloat16))
    assert torch.equal(t.reader_query(q), hadamard_rotate(q).to(torch.bfloat16))
    only_offset = KeyTransform(offset=offset.double())
    assert only_offset.offset is not None and only_offset.offset.dtype == torch.float32
    assert torch.equal(only_offset.reader_query(q), q)
    assert torch.equal(only_offset.stored_key(k), (k.float() - offset).to(torch.bfloat16))


def test_scores_move_by_one_constant_per_query() -> None:
    gen = torch.Generator().manual_seed(1)
    k, q = torch.randn(2, 40, 32, generator=gen, dtype=torch.float64)
    offset = torch.randn(1, 32, generator=gen, dtype=torch.float64)
    t = KeyTransform("hadamard", offset.float())
    stored = t.stored_key(k[:, None].float())[:, 0].double()
    scores = t.reader_query(q.float()).double() @ stored.T
    shift = scores - q @ k.T
    # each query's row moves by one constant, q . offset: softmax ignores it
    torch.testing.assert_close(shift, (-(q @ offset.T)).expand_as(shift), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rotation": "random"}, "key_rotation: expected None or 'hadamard', got 'random'"),
        ({"offset": torch.zeros(4)}, r"offset: expected a tensor \[H, D\], got \[4\]"),
        ({"offset": torch.full((1, 4), float("inf"))}, "offset: expected finite values"),
        (
            {"rotation": "hadamard", "offset": torch.zeros(1, 12)},
            "head_size: expected a power of two",
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyTransform(**kwargs)  # type: ignore[arg-type]


def test_a_key_of_another_shape_than_the_offset_is_refused() -> None:
    t = KeyTransform(offset=torch.zeros(3, 8))
    for shape in ((2, 3, 1), (2, 1, 8), (2, 3, 16)):
        with pytest.raises(ValueError, match=r"key: expected \[\.\.\., 3, 8\] like the key offset"):
            t.stored_key(torch.zeros(shape))
    with pytest.raises(ValueError, match="offset: expected a float tensor, got torch.int64"):
        KeyTransform(offset=torch.zeros(3, 8, dtype=torch.int64))
