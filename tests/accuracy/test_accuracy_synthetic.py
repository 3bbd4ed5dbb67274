"""``check`` on synthetic data: exact bf16, sane ordering of formats, bounds, scales."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.accuracy.cache_io import extension_status, write_cache
from vllm.accuracy.formats import compute_scales, parse_format, parse_formats
from vllm.accuracy.runner import CheckReport, run_check
from vllm.accuracy.samples import KVSample
from vllm.accuracy.synthetic import synthetic_sample

NVFP4_COS_BOUND = 0.95
"""Mean attention-output cosine similarity that NVFP4 must reach on the default synthetic data.

A correct NVFP4 cache measures about 0.985 (per tensor) and 0.984 (per head) there; each of the
breaks in test_accuracy_breaks.py lands far below (wrong nibble order ~0.01, interleave4 scales
read as linear ~0.12, global scale inverted 0.77-0.83)."""

FP8_E4M3_COS_BOUND = 0.99
"""The same for FP8 e4m3 (measures about 0.998)."""


def test_bf16_is_exact(synth_report: CheckReport) -> None:
    m = synth_report.get("bf16").metrics
    assert m.k_rel_rms == 0.0 and m.k_max_abs == 0.0
    assert m.v_rel_rms == 0.0 and m.v_max_abs == 0.0
    assert m.out_rel_err == 0.0
    assert m.kl_mean == 0.0 and m.kl_max == 0.0
    assert m.out_cos_min >= 1.0 - 1e-6


def test_bytes_per_token(synth_report: CheckReport) -> None:
    # 8 KV heads, D = 128, K + V: bf16 2*8*128*2, fp8 half of it, nvfp4 2*8*F(128) = 2*8*72,
    # per-token-head rows 2*8*(128 + 4).
    got = {r.fmt.name: r.bytes_per_token for r in synth_report.formats}
    assert got == {
        "bf16": 4096,
        "fp8_e4m3": 2048,
        "fp8_e4m3/head": 2048,
        "fp8_e5m2": 2048,
        "fp8_e5m2/head": 2048,
        "nvfp4": 1152,
        "nvfp4/head": 1152,
        "int8_per_token_head": 2112,
        "fp8_per_token_head": 2112,
        # v0.33's formats: int4 rows 2*8*(64 + 4); packed K+V slots 8 * slot bytes (Octave at
        # 64 rotary dims, docs/formats.md §6).
        "int4_per_token_head": 1088,
        "octave_k3v4": 8 * 128,
        "octave_k3v3": 8 * 112,
        "octave_k3v3_compact": 8 * 100,
        "turboquant_k8v4": 8 * 196,
        "turboquant_4bit_nc": 8 * 134,
        "turboquant_k3v4_nc": 8 * 118,
        "turboquant_3bit_nc": 8 * 102,
        "ultraquant_4bit": 8 * 136,
    }


@pytest.mark.parametrize("suffix", ["", "/head"])
def test_fp8_better_than_nvfp4(synth_report: CheckReport, suffix: str) -> None:
    e4m3 = synth_report.get("fp8_e4m3" + suffix).metrics
    e5m2 = synth_report.get("fp8_e5m2" + suffix).metrics
    nvfp4 = synth_report.get("nvfp4" + suffix).metrics
    for fp8 in (e4m3, e5m2):
        assert fp8.k_rel_rms < nvfp4.k_rel_rms
        assert fp8.v_rel_rms < nvfp4.v_rel_rms
        assert fp8.out_rel_err < nvfp4.out_rel_err
        assert fp8.out_cos_mean > nvfp4.out_cos_mean
        assert fp8.kl_mean < nvfp4.kl_mean
    # e4m3 has one more mantissa bit than e5m2: about half the error.
    assert e4m3.k_rel_rms < 0.7 * e5m2.k_rel_rms
    assert e4m3.out_rel_err < e5m2.out_rel_err


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4/head"])
def test_nvfp4_meets_cos_bound(synth_report: CheckReport, name: str) -> None:
    m = synth_report.get(name).metrics
    assert m.out_cos_mean >= NVFP4_COS_BOUND, m
    # Relative RMS of E2M1 with e4m3 block scales on this data: ~0.09.
    assert 0.05 < m.k_rel_rms < 0.13 and 0.05 < m.v_rel_rms < 0.13, m


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e4m3/head"])
def test_fp8_e4m3_meets_cos_bound(synth_report: CheckReport, name: str) -> None:
    m = synth_report.get(name).metrics
    assert m.out_cos_mean >= FP8_E4M3_COS_BOUND, m
    assert m.k_rel_rms < 0.04 and m.v_rel_rms < 0.04, m


def test_scales_come_from_the_data(synth: KVSample, synth_report: CheckReport) -> None:
    k = synth.key.float().abs()
    v = synth.value.float().abs()
    cases = {
        "fp8_e4m3": (448.0, "448"),
        "nvfp4": (2688.0, "(448*6)"),
        "fp8_e5m2": (57344.0, "57344"),
    }
    for name, (div, div_text) in cases.items():
        rep = synth_report.get(name)
        scales = rep.scales["synthetic"]
        assert scales["k"] == pytest.approx([k.amax().item() / div], rel=1e-6)
        assert scales["v"] == pytest.approx([v.amax().item() / div], rel=1e-6)
        assert rep.fmt.scale_method == f"amax(|x|)/{div_text} per tensor"
        head = synth_report.get(name + "/head")
        assert head.scales["synthetic"]["k"] == pytest.approx(
            (k.amax(dim=(0, 2)) / div).tolist(), rel=1e-6
        )
        assert head.fmt.scale_method == f"amax(|x|)/{div_text} per head"


def test_table_and_json_are_well_formed(synth_report: CheckReport) -> None:
    table = synth_report.to_table()
    assert "fp8_e4m3 amax(|x|)/448 per tensor or per head" in table
    assert "fp8_e5m2 amax(|x|)/57344 per tensor or per head" in table
    assert "nvfp4 global scale amax(|x|)/(448*6) per tensor or per head" in table
    for rep in synth_report.formats:
        assert any(line.startswith(rep.fmt.name + " ") for line in table.splitlines())
    doc = synth_report.to_dict()
    assert [f["format"] for f in doc["formats"]] == [r.fmt.name for r in synth_report.formats]
    for f in doc["formats"]:
        assert set(f["metrics"]) == {
            "k_rel_rms",
            "k_max_abs",
            "v_rel_rms",
            "v_max_abs",
            "out_cos_mean",
            "out_cos_min",
            "out_rel_err",
            "kl_mean",
            "kl_max",
        }
        assert all(isinstance(x, float) and math.isfinite(x) for x in f["metrics"].values())


def test_synthetic_is_seeded_and_llm_like() -> None:
    a, b, c = synthetic_sample(seed=3), synthetic_sample(seed=3), synthetic_sample(seed=4)
    assert torch.equal(a.key, b.key) and torch.equal(a.query, b.query)
    assert not torch.equal(a.key, c.key)
    k = a.key.float()
    # Outlier channels: a few channels per head carry most of K's mean magnitude.
    channel_mean = k.mean(dim=0).abs()  # [H, D]
    assert (channel_mean > 3.0).sum(dim=1).tolist() == [4] * a.num_kv_heads
    # Large tokens: the first token of each sequence is far above the median token norm.
    norms = k.flatten(1).norm(dim=1)
    assert norms[0] > 1.8 * norms.median() and norms[a.seq_lens[0]] > 1.8 * norms.median()


def test_layouts_and_readers_agree(synth: KVSample, synth_report: CheckReport) -> None:
    """HND pages, interleave4 block scales and the plain codec reader give the same numbers as
    the default NHD / linear / backend path (they hold and read the same values)."""
    fmts = parse_formats("nvfp4,nvfp4@interleave4")
    hnd = run_check([synth], fmts, source="s", description="d", layout="HND", reader="codec")
    want = synth_report.get("nvfp4").metrics
    for rep in hnd.formats:
        got = rep.metrics
        assert got.k_rel_rms == want.k_rel_rms and got.v_max_abs == want.v_max_abs
        assert got.kl_mean == pytest.approx(want.kl_mean, rel=1e-5)
        assert got.out_cos_mean == pytest.approx(want.out_cos_mean, abs=1e-6)


@pytest.mark.skipif(not extension_status()[0], reason="compiled extension not built")
@pytest.mark.parametrize(
    "name",
    [
        "bf16",
        "fp8_e5m2/head",
        "nvfp4",
        "nvfp4@interleave4",
        "int8_per_token_head",
        "fp8_per_token_head",
        "turboquant_k8v4",
        "turboquant_3bit_nc",
        "ultraquant_4bit",
    ],
)
def test_op_and_reference_writers_agree(synth: KVSample, name: str) -> None:
    """The compiled op writes the same cache bytes as the reference codecs."""
    fmt = parse_format(name)
    k_scale, v_scale = compute_scales(synth.key, synth.value, fmt)
    op = write_cache(synth, fmt, k_scale, v_scale, writer="op")
    ref = write_cache(synth, fmt, k_scale, v_scale, writer="reference")
    assert (op.writer, ref.writer) == ("op", "reference")
    assert torch.equal(op.kv_cache.view(torch.uint8), ref.kv_cache.view(torch.uint8))
