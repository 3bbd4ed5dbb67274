"""vllm._custom_ops: loading the extension."""

from __future__ import annotations

import pytest

from vllm import _custom_ops as ops


def test_missing_extension_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "_extension_path", lambda: None)
    with pytest.raises(ImportError, match=r"pip install --no-build-isolation -e \."):
        ops._load_extension()


def test_extension_is_found() -> None:
    path = ops._extension_path()
    assert path is not None and path.name.startswith("_C")
