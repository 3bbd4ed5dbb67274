"""Short human-readable names of a spec's cache format and shape (for reports and tables)."""

from __future__ import annotations

from vllm.kv_quant.formats import find_dtype_name
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec, MambaSpec

__all__ = ["describe_spec", "short_dtype_name", "spec_format_label", "spec_format_name"]


def spec_format_name(spec: KVCacheSpec) -> str:
    """The storage format of a spec: the registry label of a quantized format (``fp8_ds_mla``,
    ``nvfp4``, ``fp8``) or the torch dtype name of an unquantized cache (``bfloat16``, ...; a
    Mamba spec's first state dtype)."""
    if isinstance(spec, MambaSpec):
        return str(spec.dtypes[0]).removeprefix("torch.")
    assert isinstance(spec, AttentionSpec)
    fmt = spec.kv_cache_format
    return fmt.label if fmt.is_quantized else str(spec.dtype).removeprefix("torch.")


def short_dtype_name(name: str) -> str:
    """The registry label (``bf16``, ``fp16``, ``fp32``, ``fp8``, ...) of a cache dtype string or
    torch dtype name; other names unchanged."""
    fmt = find_dtype_name(name)
    return name if fmt is None else fmt.label


def spec_format_label(spec: KVCacheSpec) -> str:
    """Short storage-format name of a spec: bf16, fp16, fp32, fp8, fp8_ds_mla or nvfp4."""
    return short_dtype_name(spec_format_name(spec))


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
