"""``check`` rows of the per-token-head caches (``int8_per_token_head``, ``fp8_per_token_head``):
the writer computes one inline scale per token and head, the readers use those scales, and the
measured errors are those of the codec's own round trip."""

from __future__ import annotations

import pytest
import torch
from kv_cache_test_utils import PER_TOKEN_HEAD_DTYPES

from vllm.accuracy.cache_io import make_reader, write_cache
from vllm.accuracy.formats import TOKEN_HEAD, compute_scales, parse_format
from vllm.accuracy.runner import CheckReport
from vllm.accuracy.samples import KVSample
from vllm.kv_quant.per_token_head import (
    dequantize_per_token_head,
    pack_rows,
    quantize_per_token_head,
)

PER_TOKEN_HEAD = tuple(PER_TOKEN_HEAD_DTYPES)


@pytest.mark.parametrize(("name", "qmax"), [(PER_TOKEN_HEAD[0], "127"), (PER_TOKEN_HEAD[1], "448")])
def test_scale_rule_and_unit_scales(synth: KVSample, name: str, qmax: str) -> None:
    fmt = parse_format(name)
    assert fmt.granularity == TOKEN_HEAD
    assert fmt.scale_method == f"amax(|x|)/{qmax} per token and head, inline"
    k_scale, v_scale = compute_scales(synth.key, synth.value, fmt)
    assert k_scale.tolist() == [1.0] and v_scale.tolist() == [1.0]


def test_report_rows(synth_report: CheckReport) -> None:
    table = synth_report.to_table()
    assert "int8_per_token_head amax(|x|)/127 per token and head, inline;" in table
    assert "fp8_per_token_head amax(|x|)/448 per token and head, inline;" in table.splitlines()[3]
    for name in PER_TOKEN_HEAD:
        rep = synth_report.get(name)
        assert rep.scales["synthetic"] == {}  # the scales live in the rows
        row = next(line.split() for line in table.splitlines() if line.startswith(name + " "))
        assert row[1:4] == [TOKEN_HEAD, "2112", "1.94x"]


def test_per_token_head_beats_per_tensor_fp8(synth_report: CheckReport) -> None:
    """A scale per row fits each token's range: less error than one scale per tensor, and int8's
    uniform grid (7 bits of magnitude) beats e4m3's 3 mantissa bits."""
    int8 = synth_report.get("int8_per_token_head").metrics
    fp8 = synth_report.get("fp8_per_token_head").metrics
    e4m3 = synth_report.get("fp8_e4m3").metrics
    for m in (int8, fp8):
        assert m.k_rel_rms < e4m3.k_rel_rms and m.v_rel_rms < e4m3.v_rel_rms
        assert m.out_cos_mean > e4m3.out_cos_mean and m.kl_mean < e4m3.kl_mean
    assert int8.k_rel_rms < 0.7 * fp8.k_rel_rms and int8.out_rel_err < fp8.out_rel_err
    assert int8.out_cos_mean >= 0.999 and fp8.out_cos_mean >= 0.998, (int8, fp8)


@pytest.mark.parametrize("name", PER_TOKEN_HEAD)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_readers_return_the_codec_round_trip(synth: KVSample, name: str, layout: str) -> None:
    """Both readers give back exactly the codec's dequantized K/V, whatever k_scale says (the
    writer ignores it), and the reference backend's attention matches the codec reader's."""
    fmt = parse_format(name)
    seven = torch.full((1,), 7.0)
    cache = write_cache(synth, fmt, seven, seven, writer="reference", layout=layout)
    want = [
        dequantize_per_token_head(pack_rows(*quantize_per_token_head(x, name)), name)
        for x in (synth.key, synth.value)
    ]
    backend, codec = make_reader("backend"), make_reader("codec")
    for reader in (backend, codec):
        got = reader.read_kv(cache)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    out = backend.attend(cache, synth.query, synth.query_lens)
    ref = codec.attend(cache, synth.query, synth.query_lens)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", PER_TOKEN_HEAD)
def test_readers_use_the_inline_scales(synth: KVSample, name: str) -> None:
    """Doubling every stored scale doubles what the readers return: the scale comes from the row,
    not from the cache's k_scale (a reader ignoring the rows' scales fails this)."""
    fmt = parse_format(name)
    one = torch.ones(1)
    cache = write_cache(synth, fmt, one, one, writer="reference")
    before, _ = make_reader("backend").read_kv(cache)
    d = synth.head_size
    scales = cache.kv_cache[..., d:].contiguous().view(torch.float32)
    cache.kv_cache[..., d:] = (
        (scales * 2).view(cache.kv_cache.dtype).view(cache.kv_cache[..., d:].shape)
    )
    after, _ = make_reader("backend").read_kv(cache)
    torch.testing.assert_close(after, 2 * before, rtol=0, atol=0)
