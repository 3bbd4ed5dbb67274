"""The built extensions link the process's shared libstdc++, not a copy of their own.

A copy (from ``-static-libstdc++`` or a static archive on the link line) keeps a second registry
of locale facets: the first error message that formats a number, e.g. ``expected ... = 36 ...,
got 64``, then calls into the wrong facet and the process dies with a segmentation fault. A GPU
machine's build did exactly that; CMakeLists.txt now links the shared library first.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vllm import _custom_ops as ops
from vllm import _extension

# libstdc++'s own definitions (mangled): a library that defines any of them carries a copy.
LIBSTDCXX_PROBES = {
    "_ZNSo9_M_insertIlEERSoT_": "std::ostream::_M_insert<long>",
    "_ZNKSt7codecvtIDsc11__mbstate_tE10do_unshiftERS0_PcS3_RS3_": "std::codecvt<char16_t>",
    "_ZNSt6locale5_ImplC2Em": "std::locale::_Impl::_Impl(size_t)",
}


def _fs_io_path() -> Path:
    return Path(importlib.import_module("vllm.fs_io_C").__file__ or "")


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
@pytest.mark.parametrize("extension", ["_C", "fs_io_C"])
def test_extension_defines_no_libstdcxx_code(extension: str) -> None:
    path = _extension.extension_path() if extension == "_C" else _fs_io_path()
    assert path is not None and path.is_file(), f"the extension {extension} is not built"
    out = subprocess.run(
        ["nm", "--defined-only", str(path)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    defined = {line.split()[-1] for line in out.splitlines() if line.strip()}
    copies = [name for symbol, name in LIBSTDCXX_PROBES.items() if symbol in defined]
    assert not copies, (
        f"{path.name}: expected libstdc++ from the shared library, got its own copy of "
        f"{', '.join(copies)} (static libstdc++ on the link line)"
    )


def test_error_message_with_numbers_survives() -> None:
    """The crash itself: an op's error naming sizes, raised several times in one process."""
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"dst_cache: expected src_cache's shape \[2, 3\]"):
            ops.convert_fp8(torch.empty(1, dtype=torch.uint8), torch.empty(2, 3), kv_dtype="fp8")
