"""Builds the compiled cache ops (``vllm/_C``) with CMake and ninja against the installed torch,
and the torch-free block-file I/O extension ``vllm/fs_io_C`` of the file-system offload tier.

``pip install --no-build-isolation -e .`` (or without ``-e``). With a CUDA build of torch the CUDA
kernels are compiled too, for ``VLLM_KV_CUDA_ARCHS`` (CMake list, e.g. ``"90a;100a"``), else
``TORCH_CUDA_ARCH_LIST`` (e.g. ``"8.0 9.0a+PTX"``), else ``80;90a;100a;120a``. The CPU kernels are
compiled with ``-march=native`` unless ``VLLM_KV_CPU_ARCH`` names another target (empty: the
compiler's default, for a build that moves to other machines). The CMake build directory is
``build/cmake-torch<version>-<key>`` in the source tree (one per torch installation), kept between
installs: reinstalling an unchanged checkout recompiles nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


def cuda_architectures() -> str | None:
    """CMAKE_CUDA_ARCHITECTURES from the environment; None leaves CMakeLists.txt's default."""
    archs = os.environ.get("VLLM_KV_CUDA_ARCHS", "").strip()
    if archs:
        return ";".join(a for a in re.split(r"[;,\s]+", archs) if a)
    torch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not torch_list:
        return None
    result = []
    for item in re.split(r"[;\s]+", torch_list):
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", item)
        if match is None:
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST: expected entries like 8.0, 9.0a or 12.0a+PTX, got {item!r}"
            )
        major, minor, suffix, ptx = match.groups()
        # "8.0" is SASS only; "8.0+PTX" adds the PTX (CMake: "80-real" vs "80").
        result.append(f"{major}{minor}{suffix}" + ("" if ptx else "-real"))
    return ";".join(result)


class CMakeExtension(Extension):
    """An extension built by CMakeLists.txt at the repository root: CMake target ``target``,
    whose file name CMake reads from the cache variable ``output_name_var``."""

    def __init__(self, name: str, target: str, output_name_var: str) -> None:
        super().__init__(name, sources=[])
        self.target = target
        self.output_name_var = output_name_var


class CMakeBuild(build_ext):
    """Configures and builds the CMake project; the library lands where setuptools expects
    the extension (in the source tree for editable installs)."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            raise TypeError(f"ext: expected a CMakeExtension, got {type(ext).__name__}")
        import torch  # the build is against the installed torch (no build isolation)

        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("building vllm._C needs cmake >= 3.22 on PATH")
        if shutil.which("ninja") is None:
            raise RuntimeError("building vllm._C needs ninja on PATH")
        output = Path(self.get_ext_fullpath(ext.name)).resolve()
        # One CMake build directory per torch installation: its cache pins Torch_DIR and the
        # CUDA set-up, so a build against another torch (CPU and CUDA venvs) must not reuse it.
        # It lives in the source tree's build/, not in pip's per-install temporary directory,
        # so that reinstalling an unchanged checkout is a ninja no-op instead of a full build.
        torch_key = hashlib.sha256(str(Path(torch.__file__).parent).encode()).hexdigest()[:8]
        build_dir = ROOT / "build" / f"cmake-torch{torch.__version__}-{torch_key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        with_cuda = torch.version.cuda is not None
        args = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-G",
            "Ninja",
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DVLLM_KV_OUTPUT_DIR={build_dir / 'lib'}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            *(
                f"-D{e.output_name_var}={Path(self.get_ext_fullpath(e.name)).name}"
                for e in self.extensions
                if isinstance(e, CMakeExtension)
            ),
            f"-DVLLM_KV_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
        ]
        # The build directory outlives this install: an option not set now is removed from its
        # cache (-U), so that CMakeLists.txt's default applies instead of an earlier value.
        if "VLLM_KV_CPU_ARCH" in os.environ:
            args.append(f"-DVLLM_KV_CPU_ARCH={os.environ['VLLM_KV_CPU_ARCH']}")
        else:
            args.append("-UVLLM_KV_CPU_ARCH")
        if with_cuda:  # nvcc, the toolkit and nvrtc are found by cmake/cuda_toolkit.cmake
            args.append(f"-DVLLM_KV_TORCH_CUDA_VERSION={torch.version.cuda}")
            archs = cuda_architectures()
            args.append(
                f"-DCMAKE_CUDA_ARCHITECTURES={archs}" if archs else "-UCMAKE_CUDA_ARCHITECTURES"
            )
        subprocess.run(args, check=True)
        subprocess.run([cmake, "--build", str(build_dir), "--target", ext.target], check=True)
        # Copy, then rename over the old library: processes that have it loaded keep their
        # mapping instead of crashing on a file rewritten in place.
        output.parent.mkdir(parents=True, exist_ok=True)
        staged = output.with_name(output.name + ".tmp")
        shutil.copy2(build_dir / "lib" / output.name, staged)
        os.replace(staged, output)


setup(
    ext_modules=[
        CMakeExtension("vllm._C", "_C", "VLLM_KV_OUTPUT_NAME"),
        CMakeExtension("vllm.fs_io_C", "fs_io_C", "VLLM_KV_FS_IO_OUTPUT_NAME"),
    ],
    cmdclass={"build_ext": CMakeBuild},
)
