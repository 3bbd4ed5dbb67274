"""vllm.triton_utils: the library imports without Triton (placeholders), and the AOT helpers
refuse to run under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.triton_utils.aot import compile_case, find_case_modules

ROOT = Path(__file__).resolve().parents[2]

# As if Triton were not installed: find_spec gives None and `import triton` fails.
WITHOUT_TRITON = "import sys\nsys.modules['triton'] = None\n"


def test_imports_without_triton() -> None:
    code = (
        WITHOUT_TRITON + "from vllm.triton_utils import HAS_TRITON, tl, triton\n"
        "import vllm.v1.attention.ops.triton_reshape_and_cache_flash_cases as w\n"
        "assert not HAS_TRITON\n"
        "assert triton.jit(len) is len and triton.jit()(len) is len\n"
        "assert tl.constexpr(7) == 7 and tl.int64 is None\n"
        "assert triton.cdiv(7, 2) == 4\n"
        "print('ok', len(w.triton_compile_cases()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under the interpreter")
def test_aot_refuses_the_interpreter() -> None:
    message = r"TRITON_INTERPRET: expected unset or 0 for ahead-of-time compilation .* got '1'"
    with pytest.raises(RuntimeError, match=message):
        find_case_modules()
    with pytest.raises(RuntimeError, match=message):
        compile_case("m", None, 80)  # type: ignore[arg-type]
