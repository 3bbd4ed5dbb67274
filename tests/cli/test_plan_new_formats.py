"""``vllm-kv plan`` with v0.33's new cache dtypes: page sizes, Octave's rotary dims taken from the
model config, several dtypes side by side, and one-line errors where a format cannot cache a
model (exit 2, no traceback)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import vllm.kv_quant.octave as octave
from vllm.cli.main import main


@pytest.fixture(autouse=True)
def fresh_rope_dims() -> Iterator[None]:
    """Each test plans as a fresh process would: no rotary dims registered before it."""
    saved = dict(octave._rope_dims)
    octave._rope_dims.clear()
    yield
    octave._rope_dims.clear()
    octave._rope_dims.update(saved)


def _plan(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's own errors exit from the parser
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _config(tmp_path: Path, **changes: object) -> str:
    """A qwen3 config of 4 layers, 2 KV heads of 256 (Qwen3-Next's attention shape)."""
    config: dict[str, object] = {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_size": 2048,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


# Llama-3.1-8B pages of 16 tokens x 8 KV heads x head size 128, worked out from each layout
# (docs/formats.md §6): bytes per (token, head), K and V together, times 128.
LLAMA_PAGES = {
    "nvfp4_4over6": 2 * (64 + 8) * 128,  # NVFP4's page: the writer differs, not the bytes
    "int4_per_token_head": 2 * (64 + 4) * 128,
    "turboquant_k8v4": (128 + 64 + 4) * 128,  # fp8 K; 4-bit V, fp16 scale and zero
    "turboquant_4bit_nc": (64 + 2 + 64 + 4) * 128,  # 4-bit K codes + fp16 norm
    "turboquant_k3v4_nc": (48 + 2 + 64 + 4) * 128,
    "turboquant_3bit_nc": (48 + 2 + 48 + 4) * 128,
    "ultraquant_4bit": (128 + 2 * 4) * 128,  # D + 2 * D/32 scale bytes
    # Llama rotates every dim (no partial_rotary_factor): block K has 128 4-bit RoPE dims.
    "octave_k3v4": 136 * 128,  # 64 K + 64 V + 3 fp16 scales = 134, padded to 8
    "octave_k3v3": 120 * 128,  # 64 K + 48 V + 6 = 118, padded to 8
    "octave_k3v3_compact": 100 * 128,  # 48 K + 48 V + 2 scales, padded to 4
}


@pytest.mark.parametrize(("dtype", "page"), sorted(LLAMA_PAGES.items()))
def test_new_dtype_page_on_llama(capsys, dtype: str, page: int) -> None:
    code, out, err = _plan(capsys, "--kv-cache-dtype", dtype, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["kv_cache_dtypes"] == [dtype]
    assert report["layer_types"][0]["page_size_bytes"] == {dtype: page}
    assert report["kv_bytes"][dtype]["kv_bytes_per_token"] == 32 * page // 16


def test_nvfp4_ds_mla_on_deepseek_v3(capsys) -> None:
    code, out, err = _plan(
        capsys, "--model", "deepseek-v3", "--kv-cache-dtype", "nvfp4_ds_mla", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["layer_types"][0]["page_size_bytes"] == {"nvfp4_ds_mla": 16 * 352}


@pytest.mark.parametrize(
    ("dtype", "slot"), [("octave_k3v4", 248), ("octave_k3v3", 216), ("octave_k3v3_compact", 196)]
)
@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_octave_takes_partial_rotary_factor_from_the_config(
    capsys, tmp_path: Path, dtype: str, slot: int, where: str
) -> None:
    # D=256 with a quarter of the dims rotated: upstream's 248 / 216 / 196-byte slots.
    if where == "top":
        model = _config(tmp_path, partial_rotary_factor=0.25)
    else:
        model = _config(tmp_path, rope_parameters={"partial_rotary_factor": 0.25})
    code, out, err = _plan(capsys, "--model", model, "--kv-cache-dtype", dtype, "--json")
    assert code == 0, err
    assert json.loads(out)["layer_types"][0]["page_size_bytes"] == {dtype: 16 * 2 * slot}
    assert octave.registered_rope_dim(256) == 64


def test_several_dtypes_side_by_side_with_a_budget(capsys) -> None:
    dtypes = "bfloat16,int4_per_token_head,turboquant_k3v4_nc,octave_k3v3,ultraquant_4bit"
    code, out, err = _plan(capsys, "--kv-cache-dtype", dtypes, "--memory", "80GiB")
    assert code == 0, err
    header = next(line for line in out.splitlines() if "page" in line and "kind" in line)
    assert header.split()[-2:] == ["ultraquant_4bit", "page"]
    assert "15,360" in out and "15,104" in out and "concurrency vs bfloat16" in out


def test_default_columns_stay_the_kernel_formats(capsys) -> None:
    code, out, _ = _plan(capsys, "--json")
    assert code == 0
    assert json.loads(out)["kv_cache_dtypes"] == [
        "bfloat16",
        "fp8",
        "nvfp4",
        "int8_per_token_head",
        "fp8_per_token_head",
        "int4_per_token_head",
    ]


def _assert_usage_error(code: int, out: str, err: str, *expected: str) -> None:
    assert code == 2
    assert out == ""
    assert err.startswith("vllm-kv plan: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for text in expected:
        assert text in err, err


def test_ds_mla_record_on_a_non_mla_model_is_one_line(capsys) -> None:
    code, out, err = _plan(capsys, "--kv-cache-dtype", "nvfp4_ds_mla")
    _assert_usage_error(
        code, out, err, "--kv-cache-dtype: nvfp4_ds_mla cannot cache layer", "576", "got 128"
    )


@pytest.mark.parametrize("dtype", ["octave_k3v4", "octave_k3v3_compact"])
def test_octave_on_mla_is_one_line(capsys, dtype: str) -> None:
    code, out, err = _plan(capsys, "--model", "deepseek-v3", "--kv-cache-dtype", dtype)
    _assert_usage_error(code, out, err, f"--kv-cache-dtype: {dtype} cannot cache layer", "MLA")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"head_dim": 80}, "multiples of 64"),  # 80 is no multiple of 64
        ({"partial_rotary_factor": 0.1}, "rope_dim=25"),  # 25 rotary dims
    ],
)
def test_octave_geometry_the_format_cannot_hold_is_one_line(
    capsys, tmp_path: Path, changes: dict[str, object], expected: str
) -> None:
    model = _config(tmp_path, **changes)
    code, out, err = _plan(capsys, "--model", model, "--kv-cache-dtype", "octave_k3v4")
    _assert_usage_error(code, out, err, "--kv-cache-dtype: octave_k3v4 cannot cache", expected)


def test_compact_octave_needs_a_power_of_two(capsys, tmp_path: Path) -> None:
    model = _config(tmp_path, head_dim=192)
    code, out, err = _plan(capsys, "--model", model, "--kv-cache-dtype", "octave_k3v3_compact")
    _assert_usage_error(code, out, err, "power of two, got 192")


@pytest.mark.parametrize("factor", [0, 1.5, "half", True])
def test_unusable_rotary_factor_is_one_line(capsys, tmp_path: Path, factor: object) -> None:
    model = _config(tmp_path, partial_rotary_factor=factor)
    code, out, err = _plan(capsys, "--model", model, "--kv-cache-dtype", "octave_k3v3")
    _assert_usage_error(code, out, err, "--model: expected partial_rotary_factor in (0, 1]")


def test_conflicting_rotary_dims_in_one_process_is_one_line(capsys, tmp_path: Path) -> None:
    octave.register_rope_dim(256, 256)
    model = _config(tmp_path, partial_rotary_factor=0.25)
    code, out, err = _plan(capsys, "--model", model, "--kv-cache-dtype", "octave_k3v4")
    _assert_usage_error(code, out, err, "--model: rope_dim: head size 256 already has 256")


def test_rotary_dims_are_not_needed_by_other_formats(capsys, tmp_path: Path) -> None:
    model = _config(tmp_path, partial_rotary_factor="half")  # never read: no Octave column
    code, _, err = _plan(capsys, "--model", model, "--kv-cache-dtype", "turboquant_4bit_nc")
    assert code == 0, err
    assert 256 not in octave._rope_dims


@pytest.mark.parametrize("value", ["bfloat16,,fp8", "fp8,octave_k9"])
def test_bad_dtype_lists_are_one_line(capsys, value: str) -> None:
    code, out, err = _plan(capsys, "--kv-cache-dtype", value)
    _assert_usage_error(code, out, err, "--kv-cache-dtype: ")
