"""``vllm-kv check`` over the packed-slot formats: the model report takes them with either backend
(CPU_ATTN's compiled reader, the default, or REFERENCE's), a real model run gives their rows in
the usual JSON schema, and the check's backend reader attends over their pages as the codec
reader does."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from real_kv_samples import smollm2
from vllm.accuracy.backend_reader import BackendReader
from vllm.accuracy.cache_io import allocate_cache, extension_status, write_cache
from vllm.accuracy.codec_reader import CodecReader
from vllm.accuracy.formats import compute_scales, parse_format
from vllm.accuracy.synthetic import synthetic_sample
from vllm.cli.check_model import model_formats
from vllm.cli.main import main
from vllm.kv_quant.formats import formats
from vllm.kv_quant.slot_codecs import is_packed
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.reference import ReferenceAttentionBackend

PACKED = tuple(f.name for f in formats() if is_packed(f))


def _names(attention: str | None) -> list[str]:
    args = argparse.Namespace(attention=attention, formats=None)
    return [f.kv_cache_dtype for f in model_formats(args)]


def test_packed_formats_are_measured_through_either_backend() -> None:
    assert len(PACKED) == 8
    reference = _names("REFERENCE")
    assert set(PACKED) <= set(reference) and "int4_per_token_head" in reference
    cpu = _names("CPU_ATTN")
    assert cpu == reference
    assert set(cpu) <= set(CPUAttentionBackend.supported_kv_cache_dtypes)


@pytest.mark.parametrize("name", PACKED)
def test_model_cache_is_the_backend_cache(name: str) -> None:
    """The model report's per-layer cache is what REFERENCE allocates: its shape, stored block,
    token, head, slot."""
    fmt = parse_format(name)
    cache = allocate_cache(fmt, 5, 16, 3, 64, seed=1)
    assert tuple(cache.shape) == ReferenceAttentionBackend.get_kv_cache_shape(5, 16, 3, 64, name)
    assert cache.transpose(1, 2).is_contiguous()
    assert cache.dtype == torch.uint8


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "ultraquant_4bit", "octave_k3v3"])
def test_backend_reader_attends_like_the_codec_reader(name: str) -> None:
    fmt = parse_format(name)
    sample = synthetic_sample(seed=3, num_kv_heads=2, head_size=64, seq_lens=(40, 17))
    k_scale, v_scale = compute_scales(sample.key, sample.value, fmt)
    cache = write_cache(sample, fmt, k_scale, v_scale)
    codec = CodecReader().attend(cache, sample.query, sample.query_lens)
    backend = BackendReader().attend(cache, sample.query, sample.query_lens)
    torch.testing.assert_close(backend, codec, rtol=1e-4, atol=1e-4)


def test_model_report_rows_for_a_packed_format(tmp_path: Path, capsys) -> None:
    """The real model with the smallest settings (one prompt, 16 text tokens, 2 new tokens)."""
    if not extension_status()[0]:
        pytest.skip("check --model needs the compiled extension first")
    if smollm2.missing_packages():
        pytest.skip(f"the model extra is not installed: {smollm2.INSTALL_HINT}")
    out = tmp_path / "report.json"
    argv = ["check", "--model", "smollm2-135m"]  # CPU_ATTN: the compiled packed-slot reader
    argv += ["--formats", "turboquant_4bit_nc", "--max-tokens", "16", "--new-tokens", "2"]
    assert main([*argv, "--prompts", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["model_report"]
    assert report["backend"] == "CPU_ATTN"
    bf16, packed = report["rows"]
    assert (bf16["format"], packed["format"]) == ("bf16", "turboquant_4bit_nc")
    assert packed.keys() == bf16.keys()
    assert packed["scale_method"] == "its own, inside each slot (packed K+V)"
    # 30 layers x 3 KV heads x 70-byte slots (head size 64) per token.
    assert packed["kv_bytes_per_token"] == 30 * 3 * 70
    for text, ppl in packed["perplexity"].items():
        assert math.isfinite(ppl) and ppl > 1
        # A 4-bit cache stays near the bf16 cache on 16 tokens.
        assert abs(ppl / bf16["perplexity"][text] - 1) < 0.5
    assert 0 <= packed["greedy_vs_bf16"] <= 2
