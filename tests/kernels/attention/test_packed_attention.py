"""The fused attention over packed caches (vllm.v1.attention.ops.triton_packed_attention), through
its readers ``triton_turboquant_decode_attention`` and ``int4_paged_attention``: attention over
the reference codecs' decoded values up to fp32 summation order (fp32 queries), across the
TurboQuant presets, head sizes 64 / 128, GQA, windows, sinks, soft caps, per-sequence causal
flags, prefix ranges, ALiBi, q/q bias, split-K, empty sequences and block tables whose unread
entries point nowhere; the launches read the caller's pages in place; the kernel's compile
cases build for sm_80 / sm_90 / sm_100. Without a GPU the kernels run under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.kv_quant.int4_per_token_head import (
    int4_per_token_head_read_cache,
    int4_per_token_head_write_cache,
    int4_scale_words,
)
from vllm.kv_quant.turboquant import (
    TQ_PRESETS,
    TurboQuantConfig,
    solve_lloyd_max,
    turboquant_decode_slots,
    turboquant_write_cache,
)
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops import int4_per_token_head as int4_ops
from vllm.v1.attention.ops.int4_per_token_head import int4_paged_attention
from vllm.v1.attention.ops.triton_attention_plan import plan_paged_attention
from vllm.v1.attention.ops.triton_packed_attention import (
    PackedLayout,
    packed_attention_kernel,
    plan_packed_attention,
)
from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="Triton cannot launch kernels here"),
    pytest.mark.usefixtures("single_intra_op_thread"),
    # Stale bytes decode to NaN / Inf in slots no sequence reads; the interpreter warns.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16
NOWHERE = 10**6  # a block-table entry past every cache: reading it would fault


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _table(seq_lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Shuffled pages for each sequence, one spare column and row; entries no key reads are
    :data:`NOWHERE`."""
    cols = max(1, max(-(-n // BLOCK) for n in seq_lens)) + 1
    table = torch.full((len(seq_lens) + 1, cols), NOWHERE, dtype=torch.int32)
    pages = torch.randperm(num_blocks, generator=gen).tolist()
    for b, n in enumerate(seq_lens):
        for c in range(-(-n // BLOCK)):
            table[b, c] = pages.pop()
    return table


def _slots(table: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    return torch.tensor(
        [int(table[b, t // BLOCK]) * BLOCK + t % BLOCK for b, n in enumerate(seq_lens)
         for t in range(n)], dtype=torch.int64,
    )  # fmt: skip


def _attention(q, keys, values, seq_lens, table, scale) -> torch.Tensor:
    """fp32 torch decode attention (one query per sequence) over decoded ``(B, N, Hk, D)``."""
    group = q.shape[1] // keys.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, n in enumerate(seq_lens):
        if n:
            pos = torch.arange(n)
            page = table[b].long()[pos // BLOCK]
            k = keys[page, pos % BLOCK].repeat_interleave(group, 1)
            v = values[page, pos % BLOCK].repeat_interleave(group, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, -1)
            out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("preset", list(TQ_PRESETS))
def test_turboquant_is_attention_over_the_codec_values(preset: str, head_size: int) -> None:
    """Four sequences (two pages and a bit, empty, one exact page, three tokens), GQA 4, stale
    bytes everywhere else; 1 and 3 key splits give the codec + fp32 torch attention."""
    seq_lens = [37, 0, 16, 3]
    gen = torch.Generator().manual_seed(head_size + len(preset))
    cfg = TurboQuantConfig.from_cache_dtype(preset, head_size)
    pi = _hadamard(head_size)
    centroids, midpoints = solve_lloyd_max(head_size, cfg.centroid_bits)
    num_blocks = 8
    cache = torch.randint(0, 256, (num_blocks, BLOCK, 2, cfg.slot_size_aligned), generator=gen,
                          dtype=torch.uint8)  # fmt: skip
    table = _table(seq_lens, num_blocks, gen)
    slots = _slots(table, seq_lens)
    key = torch.randn(len(slots), 2, head_size, generator=gen) * 2
    value = torch.randn(len(slots), 2, head_size, generator=gen)
    turboquant_write_cache(key, value, cache, slots, cfg, pi.T.contiguous(), midpoints)
    query = torch.randn(len(seq_lens), 8, head_size, generator=gen)
    scale = head_size**-0.5
    keys, values = turboquant_decode_slots(cache, cfg, centroids, None if cfg.key_fp8 else pi)
    expected = _attention(query, keys, values, seq_lens, table, scale)
    for splits in (1, 3):
        got = triton_turboquant_decode_attention(
            query.to(DEVICE), cache.to(DEVICE), table.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), pi.to(DEVICE),
            centroids.to(DEVICE), scale, cfg.key_mse_bits, cfg.key_packed_size,
            cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
            norm_correction=cfg.norm_correction, max_num_kv_splits=splits,
        )  # fmt: skip
        torch.testing.assert_close(got.cpu(), expected, atol=2e-6, rtol=1e-5)
        assert torch.equal(got[1].cpu(), torch.zeros(8, head_size))


def _int4_batch(head_size: int, seq_lens: list[int], query_lens: list[int], group: int,
                query_dtype: torch.dtype = torch.float32):  # fmt: skip
    """An INT4 cache (``(B, N, 2, D/2 + 4)`` per side, stale bytes elsewhere) holding the
    sequences, its decoded fp32 pages, the block table and the queries."""
    gen = torch.Generator().manual_seed(head_size + sum(seq_lens))
    num_blocks = 10
    rows = head_size // 2 + 4
    k_cache = torch.full((num_blocks, BLOCK, 2, rows), 0x77, dtype=torch.uint8)
    v_cache = k_cache.clone()
    table = _table(seq_lens, num_blocks, gen)
    slots = _slots(table, seq_lens)
    int4_per_token_head_write_cache(torch.randn(len(slots), 2, head_size, generator=gen) * 2,
                                    k_cache, slots)  # fmt: skip
    int4_per_token_head_write_cache(torch.randn(len(slots), 2, head_size, generator=gen),
                                    v_cache, slots)  # fmt: skip
    decoded = int4_per_token_head_read_cache(k_cache), int4_per_token_head_read_cache(v_cache)
    query = torch.randn(sum(query_lens), 2 * group, head_size, generator=gen).to(query_dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (k_cache, v_cache), decoded, table, query, qsl


INT4_CASES = {
    "window-sinks-softcap": dict(head_size=64, sliding_window=5, logits_soft_cap=4.0,
                                 sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    "split-k-d128": dict(head_size=128, num_splits=3, decode=True),
    "per-seq-causal-prefix-alibi-qq": dict(
        head_size=64, causal=torch.tensor([1, 1, 0], dtype=torch.int32),
        mm_prefix_range=torch.tensor([[[14, 18]], [[0, 0]], [[0, 3]]], dtype=torch.int32),
        alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]), alibi_sqrt=True,
        qq_bias=torch.randn(6, 6, generator=torch.Generator().manual_seed(3))),
}  # fmt: skip


@pytest.mark.parametrize("case", list(INT4_CASES))
def test_int4_is_attention_over_the_codec_values(case: str) -> None:
    """fp32 queries, GQA 2, two prefill chunks around an empty sequence (or three decodes with
    split-K): the fused reader equals this library's paged kernel over the codec's
    decoded (rotated-back) fp32 pages with the same options."""
    options = dict(INT4_CASES[case])
    head_size = options.pop("head_size")
    decode = options.pop("decode", False)
    seq_lens, query_lens = ([40, 9, 23], [1, 1, 1]) if decode else ([21, 0, 30], [6, 0, 3])
    (k_cache, v_cache), (keys, values), table, query, qsl = _int4_batch(
        head_size, seq_lens, query_lens, group=2
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    common = dict(block_table=table.to(DEVICE), seq_lens=lens.to(DEVICE),
                  query_start_loc=qsl.to(DEVICE), max_query_len=max(query_lens),
                  max_seq_len=max(seq_lens))  # fmt: skip
    options = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    out = torch.full(query.shape, float("nan"), device=DEVICE)
    int4_paged_attention(
        out, query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
        int4_scale_words(k_cache.to(DEVICE), head_size),
        int4_scale_words(v_cache.to(DEVICE), head_size), softmax_scale=0.3, **common, **options,
    )  # fmt: skip
    expected = torch.full(query.shape, float("nan"), device=DEVICE)
    ones = torch.ones(1, device=DEVICE)
    table_ok = table.clamp(max=keys.shape[0] - 1)  # the reference reads whole tiles' entries
    plan_paged_attention(
        expected, query.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), table_ok.to(DEVICE),
        lens.to(DEVICE), qsl.to(DEVICE), "float32", ones, ones, 0.3, max(query_lens),
        max(seq_lens), **options,
    )()  # fmt: skip
    torch.testing.assert_close(out.cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)


def test_int4_fp16_queries_round_once_per_step() -> None:
    """fp16 queries: the rotated query, the probabilities and the rotated output are rounded
    to fp16 (upstream's steps); the integer codes and the scales are exact."""
    seq_lens, query_lens = [33, 12], [5, 1]
    (k_cache, v_cache), (keys, values), table, query, qsl = _int4_batch(
        64, seq_lens, query_lens, group=4, query_dtype=torch.float16
    )
    out = torch.empty(query.shape, dtype=torch.float16, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    int4_paged_attention(
        out, query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
        int4_scale_words(k_cache.to(DEVICE), 64), int4_scale_words(v_cache.to(DEVICE), 64),
        block_table=table.to(DEVICE), seq_lens=lens.to(DEVICE), query_start_loc=qsl.to(DEVICE),
        softmax_scale=0.125, max_query_len=5, max_seq_len=33,
    )  # fmt: skip
    expected = torch.empty(query.shape, device=DEVICE)
    ones = torch.ones(1, device=DEVICE)
    plan_paged_attention(
        expected, query.float().to(DEVICE), keys.to(DEVICE), values.to(DEVICE),
        table.clamp(max=keys.shape[0] - 1).to(DEVICE), lens.to(DEVICE), qsl.to(DEVICE),
        "float32", ones, ones, 0.125, 5, 33,
    )()  # fmt: skip
    torch.testing.assert_close(out.float().cpu(), expected.cpu(), atol=5e-3, rtol=5e-3)


def test_launches_read_the_pages_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """One kernel launch per call (the fused one, no split), its page arguments the caller's
    cache tensors: no decoded copy of the pages exists."""
    launched: list[tuple] = []

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(args)
                packed_attention_kernel[grid](*args, **kwargs)

            return run

    from vllm.v1.attention.ops import triton_attention_plan as plan_module

    real_call = plan_module.PagedAttentionLaunch.__call__

    def call(self) -> None:
        assert self.kernel is packed_attention_kernel and not self.is_3d
        self.kernel = Spy()
        real_call(self)

    monkeypatch.setattr(plan_module.PagedAttentionLaunch, "__call__", call)
    (k_cache, v_cache), _, table, query, qsl = _int4_batch(64, [20], [1], group=1)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    int4_ops.int4_paged_attention(
        torch.empty(query.shape, device=DEVICE), query.to(DEVICE), k_cache, v_cache,
        int4_scale_words(k_cache, 64), int4_scale_words(v_cache, 64),
        block_table=table.to(DEVICE), seq_lens=torch.tensor([20], device=DEVICE),
        query_start_loc=qsl.to(DEVICE), softmax_scale=0.1, max_query_len=1, max_seq_len=20,
    )  # fmt: skip
    assert len(launched) == 1
    pointers = {a.data_ptr() for a in launched[0] if isinstance(a, torch.Tensor)}
    assert {k_cache.data_ptr(), v_cache.data_ptr(), k_cache.data_ptr() + 32} <= pointers


def test_compile_cases_build_for_every_target() -> None:
    """The fused kernel's own cases (INT4 fp16 / fp32 with every mask option, TurboQuant
    3-bit) compile for sm_80, sm_90 and sm_100 through the library's tool, in a process
    without TRITON_INTERPRET."""
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run(
        [sys.executable, str(root / "tools" / "compile_triton_kernels.py"), "--only",
         "triton_packed_attention", "--arch", "80,90,100", "--jobs", "2"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if "triton_packed_attention" in line]
    assert len(rows) == 9 and all(" ok " in row for row in rows), run.stdout


def test_turboquant_plan_needs_an_fp32_query() -> None:
    """The TurboQuant tiles are fp32: a half-precision query (the reader rotates / widens it
    first) is refused before any launch."""
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", 64)
    cache = torch.zeros(1, BLOCK, 1, cfg.slot_size_aligned, dtype=torch.uint8)
    q = torch.zeros(1, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="query: expected float32 for packed-slot pages"):
        plan_packed_attention(
            torch.zeros(1, 1, 64), q, cache, cache, None, None, None,
            PackedLayout.turboquant(cfg), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), torch.tensor([0, 1]), 0.1, 1, 1,
        )  # fmt: skip
