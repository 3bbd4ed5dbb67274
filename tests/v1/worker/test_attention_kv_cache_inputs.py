"""``AttentionKVCache``'s entry points refuse bad input with a ``ValueError`` naming it, before
anything is allocated or written: a device this torch cannot use (was torch's
``AssertionError``), and token positions or block tables of a float dtype (were truncated)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from vllm.kv_quant import KeyRope
from vllm.v1.attention.backends import CPUAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.worker.attention_kv_cache import AttentionKVCache
from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches

H, HQ, D = 2, 4, 64
ROPE = KeyRope.from_base(D, 64)
TABLE = torch.tensor([[2, 5]])


def _no_cuda(monkeypatch: pytest.MonkeyPatch, count: int = 0) -> None:
    """Make torch report ``count`` CUDA devices (0: CUDA not available), whatever the machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


NO_CUDA = (
    "device: expected a device this torch can use, got {!r} (CUDA is not available: torch sees "
    "no CUDA device)"
)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
@pytest.mark.parametrize("backend", [None, CPUAttentionBackend], ids=["selected", "class"])
def test_a_cuda_device_without_cuda_is_a_value_error(
    monkeypatch: pytest.MonkeyPatch, device: str | torch.device, backend: object
) -> None:
    _no_cuda(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(NO_CUDA.format(device))):
        AttentionKVCache.create("fp8", 4, 16, H, D, device=device, backend=backend)


def test_a_cuda_device_torch_does_not_see_is_a_value_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_cuda(monkeypatch, count=2)
    message = "device: expected cuda:0..cuda:1 (torch sees 2 CUDA device(s)), got 'cuda:2'"
    with pytest.raises(ValueError, match=re.escape(message)):
        AttentionKVCache.create("fp8", 4, 16, H, D, device="cuda:2")


@pytest.mark.parametrize("device", ["bogus", "cuda:x", 3.5])
def test_a_device_that_is_no_device_is_a_value_error(device: object) -> None:
    message = f"device: expected a torch device such as 'cpu' or 'cuda:0', got {device!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        AttentionKVCache.create("fp8", 4, 16, H, D, device=device)  # type: ignore[arg-type]


def test_init_kv_cache_on_a_cuda_device_without_cuda_is_a_value_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_cuda(monkeypatch)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[KVCacheTensor(4 * spec.page_size_bytes, ["layer"])],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    with pytest.raises(ValueError, match=re.escape(NO_CUDA.format("cuda"))):
        init_layer_kv_caches(config, {"layer": CPUAttentionBackend}, "cuda")


def _kv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(6, h, D, generator=gen).to(torch.bfloat16) for h in (H, H, HQ))


def _float_error(name: str) -> str:
    return re.escape(f"{name}: expected an integer tensor, got torch.float32")


# Each entry point that takes token positions or a block table, with a float one.
ENTRY_POINTS: dict[str, tuple[Callable[[AttentionKVCache], object], str]] = {
    "write": (
        lambda c: c.write(*_kv()[:2], c.metadata([6], [6], TABLE).slot_mapping,
                          torch.arange(6) + 0.7),
        "positions",
    ),
    "stored_key": (lambda c: c.stored_key(_kv()[0], torch.arange(6) + 0.7), "positions"),
    "metadata": (lambda c: c.metadata([6], [6], TABLE + 0.9), "block_table"),
    "metadata_seq_lens": (lambda c: c.metadata(torch.tensor([6.0]), [6], TABLE), "seq_lens"),
    "attend": (
        lambda c: c.attend(_kv()[2], replace(c.metadata([6], [6], TABLE), block_table=TABLE + 0.9)),
        "block_table",
    ),
    "forward": (
        lambda c: c.forward(
            _kv()[2], *_kv()[:2], replace(c.metadata([6], [6], TABLE), block_table=TABLE + 0.9)
        ),
        "block_table",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8+prerope"])
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_float_positions_and_block_tables_are_refused_before_the_write(
    kv_cache_dtype: str, entry: str
) -> None:
    rope = ROPE if "prerope" in kv_cache_dtype else None
    cache = AttentionKVCache.create(kv_cache_dtype, 8, 4, H, D, num_heads=HQ, key_rope=rope)
    call, name = ENTRY_POINTS[entry]
    before = cache.kv_cache.clone()
    with pytest.raises(ValueError, match=_float_error(name)):
        call(cache)
    assert torch.equal(cache.kv_cache, before)
