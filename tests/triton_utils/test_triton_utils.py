"""vllm.triton_utils: the placeholders that stand in for Triton when it is not installed, the
rules that decide whether Triton can launch kernels here (``HAS_TRITON``, upstream's driver
rules plus the interpreter), the real modules even where nothing can launch, and the AOT
helpers refusing the interpreter."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest

import vllm.triton_utils
from vllm.triton_utils import importing
from vllm.triton_utils.aot import compile_case, find_case_modules
from vllm.triton_utils.importing import TritonLanguagePlaceholder, TritonPlaceholder

ROOT = Path(__file__).resolve().parents[2]

# As if Triton were not installed: find_spec gives None and `import triton` fails.
WITHOUT_TRITON = "import sys\nsys.modules['triton'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


# ------------------------------------------------------------------------------ placeholders


def test_placeholders_are_modules() -> None:
    triton = TritonPlaceholder()
    assert isinstance(triton, types.ModuleType) and triton.__name__ == "triton"
    assert isinstance(triton.language, TritonLanguagePlaceholder)
    assert triton.language.__name__ == "triton.language"
    assert triton.cdiv(7, 2) == 4


@pytest.mark.parametrize("decorator", ["jit", "autotune", "heuristics"])
def test_placeholder_decorators_return_the_function(decorator: str) -> None:
    wrap = getattr(TritonPlaceholder(), decorator)

    def double(x: int) -> int:
        return 2 * x

    assert wrap(double) is double
    assert wrap(configs=[], key="x", debug=True)(double) is double
    assert wrap({"BLOCK": lambda args: 64})(double) is double


def test_language_placeholder() -> None:
    tl = TritonLanguagePlaceholder()
    assert tl.constexpr(2**31 - 1) == 2**31 - 1 and tl.constexpr(1.5) == 1.5
    assert tl.dtype is None and tl.int64 is None and tl.int32 is None and tl.tensor is None
    with pytest.raises(AttributeError):
        _ = tl.__wrapped__


def test_imports_without_triton() -> None:
    result = _run(
        WITHOUT_TRITON + "from vllm.triton_utils import HAS_TRITON, TRITON_INSTALLED, tl, triton\n"
        "import vllm.v1.attention.ops.triton_reshape_and_cache_flash_cases as w\n"
        "assert not HAS_TRITON and not TRITON_INSTALLED\n"
        "assert type(triton).__name__ == 'TritonPlaceholder'\n"
        "assert type(tl).__name__ == 'TritonLanguagePlaceholder'\n"
        "assert triton.jit(len) is len and triton.jit()(len) is len\n"
        "assert tl.constexpr(7) == 7 and tl.int64 is None\n"
        "assert triton.cdiv(7, 2) == 4\n"
        "print('ok', len(w.triton_compile_cases()))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


# ------------------------------------------------------------------------------ HAS_TRITON


def _fake_triton(drivers: dict[str, bool], *, broken: bool = False) -> dict[str, object]:
    """``sys.modules`` entries of a Triton whose backends' drivers report ``drivers`` (name ->
    active); ``broken``: ``triton.backends`` does not import."""
    backends = {}
    for name, active in drivers.items():
        backend = mock.Mock()
        backend.driver.is_active.return_value = active
        backends[name] = backend
    triton = types.ModuleType("triton")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    backends_module = types.ModuleType("triton.backends")
    backends_module.backends = backends  # type: ignore[attr-defined]
    return {"triton": triton, "triton.backends": None if broken else backends_module}


def _reload(
    drivers: dict[str, bool],
    *,
    version: str | None = "0.1.0",
    env: dict[str, str] | None = None,
    broken: bool = False,
) -> tuple[bool, bool]:
    """``(HAS_TRITON, TRITON_INSTALLED)`` of the module reloaded against a fake Triton, the
    library installed at ``version`` (``None``: not installed) and exactly ``env``; the real
    module is reloaded afterwards."""

    def fake_version(name: str) -> str:
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    try:
        with (
            mock.patch.dict(sys.modules, _fake_triton(drivers, broken=broken)),
            mock.patch.dict(os.environ, env or {}, clear=True),
            mock.patch("importlib.metadata.version", fake_version),
        ):
            module = importlib.reload(importing)
            return module.HAS_TRITON, module.TRITON_INSTALLED
    finally:
        importlib.reload(importing)


CPU_BUILD = "0.1.0+cpu"


@pytest.mark.parametrize(
    ("drivers", "version", "env", "expected"),
    [
        # Upstream's cases: one active GPU driver; the cpu backend (always active) not counted.
        ({"amd": True}, "0.1.0", {}, True),
        ({"amd": True, "cpu": True}, "0.1.0", {}, True),
        ({"amd": True, "nvidia": True}, "0.1.0", {}, False),
        ({"cpu": True}, "0.1.0", {}, False),
        ({"cpu": True}, CPU_BUILD, {}, True),
        ({"amd": True}, CPU_BUILD, {}, False),
        # A Triton-CPU build with one GPU driver active too launches; with two it does not.
        ({"cpu": True, "nvidia": True}, CPU_BUILD, {}, True),
        ({"cpu": True, "amd": True, "nvidia": True}, CPU_BUILD, {}, False),
        # Not installed (a source tree): not a Triton-CPU build.
        ({"cpu": True}, None, {}, False),
        # No active driver: a GPU-less host; a distributed worker before its devices are set.
        ({"amd": False, "nvidia": False}, "0.1.0", {}, False),
        ({"amd": False, "nvidia": False}, "0.1.0", {"CUDA_VISIBLE_DEVICES": " "}, True),
        ({"amd": True, "nvidia": True}, "0.1.0", {"CUDA_VISIBLE_DEVICES": ""}, False),
        ({"nvidia": False}, "0.1.0", {"CUDA_VISIBLE_DEVICES": "0"}, False),
        # The interpreter needs no driver (how the CPU tests run the kernels).
        ({"amd": False, "nvidia": False}, "0.1.0", {"TRITON_INTERPRET": "1"}, True),
        ({"amd": True, "nvidia": True}, "0.1.0", {"TRITON_INTERPRET": "1"}, True),
        ({"amd": False, "nvidia": False}, "0.1.0", {"TRITON_INTERPRET": "0"}, False),
    ],
)
def test_driver_rules(
    drivers: dict[str, bool], version: str | None, env: dict[str, str], expected: bool
) -> None:
    assert _reload(drivers, version=version, env=env) == (expected, True)


def test_partial_install_is_no_triton() -> None:
    assert _reload({"nvidia": True}, broken=True) == (False, False)


def test_the_test_process_launches() -> None:
    """Where the tests run (a GPU, or the interpreter that tests/conftest.py turns on without
    one) Triton launches, also once a test has reloaded the module against a fake Triton."""
    pytest.importorskip("triton")
    _reload({"amd": True, "nvidia": True})
    assert importing.HAS_TRITON and vllm.triton_utils.HAS_TRITON


def test_a_raising_driver_probe_means_no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backend = mock.Mock()
    backend.driver.is_active.side_effect = RuntimeError("cuInit failed")
    assert importing._can_launch({"nvidia": backend}) is False


def test_launch_problem_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(importing, "_is_cpu_build", lambda: False)
    active = mock.Mock()
    active.driver.is_active.return_value = True
    assert importing.launch_problem({"amd": active, "nvidia": active}) == (
        "expected 1 active Triton driver, got 2: ['amd', 'nvidia']"
    )
    monkeypatch.setattr(importing, "_is_cpu_build", lambda: True)
    assert importing.launch_problem({"nvidia": active}) == (
        "this is a Triton-CPU build, but Triton has no cpu backend"
    )


def test_real_modules_where_no_kernel_launches() -> None:
    """Without the interpreter and without an active driver (a CPU host), Triton cannot launch,
    yet the kernels stay ``@triton.jit`` functions: the ahead-of-time compile needs them."""
    pytest.importorskip("triton")
    result = _run(
        "import triton\n"
        "from vllm.triton_utils import HAS_TRITON, TRITON_INSTALLED, tl\n"
        "import vllm.v1.attention.ops.triton_reshape_and_cache_flash_cases as w\n"
        "assert TRITON_INSTALLED and tl is triton.language\n"
        "kernels = {type(case.kernel) for case in w.triton_compile_cases()}\n"
        "assert kernels == {triton.runtime.JITFunction}, kernels\n"
        "print('ok', HAS_TRITON)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


# ------------------------------------------------------------------------------ AOT


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under the interpreter")
def test_aot_refuses_the_interpreter() -> None:
    message = r"TRITON_INTERPRET: expected unset or 0 for ahead-of-time compilation .* got '1'"
    with pytest.raises(RuntimeError, match=message):
        find_case_modules()
    with pytest.raises(RuntimeError, match=message):
        compile_case("m", None, 80)  # type: ignore[arg-type]
