"""KV-scale calibration for engines: observe K/V batches, get each format's dequantization scales.

An engine feeds :class:`KVScaleObserver` the K and V it is about to cache (after RoPE, exactly
what it passes to ``reshape_and_cache_flash``: ``[T, H, D]`` of any float dtype) over a few
calibration batches; the observer keeps the running ``amax(|x|)`` per tensor or per KV head, and
:meth:`KVScaleObserver.scales` turns it into the fp32 ``k_scale`` / ``v_scale`` of a cache dtype
by the format's convention, ``scale = amax / MAX`` (:func:`kv_scale_max`):

- FP8 e4m3: ``MAX = 448``, e5m2: ``MAX = 57344`` (the variant's largest finite value);
- NVFP4: ``MAX = 448 * 6`` (:data:`~vllm.kv_quant.nvfp4.NVFP4_SCALE_MAX`; why, with measurements:
  docs/design.md §5.3);
- unquantized and per-token-head formats read no ``k_scale`` / ``v_scale`` (the per-token-head
  writers compute one scale per row): their scales are ones.

Choices: non-finite values (NaN, ±Inf) are ignored, not folded into the amax (one would make
every scale NaN or Inf, which the ops reject), and counted (:attr:`KVScaleObserver.nonfinite`);
an all-zero tensor or head gets scale 1.0 (any positive scale stores zeros exactly, and the ops
reject 0). A value above the observed amax saturates (FP8 at ``MAX * scale``, NVFP4 at the
amax), so calibrate over enough data. Scales have upstream's per-tensor shape (0-d) or ``[H]``.
"""

from __future__ import annotations

import torch

from vllm.kv_quant.codecs import codec_for
from vllm.kv_quant.formats import lookup

__all__ = ["KVScaleObserver", "kv_scale_max", "kv_scales_from_amax", "scale_from_amax"]


def kv_scale_max(kv_cache_dtype: str) -> float | None:
    """``MAX`` in ``scale = amax / MAX`` for ``kv_cache_dtype``: its codec's ``scale_max`` (the
    FP8 variant's largest value, ``448 * 6`` for NVFP4), ``None`` for formats whose writers and
    readers ignore ``k_scale`` / ``v_scale`` (unquantized, per-token-head)."""
    fmt = lookup(kv_cache_dtype, include_mla_only=False)
    if fmt.cache_kind is None:
        return None
    codec = codec_for(fmt)
    return codec.scale_max if codec.reads_kv_scale else None


