"""vllm._custom_ops: loading the extension."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm import _extension


def test_missing_extension_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_extension, "extension_path", lambda: None)
    with pytest.raises(ImportError, match=r"pip install --no-build-isolation -e \."):
        _extension.load_extension()


def test_extension_is_found() -> None:
    path = _extension.extension_path()
    assert path is not None and path.name.startswith("_C")


def test_ops_are_registered_by_importing_custom_ops() -> None:
    """As upstream: ``import vllm`` loads nothing compiled; ``from vllm import _custom_ops``
    registers ``torch.ops._C_cache_ops`` (the README says so)."""
    code = (
        "import torch, vllm\n"
        "has = lambda: hasattr(torch.ops._C_cache_ops, 'reshape_and_cache_flash')\n"
        "before = has()\n"
        "from vllm import _custom_ops\n"
        "print(before, has())\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "True"]
    assert "from vllm import _custom_ops as ops" in (root / "README.md").read_text()
