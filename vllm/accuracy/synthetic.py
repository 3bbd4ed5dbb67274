"""Seeded, LLM-like synthetic keys, values and queries.

Real decoder K/V are far from i.i.d. Gaussian, and what breaks low-precision caches is their
structure, so the generator reproduces the three features that matter:

1. **Channel spread.** Every (head, channel) has its own standard deviation, log-normal:
   ``sigma = exp(N(0, 0.5^2))`` for K, ``exp(N(0, 0.3^2))`` for V.
2. **Outlier channels in K.** ``K_OUTLIER_CHANNELS`` channels per head carry a large constant
   offset (``±U(5, 10)``, sign random, the same for every token) and 2x the spread, as the
   low-frequency RoPE channels of Llama-style models do. V gets ``V_OUTLIER_CHANNELS`` channels
   per head with 5x the spread and no offset.
3. **A few large tokens.** The first token of each sequence (the attention sink) and
   ``LARGE_TOKEN_FRACTION`` of the others have their whole K and V vectors multiplied by
   ``U(2, 4)`` ("massive activations").

Queries are ``0.3 * sign(K offset)`` on K's outlier channels (so queries lean towards the large
tokens, as real queries lean towards sinks) plus Gaussian noise with its own log-normal channel
spread (``0.8 * exp(N(0, 0.3^2))``). With the defaults (seed 0), attention is peaked but not
one-hot: the mean largest probability of a row is about 0.4 and its entropy about 3 nats over
128-384 keys; K's amax is about 110 and V's about 50, far from 448, so that a scale used
upside down (``1/scale``) is visible.

Everything is drawn from one ``torch.Generator`` on the CPU seeded with ``seed`` (so a seed
gives the same data on every device), then cast: K and V to bf16 (the reference cache
contents), queries kept in fp32.
"""

from __future__ import annotations

import torch

from vllm.accuracy.samples import KVSample

K_OUTLIER_CHANNELS = 4
"""K channels per head with a large constant offset."""

V_OUTLIER_CHANNELS = 2
"""V channels per head with a 5x spread."""

LARGE_TOKEN_FRACTION = 0.01
"""Fraction of non-first tokens scaled up 5-10x (the first token of a sequence always is)."""

DEFAULT_SEQ_LENS: tuple[int, ...] = (384, 128)
DEFAULT_QUERIES_PER_SEQ = 16


def _lognormal(gen: torch.Generator, shape: tuple[int, ...], sigma: float) -> torch.Tensor:
    return torch.exp(torch.randn(shape, generator=gen) * sigma)


def _pick_channels(gen: torch.Generator, num_heads: int, head_size: int, k: int) -> torch.Tensor:
    """Bool mask ``[H, D]`` with ``k`` random channels per head set."""
    order = torch.rand(num_heads, head_size, generator=gen).argsort(dim=1)
    mask = torch.zeros(num_heads, head_size, dtype=torch.bool)
    mask.scatter_(1, order[:, :k], True)
    return mask


def synthetic_sample(
    seed: int = 0,
    num_kv_heads: int = 8,
    head_size: int = 128,
    seq_lens: tuple[int, ...] = DEFAULT_SEQ_LENS,
    queries_per_seq: int = DEFAULT_QUERIES_PER_SEQ,
    queries_per_kv_head: int = 4,
    device: torch.device | str = "cpu",
) -> KVSample:
    """An LLM-like :class:`KVSample` (see the module docstring), deterministic in ``seed``.

    Shapes: key and value ``[sum(seq_lens), num_kv_heads, head_size]`` (bf16), query
    ``[queries_per_seq * len(seq_lens), num_kv_heads * queries_per_kv_head, head_size]``
    (fp32).
    """
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(seq_lens)
    h, d = num_kv_heads, head_size

    k_sigma = _lognormal(gen, (h, d), 0.5)
    k_outlier = _pick_channels(gen, h, d, min(K_OUTLIER_CHANNELS, d))
    k_sign = torch.where(torch.rand(h, d, generator=gen) < 0.5, -1.0, 1.0)
    k_offset = k_sign * (5.0 + 5.0 * torch.rand(h, d, generator=gen))
    k_mean = torch.where(k_outlier, k_offset, torch.zeros(h, d))
    k_sigma = torch.where(k_outlier, 2.0 * k_sigma, k_sigma)
    key = k_mean + k_sigma * torch.randn(num_tokens, h, d, generator=gen)

    v_sigma = _lognormal(gen, (h, d), 0.3)
    v_outlier = _pick_channels(gen, h, d, min(V_OUTLIER_CHANNELS, d))
    v_sigma = torch.where(v_outlier, 5.0 * v_sigma, v_sigma)
    value = v_sigma * torch.randn(num_tokens, h, d, generator=gen)

    large = torch.rand(num_tokens, generator=gen) < LARGE_TOKEN_FRACTION
    starts = torch.tensor([0, *seq_lens[:-1]]).cumsum(0)
    large[starts] = True
    factor = torch.where(large, 2.0 + 2.0 * torch.rand(num_tokens, generator=gen), 1.0)
    key = key * factor[:, None, None]
    value = value * factor[:, None, None]

    hq = h * queries_per_kv_head
    q_sigma = _lognormal(gen, (hq, d), 0.3)
    q_bias = 0.3 * torch.where(k_outlier, k_sign, torch.zeros(h, d))  # drawn to the offsets
    q_bias = q_bias.repeat_interleave(queries_per_kv_head, dim=0)
    noise = torch.randn(queries_per_seq * len(seq_lens), hq, d, generator=gen)
    query = q_bias + 0.8 * q_sigma * noise

    return KVSample(
        name="synthetic",
        query=query.to(device),
        key=key.to(torch.bfloat16).to(device),
        value=value.to(torch.bfloat16).to(device),
        seq_lens=tuple(seq_lens),
        query_lens=(queries_per_seq,) * len(seq_lens),
    )