def kv_scales_from_amax(amax: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """fp32 dequantization scales ``amax / kv_scale_max(kv_cache_dtype)``, same shape as
    ``amax``; 1.0 where that is not positive (an all-zero observation) and everywhere for a
    format that reads no scale."""
    scale_max = kv_scale_max(kv_cache_dtype)
    if scale_max is None:
        return torch.ones_like(amax, dtype=torch.float32)
    return scale_from_amax(amax, scale_max)


def scale_from_amax(amax: torch.Tensor, scale_max: float) -> torch.Tensor:
    """fp32 ``amax / scale_max``, same shape as ``amax``; 1.0 where that is not positive (an
    all-zero observation: any positive scale stores zeros exactly, and the ops reject 0)."""
    amax = amax.to(torch.float32)
    scale = amax / torch.tensor(scale_max, dtype=torch.float32, device=amax.device)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _finite_abs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``|x|`` with non-finite values set to 0, and how many there were (a 0-d tensor)."""
    finite = torch.isfinite(x)
    return torch.where(finite, x.abs(), torch.zeros_like(x)), (~finite).sum()


class KVScaleObserver:
    """Running ``amax(|x|)`` of the K and V an engine caches, and the scales it implies.

    ``per_head=False`` keeps one amax per side (scales 0-d, upstream's shape); ``per_head=True``
    one per KV head (scales ``[H]``). :meth:`observe` runs on the batches' device without a
    host sync; :meth:`scales` may be asked for several cache dtypes from one calibration.
    """

    def __init__(self, per_head: bool = False) -> None:
        if not isinstance(per_head, bool):
            raise ValueError(f"per_head: expected a bool, got {per_head!r}")
        self.per_head = per_head
        self.k_amax: torch.Tensor | None = None
        """fp32 running amax of K (0-d or ``[H]``), ``None`` before the first batch."""
        self.v_amax: torch.Tensor | None = None
        """fp32 running amax of V, like :attr:`k_amax`."""
        self._nonfinite: torch.Tensor | None = None
        self._k_sum: torch.Tensor | None = None  # fp64 [H, D] sum of finite keys
        self._k_count: torch.Tensor | None = None  # fp64 [H, D] how many were finite

    @property
    def nonfinite(self) -> int:
        """NaN and ±Inf values seen so far (ignored by the amax)."""
        return 0 if self._nonfinite is None else int(self._nonfinite.item())

    def _check(self, name: str, x: object, num_heads: int | None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() != 3:
            got = (
                f"{x.dtype} of shape {list(x.shape)}"
                if isinstance(x, torch.Tensor)
                else type(x).__name__
            )
            raise ValueError(f"{name}: expected a float tensor [T, H, D], got {got}")
        if num_heads is not None and x.shape[1] != num_heads:
            raise ValueError(f"{name}: expected {num_heads} KV heads, got {x.shape[1]}")
        return x

    def _amax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        magnitude, nonfinite = _finite_abs(x.detach())
        amax = magnitude.amax(dim=(0, 2)) if self.per_head else magnitude.amax()
        return amax.to(torch.float32), nonfinite

    def observe(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fold one batch into the running amax: ``key [T, H, D]`` and ``value [T, H, Dv]`` as
        the writer takes them (after RoPE), any float dtype, on one device. Everything is
        checked before the running values change."""
        known = None if self.k_amax is None or not self.per_head else self.k_amax.shape[0]
        key = self._check("key", key, known)
        value = self._check("value", value, key.shape[1])
        if value.shape[0] != key.shape[0]:
            raise ValueError(
                f"value: expected {key.shape[0]} tokens like key, got {value.shape[0]}"
            )
        if self._k_sum is not None and tuple(key.shape[1:]) != tuple(self._k_sum.shape):
            raise ValueError(
                f"key: expected [T, {self._k_sum.shape[0]}, {self._k_sum.shape[1]}] like the "
                f"batches before, got {list(key.shape)}"
            )
        device = key.device if self.k_amax is None else self.k_amax.device
        for name, x in (("key", key), ("value", value)):
            if x.device != device:
                raise ValueError(f"{name}: expected device {device}, got {x.device}")
        if key.shape[0] == 0:
            return
        (k_amax, k_bad), (v_amax, v_bad) = self._amax(key), self._amax(value)
        finite = torch.isfinite(key)
        k_sum = torch.where(finite, key, torch.zeros_like(key)).to(torch.float64).sum(0)
        k_count = finite.to(torch.float64).sum(0)
        if self._k_sum is not None and self._k_count is not None:
            k_sum, k_count = k_sum + self._k_sum, k_count + self._k_count
        self._k_sum, self._k_count = k_sum, k_count
        if self.k_amax is not None and self.v_amax is not None and self._nonfinite is not None:
            k_amax, v_amax = torch.maximum(self.k_amax, k_amax), torch.maximum(self.v_amax, v_amax)
            k_bad = k_bad + self._nonfinite
        self.k_amax, self.v_amax, self._nonfinite = k_amax, v_amax, k_bad + v_bad

    def key_mean(self) -> torch.Tensor:
        """fp32 ``[H, D]``: the mean of the observed keys per KV head and channel (finite values
        only; 0 where none was): the key offset a cache subtracts before writing
        (``AttentionKVCache.set_key_offset``). Summed in fp64 by torch, whose reduction order
        depends on the device: offsets calibrated on different devices may differ in the last
        fp32 bit (the attention does not depend on the offset in exact arithmetic).
        ``RuntimeError`` before any non-empty batch was observed."""
        if self._k_sum is None or self._k_count is None:
            raise RuntimeError("key_mean: no K/V observed yet; call observe(key, value) first")
        mean = self._k_sum / self._k_count.clamp_min(1)
        return mean.to(torch.float32)

    def scales(self, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)``: fp32 ``amax / MAX`` for ``kv_cache_dtype``
        (:func:`kv_scales_from_amax`; ones for a format that reads no scale), 0-d or ``[H]``,
        on the batches' device. ``RuntimeError`` before any non-empty batch was observed."""
        if self.k_amax is None or self.v_amax is None:
            raise RuntimeError("scales: no K/V observed yet; call observe(key, value) first")
        return (
            kv_scales_from_amax(self.k_amax, kv_cache_dtype),
            kv_scales_from_amax(self.v_amax, kv_cache_dtype),
        )
