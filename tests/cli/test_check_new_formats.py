"""``vllm-kv check`` rows of v0.33's new formats: every registered format a reference codec reads
(per side, or packed K+V slots) is measured, written by its compiled store (its codec when the
extension is not built), and the row says which writer produced it."""

from __future__ import annotations

import argparse
import json

import pytest

from vllm.accuracy.cache_io import extension_status
from vllm.accuracy.formats import DEFAULT_FORMATS, MEASURED_FORMATS, parse_formats
from vllm.accuracy.runner import run_check
from vllm.accuracy.synthetic import synthetic_sample
from vllm.cli import check_model
from vllm.cli.check_model import model_formats
from vllm.cli.main import main
from vllm.kv_quant.codecs import has_codec
from vllm.kv_quant.formats import formats
from vllm.kv_quant.slot_codecs import is_packed

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

NEW = (
    "int4_per_token_head",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "ultraquant_4bit",
    "octave_k3v4",
    "octave_k3v3",
    "octave_k3v3_compact",
)
"""The new dtypes with K/V to compare (``nvfp4_ds_mla`` stores an MLA latent; ``nvfp4_4over6``
is measured on request, as ``nvfp4_mse``)."""


def test_every_format_with_a_codec_is_measured() -> None:
    measured = {f.name for f in MEASURED_FORMATS}
    for fmt in formats():
        if fmt.is_quantized and not fmt.mla_only and (has_codec(fmt) or is_packed(fmt)):
            assert fmt.name in measured
    assert set(NEW) <= set(DEFAULT_FORMATS)
    assert "nvfp4_ds_mla" not in measured


def test_new_format_rows_from_their_codecs() -> None:
    sample = synthetic_sample(num_kv_heads=2, seq_lens=(40, 24), queries_per_seq=4)
    report = run_check(
        [sample],
        parse_formats("bf16," + ",".join(NEW) + ",nvfp4_4over6"),
        source="synthetic",
        description="small",
    )
    compiled = extension_status()[0]
    for name in NEW:
        row = report.get(name)
        # The extension writes INT4 rows and every packed slot (each format's own store).
        assert row.writer == ("op" if compiled else "reference")
        m = row.metrics
        # Lossy but close: every format keeps the attention output's direction.
        assert 0 < m.k_rel_rms < 0.3 and 0 < m.v_rel_rms < 0.4, name
        assert m.out_cos_mean > 0.85, name
    # Packed slots: K and V of a (token, head) with their scales, D=128, 64 rotary dims.
    assert report.get("octave_k3v4").bytes_per_token == 2 * 128
    assert report.get("turboquant_k8v4").bytes_per_token == 2 * 196
    assert report.get("ultraquant_4bit").bytes_per_token == 2 * 136
    assert report.get("int4_per_token_head").bytes_per_token == 2 * 2 * 68
    assert report.get("octave_k3v4").fmt.granularity == "slot"
    table = report.to_table()
    for name in ("octave_k3v3", "turboquant_3bit_nc"):
        line = next(x for x in table.splitlines() if x.startswith(name))
        assert line.split()[-1] == ("op" if compiled else "reference")


def test_cli_rows_and_json(capsys: pytest.CaptureFixture) -> None:
    argv = ["check", "--formats", "bf16,octave_k3v3_compact,ultraquant_4bit", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {f["format"]: f for f in doc["reports"][0]["formats"]}
    for name in ("ultraquant_4bit", "octave_k3v3_compact"):
        assert rows[name]["writer"] == ("op" if extension_status()[0] else "reference")
    assert rows["octave_k3v3_compact"]["scale_granularity"] == "slot"
    assert rows["octave_k3v3_compact"]["metrics"]["out_cos_mean"] > 0.85


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("octave_k3v4/head", "scales are inside each slot"),
        ("turboquant_k8v4@linear", "turboquant_k8v4"),
        ("nvfp4_ds_mla", "nvfp4_ds_mla"),
    ],
)
def test_impossible_new_format_ids_are_one_line(
    capsys: pytest.CaptureFixture, value: str, expected: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check", "--formats", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-kv check: error: --formats: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in err


def test_model_report_takes_what_its_backend_reads() -> None:
    """CPU_ATTN and REFERENCE read the same formats: the packed K+V slots included."""
    cpu = [f.name for f in model_formats(argparse.Namespace(attention=None, formats=None))]
    assert "int4_per_token_head" in cpu and "nvfp4/head" in cpu
    packed = [f.name for f in parse_formats(",".join(cpu)) if is_packed(f.format)]
    assert set(packed) == set(NEW) - {"int4_per_token_head"}
    ref = [f.name for f in model_formats(argparse.Namespace(attention="REFERENCE", formats=None))]
    assert ref == cpu


@pytest.mark.parametrize("backend", [None, "REFERENCE"])
def test_model_report_refuses_formats_its_backend_cannot_read(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, backend: str | None
) -> None:
    """A format the backend has no reader for (here: one taken from its list) is named."""
    if not extension_status()[0]:
        pytest.skip("check --model needs the compiled extension first")
    reads = check_model.backend_dtypes
    monkeypatch.setattr(
        check_model, "backend_dtypes", lambda name: reads(name) - {"ultraquant_4bit"}
    )
    argv = ["check", "--model", "smollm2-135m", "--formats", "bf16,ultraquant_4bit"]
    assert main(argv + ([] if backend is None else ["--attention", backend])) == 2
    err = capsys.readouterr().err
    name = backend or "CPU_ATTN"
    assert err.startswith(f"vllm-kv check: error: --formats: expected formats the {name} ")
    assert "got ultraquant_4bit (no " in err and err.count("\n") == 1
    assert "; vllm-kv check without --model measures it)" in err


def test_a_head_size_a_format_cannot_hold_is_a_note_not_a_crash() -> None:
    # MiniLM's 32-dim heads (check --real): Octave needs 64-dim blocks.
    sample = synthetic_sample(num_kv_heads=2, head_size=32, seq_lens=(20,), queries_per_seq=2)
    report = run_check(
        [sample], parse_formats("bf16,octave_k3v3,ultraquant_4bit"), source="s", description="d"
    )
    assert [r.fmt.name for r in report.formats] == ["bf16", "ultraquant_4bit"]
    assert any(n.startswith("octave_k3v3: not measured on") and "64" in n for n in report.notes)
    assert not any("octave_k3v3" in n for n in report.notes if n.startswith("writer:"))
