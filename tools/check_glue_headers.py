"""Checks that the torch glue (csrc/**/*.cpp) includes no header of torch's heavy CUDA libraries.

``ATen/cuda/CUDAContext.h`` and friends pull in cuBLAS, cuSPARSE and cuSOLVER headers (and with
them a toolkit that ships those libraries); the glue needs only c10's stream, guard and error
headers. Every glue source is preprocessed (``-M``: header dependencies only, nothing compiled)
against the installed torch and the CUDA headers, and any dependency matching a forbidden name is
reported. Exits 1 if one is found or a source does not preprocess.

    python tools/check_glue_headers.py [--cuda-include DIR ...]

CUDA headers: the ``--cuda-include`` directories, else the include directories of the nvidia-*
wheels next to torch and ``$CUDA_HOME/include`` / ``/usr/local/cuda/include``. CXX picks the
compiler (default ``c++``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils.cpp_extension import include_paths

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = re.compile(
    r"(^|/)(cublas\w*|cusparse\w*|cusolver\w*|cufft\w*|curand\w*|cudnn\w*|nccl\w*)\.h$"
    r"|ATen/cuda/CUDAContext(Light)?\.h$"
)


def default_cuda_includes() -> list[Path]:
    """Include directories of the nvidia-* wheels torch depends on, then the system toolkit."""
    site = Path(torch.__file__).resolve().parent.parent
    dirs = sorted(site.glob("nvidia/*/include"))
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base:
            dirs.append(Path(base) / "include")
    return [d for d in dirs if (d / "cuda_runtime_api.h").is_file()]


def header_dependencies(source: Path, include_dirs: list[Path]) -> list[str]:
    """Every header ``source`` includes, directly or not (the compiler's ``-M`` output)."""
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    defines = ["-DVLLM_KV_WITH_CUDA"] if "cuda" in source.parts else []
    cmd = [*compiler, "-std=c++20", "-M", *defines, "-I", str(ROOT / "csrc")]
    for directory in include_dirs:
        cmd += ["-isystem", str(directory)]
    result = subprocess.run([*cmd, str(source)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{source.relative_to(ROOT)}: preprocessing failed:\n{result.stderr}")
    text = result.stdout.replace("\\\n", " ")
    return text.split(":", 1)[1].split()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda-include", type=Path, action="append", default=None)
    args = parser.parse_args()
    cuda_includes = args.cuda_include or default_cuda_includes()
    sources = sorted(ROOT.glob("csrc/*.cpp")) + sorted(ROOT.glob("csrc/*/*.cpp"))
    if any("cuda" in s.parts for s in sources) and not cuda_includes:
        print("FAIL: no CUDA headers found (cuda_runtime_api.h): pass --cuda-include DIR")
        return 1
    # Python's own headers too: csrc/fs_io is a plain CPython extension.
    torch_includes = [Path(p) for p in include_paths()] + [Path(sysconfig.get_paths()["include"])]
    failures = 0
    for source in sources:
        name = source.relative_to(ROOT)
        try:
            headers = header_dependencies(source, torch_includes + cuda_includes)
        except RuntimeError as error:
            print(f"FAIL {error}")
            failures += 1
            continue
        bad = sorted({h for h in headers if FORBIDDEN.search(h)})
        if bad:
            print(f"FAIL {name}: includes {len(bad)} forbidden header(s): " + ", ".join(bad[:8]))
            failures += 1
        else:
            print(f"PASS {name}: {len(headers)} headers, none of cuBLAS/cuSPARSE/CUDAContext")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
