"""Short human-readable names of a spec's cache format and shape (for reports and tables)."""

from __future__ import annotations

from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

__all__ = ["describe_spec", "short_dtype_name", "spec_format_label", "spec_format_name"]


def spec_format_name(spec: KVCacheSpec) -> str:
    """The storage format of a spec: ``fp8_ds_mla``, ``nvfp4``, ``fp8`` or the torch dtype name
    of an unquantized cache (``bfloat16``, ...; a Mamba spec's first state dtype)."""
    if isinstance(spec, MambaSpec):
        return str(spec.dtypes[0]).removeprefix("torch.")
    if getattr(spec, "cache_dtype_str", None) == "fp8_ds_mla":
        return "fp8_ds_mla"
    mode = spec.kv_quant_mode  # type: ignore[attr-defined]
    if mode.is_nvfp4:
        return "nvfp4"
    if mode.is_fp8:
        return "fp8"
    return str(spec.dtype).removeprefix("torch.")  # type: ignore[attr-defined]


def short_dtype_name(name: str) -> str:
    """``bf16``, ``fp16``, ``fp32`` or ``fp8`` for a dtype name; other names unchanged."""
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}.get(
        name, "fp8" if name.startswith("fp8") else name
    )


def spec_format_label(spec: KVCacheSpec) -> str:
    """Short storage-format name of a spec: bf16, fp16, fp32, fp8, fp8_ds_mla or nvfp4."""
    name = spec_format_name(spec)
    return name if name in ("fp8_ds_mla", "nvfp4", "fp8") else short_dtype_name(name)


def describe_spec(spec: KVCacheSpec) -> str:
    """A short human-readable description of a spec (heads, head size, dtype, window, ratio)."""
    if isinstance(spec, MambaSpec):
        parts = [
            f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
            for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
        ]
        return f"{spec.mamba_type} state " + " + ".join(parts)
    heads, head_size = spec.num_kv_heads, spec.head_size  # type: ignore[attr-defined]
    text = f"H={heads} D={head_size} {spec_format_name(spec)}"
    window = getattr(spec, "sliding_window", None)
    if window is not None:
        text += f" window={window}"
    ratio = getattr(spec, "compress_ratio", 1)
    if ratio > 1:
        text += f" ratio={ratio}"
    return text
