"""Fixtures shared by the cache-writer tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vllm.v1.attention.ops import triton_reshape_and_cache_flash as writer

from .cache_utils import Launch


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """The writer kernel's launches (grid, arguments, keyword arguments) while the test runs."""
    seen: list[Launch] = []
    kernel = writer.reshape_and_cache_flash_kernel

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            def launch(*args: object, **kwargs: object) -> None:
                seen.append((grid, args, kwargs))
                kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(writer, "reshape_and_cache_flash_kernel", Spy())
    return seen
