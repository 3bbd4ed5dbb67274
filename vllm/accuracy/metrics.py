"""Error metrics of a cache format: K/V reconstruction and attention output vs bf16.

All metrics are computed in fp32 against the bf16 reference (the sample's K/V, which a bf16
cache holds exactly):

- K/V reconstruction: relative RMS error ``||x̂ - x||_2 / ||x||_2`` over all elements, and the
  largest absolute error ``max |x̂ - x|`` (in the units of the activations).
- Attention output ``O [Tq, Hq, Dv]`` vs the output ``O_ref`` the same reader computes from a
  bf16 cache: cosine similarity per query token (over the concatenated heads, the vector the
  output projection reads; mean and min over tokens) and relative error
  ``||O - O_ref||_F / ||O_ref||_F``.
- Attention probabilities: for every (query, query head), ``KL(p_ref || p̂)`` in nats, where
  ``p = softmax(q·k / sqrt(D))`` over the sequence's keys, ``p_ref`` from the bf16 keys and
  ``p̂`` from the dequantized keys (mean and max over rows).

:class:`MetricsAccumulator` sums the raw quantities, so aggregating over several samples (the
layers of a model) gives exact global values, not means of means.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from vllm.accuracy.attention import attention_logits
from vllm.accuracy.paged_cache import CacheReader, PagedCache
from vllm.accuracy.samples import KVSample


@dataclass(frozen=True)
class FormatMetrics:
    """Error of one format (see the module docstring for definitions and units)."""

    k_rel_rms: float
    k_max_abs: float
    v_rel_rms: float
    v_max_abs: float
    out_cos_mean: float
    out_cos_min: float
    out_rel_err: float
    kl_mean: float
    kl_max: float

    def to_dict(self) -> dict[str, float | None]:
        """Plain dict; non-finite values (a NaN from a broken cache) become ``None``."""
        return {k: (v if math.isfinite(v) else None) for k, v in asdict(self).items()}


def _nanmax(a: float, b: float) -> float:
    return float("nan") if math.isnan(a) or math.isnan(b) else max(a, b)


def _nanmin(a: float, b: float) -> float:
    return float("nan") if math.isnan(a) or math.isnan(b) else min(a, b)


@dataclass
class _Sums:
    sq_err: float = 0.0
    sq_ref: float = 0.0
    max_abs: float = 0.0

    def add(self, ref: torch.Tensor, approx: torch.Tensor) -> None:
        ref32 = ref.to(torch.float32)
        err = approx.to(torch.float32) - ref32  # exact zero where approx == ref
        # Widen before summing (sum(dtype=float64) is far slower on CPU than a cast).
        self.sq_err += float(err.double().square().sum())
        self.sq_ref += float(ref32.double().square().sum())
        if err.numel():
            self.max_abs = _nanmax(self.max_abs, float(err.abs().max()))

    @property
    def rel(self) -> float:
        if self.sq_ref == 0.0:
            return 0.0 if self.sq_err == 0.0 else float("inf")
        return math.sqrt(self.sq_err / self.sq_ref)


@dataclass(frozen=True)
class Reference:
    """What a sample's metrics are measured against, computed once per sample.

    ``out``: attention output ``[Tq, Hq, Dv]`` of the reader over a bf16 cache of the sample;
    ``logp``: log attention probabilities from the bf16 keys, one ``[Hq, Tq_i, T_i]`` tensor
    per sequence.
    """

    out: torch.Tensor
    logp: tuple[torch.Tensor, ...]


def make_reference(sample: KVSample, out_ref: torch.Tensor) -> Reference:
    """:class:`Reference` of ``sample`` given the reader's bf16 attention output."""
    logits = attention_logits(sample.query, sample.key, sample.seq_lens, sample.query_lens)
    return Reference(out_ref, tuple(torch.log_softmax(s, dim=-1) for s in logits))


class MetricsAccumulator:
    """Sums the raw quantities of :class:`FormatMetrics` over samples."""

    def __init__(self) -> None:
        self._k = _Sums()
        self._v = _Sums()
        self._out = _Sums()
        self._cos_sum = 0.0
        self._cos_min = 1.0
        self._cos_n = 0
        self._kl_sum = 0.0
        self._kl_max = 0.0
        self._kl_n = 0

    def add(
        self,
        sample: KVSample,
        key_hat: torch.Tensor,
        value_hat: torch.Tensor,
        out: torch.Tensor,
        ref: Reference,
    ) -> None:
        """Add one sample: dequantized ``key_hat [T, H, D]`` / ``value_hat [T, H, Dv]``, the
        attention output ``out [Tq, Hq, Dv]`` and the sample's bf16 :class:`Reference`."""
        self._k.add(sample.key, key_hat)
        self._v.add(sample.value, value_hat)
        self._out.add(ref.out, out)

        o = out.to(torch.float32).flatten(1)
        r = ref.out.to(torch.float32).flatten(1)
        cos = (o * r).sum(1) / (o.norm(dim=1) * r.norm(dim=1)).clamp_min(1e-30)
        cos = cos.clamp(-1.0, 1.0)  # 1.0 exactly for identical vectors up to rounding
        self._cos_sum += float(cos.double().sum())
        self._cos_min = _nanmin(self._cos_min, float(cos.min()))
        self._cos_n += cos.numel()

        logits = attention_logits(sample.query, key_hat, sample.seq_lens, sample.query_lens)
        for logp_ref, s_hat in zip(ref.logp, logits, strict=True):
            logp_hat = torch.log_softmax(s_hat, dim=-1)
            kl = (logp_ref.exp() * (logp_ref - logp_hat)).sum(-1).clamp_min(0.0)  # [Hq, Tq]
            self._kl_sum += float(kl.double().sum())
            self._kl_max = _nanmax(self._kl_max, float(kl.max()))
            self._kl_n += kl.numel()

    def result(self) -> FormatMetrics:
        """The metrics over everything added so far."""
        if self._cos_n == 0:
            raise ValueError("MetricsAccumulator: no sample added")
        return FormatMetrics(
            k_rel_rms=self._k.rel,
            k_max_abs=self._k.max_abs,
            v_rel_rms=self._v.rel,
            v_max_abs=self._v.max_abs,
            out_cos_mean=self._cos_sum / self._cos_n,
            out_cos_min=self._cos_min,
            out_rel_err=self._out.rel,
            kl_mean=self._kl_sum / self._kl_n,
            kl_max=self._kl_max,
        )


def cache_metrics(
    sample: KVSample,
    cache: PagedCache,
    reader: CacheReader,
    ref: Reference,
    into: MetricsAccumulator | None = None,
) -> FormatMetrics:
    """Metrics of one written ``cache`` holding ``sample``'s K/V, read back by ``reader``.

    ``ref`` is the sample's bf16 :class:`Reference` (from the same reader). The reader trusts
    the cache's bytes, scales and scale layouts, so corrupting any of them before this call
    shows up in the metrics. When ``into`` is given the sample is also added to it.
    """
    acc = MetricsAccumulator()
    key_hat, value_hat = reader.read_kv(cache)
    out = reader.attend(cache, sample.query, sample.query_lens)
    for target in (acc, into):
        if target is not None:
            target.add(sample, key_hat, value_hat, out, ref)
    return acc.result()
