"""vllm.utils.sparse_utils: the densify budget and the thread-safe invariant check."""

import threading

import pytest
import torch

from vllm.utils import sparse_utils


def sparse(shape: tuple[int, int]) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([2.0]), shape)


def test_small_tensor_is_densified(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_MAX_EMBED_DECODE_BYTES", raising=False)
    dense = sparse_utils.safe_to_dense(sparse((2, 3)), parameter="prompt_embeds")
    assert dense.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]


def test_oversized_declared_shape_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_MAX_EMBED_DECODE_BYTES", "64")
    with pytest.raises(ValueError, match="prompt_embeds: expected at most 64 bytes"):
        sparse_utils.safe_to_dense(sparse((4, 5)), parameter="prompt_embeds")  # 80 bytes
    monkeypatch.setenv("VLLM_MAX_EMBED_DECODE_BYTES", "0")  # no limit
    assert sparse_utils.safe_to_dense(sparse((4, 5)), parameter="p").shape == (4, 5)


def test_bad_payload_and_budget(monkeypatch) -> None:
    with pytest.raises(TypeError, match="p: expected the payload"):
        sparse_utils.safe_to_dense([1, 2], parameter="p")
    monkeypatch.setenv("VLLM_MAX_EMBED_DECODE_BYTES", "lots")
    with pytest.raises(ValueError, match="VLLM_MAX_EMBED_DECODE_BYTES: expected an int"):
        sparse_utils.safe_to_dense(sparse((4, 5)), parameter="p")


def test_invariant_check_is_serialized() -> None:
    inside = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with sparse_utils.check_sparse_tensor_invariants_threadsafe():
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    assert inside.wait(5)
    assert not sparse_utils._SPARSE_LOAD_LOCK.acquire(blocking=False)
    release.set()
    thread.join(5)
    with sparse_utils.check_sparse_tensor_invariants_threadsafe():
        assert torch.sparse.check_sparse_tensor_invariants.is_enabled()
        with pytest.raises(RuntimeError):
            torch.sparse_coo_tensor(torch.tensor([[5], [0]]), torch.tensor([1.0]), (2, 2))
