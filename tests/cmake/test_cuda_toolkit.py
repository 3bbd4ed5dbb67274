"""cmake/cuda_toolkit.cmake: configure errors name the missing file and the variable to set.

Each test configures the project with ``VLLM_KV_WITH_CUDA=ON`` in a scratch build directory. The
CUDA set-up runs before ``find_package(Torch)``, so these run with any torch (a CPU build too); they
need cmake, ninja and nvcc.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils

ROOT = Path(__file__).resolve().parents[2]
HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()

pytestmark = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which("ninja") is None or not HAS_NVCC,
    reason="needs cmake, ninja and the CUDA toolkit's nvcc",
)


def run_configure(
    tmp_path: Path, *defines: str, prefix: str | None = None, **env: str
) -> tuple[int, str]:
    """Configures the project with the CUDA kernels for sm_90a in a scratch directory; returns the
    exit status and the output (stdout + stderr on single spaces: CMake wraps its messages)."""
    environment = {
        k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CUDACXX")
    }
    environment.update(env)
    cmd = [
        "cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), "-G", "Ninja",
        "-DVLLM_KV_WITH_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90a",
        f"-DCMAKE_PREFIX_PATH={prefix or torch.utils.cmake_prefix_path}",
        *defines,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=environment, timeout=300)
    return result.returncode, " ".join((result.stdout + result.stderr).split())


def configure_error(tmp_path: Path, *defines: str, **env: str) -> str:
    """The output of a configure that must fail."""
    returncode, output = run_configure(tmp_path, *defines, **env)
    assert returncode != 0, output
    return output


def test_bad_architecture_names_the_variable(tmp_path: Path) -> None:
    output = configure_error(tmp_path, "-DCMAKE_CUDA_ARCHITECTURES=90a;sm_100a")
    assert "CUDA architecture 'sm_100a': expected entries like 80, 90a or 120a-real" in output
    assert "VLLM_KV_CUDA_ARCHS" in output


def test_cuda_home_without_nvcc_names_the_file(tmp_path: Path) -> None:
    home = tmp_path / "not-a-toolkit"
    home.mkdir()
    output = configure_error(tmp_path, CUDA_HOME=str(home))
    assert f"CUDA_HOME={home}, but {home}/bin/nvcc does not exist" in output


def test_toolkit_of_another_major_version_than_torch_is_refused(tmp_path: Path) -> None:
    output = configure_error(tmp_path, "-DVLLM_KV_TORCH_CUDA_VERSION=99.0")
    assert "torch was built with CUDA 99.0, but the toolkit in" in output
    assert "Set CUDA_HOME to a CUDA 99.x toolkit" in output


def test_missing_nvrtc_names_the_variable(tmp_path: Path) -> None:
    # A torch prefix with no nvidia-* wheels beside it: only the toolkit could provide libnvrtc.
    prefix = tmp_path / "site-packages" / "torch" / "share" / "cmake"
    prefix.parent.mkdir(parents=True)
    prefix.symlink_to(torch.utils.cmake_prefix_path, target_is_directory=True)
    returncode, output = run_configure(tmp_path, prefix=str(prefix))
    if re.search(r"vllm-kvcache: CUDA architectures .* nvrtc /\S*nvrtc", output):
        pytest.skip("this CUDA toolkit ships libnvrtc itself")
    assert returncode != 0, output
    assert re.search(r"libnvrtc\.so \(or libnvrtc\.so\.\d+\) not found in", output), output
    assert "set CUDA_nvrtc_LIBRARY to the library's path" in output
