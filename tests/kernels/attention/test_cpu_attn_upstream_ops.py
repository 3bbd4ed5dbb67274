"""Upstream's CPU attention ops (``vllm._custom_ops.cpu_attn_*``) on this library's kernels:
the kernel features they brought (ALiBi, per-sequence causality, no key split, HND heads
spaced apart), their checks, and the platform pieces around them. Upstream's own test file
(tests/kernels/attention/test_cpu_attn.py) runs through tools/run_upstream_tests.py."""

from __future__ import annotations

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.platforms import CpuArchEnum, current_platform
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import _cpu_architecture
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm.v1.attention.selector import AttentionSelectorConfig

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="CPU ops")

HEADS, KV_HEADS, D, BLOCK = 4, 2, 64, 16


def reference(q, k, v, q_lens, kv_lens, scale, *, causal, window=None, slopes=None):
    """Attention of each sequence's queries (its last tokens) over its keys, in fp32."""
    out, start = [], 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        qi = q[start : start + ql].float() * scale
        ki = k[i, :kl].float().repeat_interleave(HEADS // KV_HEADS, dim=1)
        vi = v[i, :kl].float().repeat_interleave(HEADS // KV_HEADS, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, ki)
        qpos = torch.arange(kl - ql, kl)[:, None]
        kpos = torch.arange(kl)[None, :]
        if slopes is not None:
            s = s + slopes[:, None, None] * (kpos - qpos)
        seen = torch.ones(ql, kl, dtype=torch.bool)
        causal_i = causal[i] if isinstance(causal, list) else causal
        if causal_i:
            seen &= kpos <= qpos
        if window is not None:
            seen &= kpos > qpos - window
            if not causal_i:
                seen &= kpos < qpos + window
        s = s.masked_fill(~seen, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vi).to(q.dtype))
        start += ql
    return torch.cat(out)


def packed_cache(num_blocks: int, dtype=torch.float32):
    """Upstream's CPU cache: [B, H, 2N, D] split into K and V halves of each head."""
    packed = torch.zeros(num_blocks, KV_HEADS, 2 * BLOCK, D, dtype=dtype)
    return packed, *packed.chunk(2, dim=2)


def run_ops(q_lens, kv_lens, *, causal=True, dynamic=None, window=-1, slopes=None, split=True):
    torch.manual_seed(0)
    seqs = len(q_lens)
    pages = [(n + BLOCK - 1) // BLOCK for n in kv_lens]
    num_blocks = sum(pages)
    k = torch.randn(seqs, max(kv_lens), KV_HEADS, D)
    v = torch.randn(seqs, max(kv_lens), KV_HEADS, D)
    q = torch.randn(sum(q_lens), HEADS, D)
    _, key_cache, value_cache = packed_cache(num_blocks)
    order = torch.randperm(num_blocks).to(torch.int32)
    table = torch.zeros(seqs, max(pages), dtype=torch.int32)
    first = 0
    for i, (n, p) in enumerate(zip(kv_lens, pages, strict=True)):
        table[i, :p] = order[first : first + p]
        first += p
        slots = table[i].long()[torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
        ops.cpu_attn_reshape_and_cache(k[i, :n], v[i, :n], key_cache, value_cache, slots, "vec")
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    flags = None if dynamic is None else torch.tensor(dynamic, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        seqs, HEADS, KV_HEADS, D, lens, q.dtype, starts, causal, window, "vec", split, flags
    )
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        q,
        key_cache,
        value_cache,
        out,
        starts,
        lens,
        D**-0.5,
        causal,
        slopes,
        window,
        table,
        0.0,
        meta,
        None,
        flags,
    )
    expected = reference(
        q, k, v, q_lens, kv_lens, D**-0.5,
        causal=causal if dynamic is None else [bool(f) for f in dynamic],
        window=None if window == -1 else window,
        slopes=slopes,
    )  # fmt: skip
    return out, expected


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [-1, 24])
def test_alibi_matches_the_reference(causal: bool, window: int) -> None:
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    out, expected = run_ops([1, 7, 40], [33, 40, 40], causal=causal, window=window, slopes=slopes)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_dynamic_causal_is_per_sequence() -> None:
    out, expected = run_ops([5, 9, 3], [20, 9, 50], causal=False, dynamic=[1, 0, 1], window=12)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [True, False])
def test_long_decode_with_and_without_key_split(split: bool) -> None:
    out, expected = run_ops([1, 1], [2000, 1500], split=split)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_spaced_heads_hold_the_same_bytes_as_a_dense_cache() -> None:
    """The writer puts each head's rows where a dense HND cache has them, only spaced."""
    torch.manual_seed(1)
    key = torch.randn(40, KV_HEADS, D, dtype=torch.bfloat16)
    slots = torch.randperm(4 * BLOCK)[:40]
    _, key_cache, value_cache = packed_cache(4, torch.bfloat16)
    ops.cpu_attn_reshape_and_cache(key, -key, key_cache, value_cache, slots, "vec16")
    dense_k = torch.zeros(4, KV_HEADS, BLOCK, D, dtype=torch.bfloat16)
    dense_v = torch.zeros_like(dense_k)
    ops.cpu_attn_reshape_and_cache(key, -key, dense_k, dense_v, slots, "vec16")
    assert torch.equal(key_cache, dense_k) and torch.equal(value_cache, dense_v)
    assert torch.equal(dense_k.transpose(1, 2).reshape(-1, KV_HEADS, D)[slots], key)


def test_fp8_cache_bytes_round_to_nearest_even() -> None:
    values = torch.tensor([1 + 2**-4, 1 + 3 * 2**-4, 2**-10, 0.75 * 2**-9, -448.0, 0.0])
    key = values.repeat(D // len(values) + 1)[:D].reshape(1, 1, D).expand(1, KV_HEADS, D)
    key_cache = torch.empty(1, KV_HEADS, BLOCK, D, dtype=torch.uint8)
    value_cache = torch.empty_like(key_cache)
    ops.cpu_attn_reshape_and_cache(
        key.contiguous(), key.contiguous(), key_cache, value_cache, torch.tensor([3]), "vec",
        kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    expected = key[0, 0].to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(key_cache[0, 1, 3], expected)
    assert torch.equal(value_cache[0, 0, 3], expected)


def test_a_cache_whose_k_and_v_overlap_is_refused_before_writing() -> None:
    packed = torch.zeros(2, KV_HEADS, 2 * BLOCK, D)
    key_cache = packed[:, :, :BLOCK]
    value_cache = packed[:, :, BLOCK // 2 : BLOCK // 2 + BLOCK]  # half over K's rows
    key = torch.ones(1, KV_HEADS, D)
    with pytest.raises(RuntimeError, match="value_cache: expected a different tensor"):
        ops.cpu_attn_reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([0]), "vec")
    assert not packed.any()


def test_nvfp4_pages_must_stay_dense() -> None:
    packed = torch.zeros(2, KV_HEADS, 2 * BLOCK, D // 2 + D // 16, dtype=torch.uint8)
    key_cache, value_cache = packed.chunk(2, dim=2)
    key = torch.ones(1, KV_HEADS, D)
    with pytest.raises(RuntimeError, match="key_cache: expected each page's region dense"):
        ops.cpu_attn_reshape_and_cache(
            key, key, key_cache, value_cache, torch.tensor([0]), "vec", kv_cache_dtype="nvfp4"
        )


def metadata(**overrides):
    args = dict(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
        seq_lens=torch.tensor([4], dtype=torch.int32), dtype=torch.float32,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), causal=True,
        sliding_window_size=-1, isa="vec", enable_kv_split=True,
    )  # fmt: skip
    return ops.cpu_attn_get_scheduler_metadata(**{**args, **overrides})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(isa="avx9"), "isa: expected one of amx, amx_fp8, vec"),
        (dict(num_kv_heads=3), "num_kv_heads: expected a divisor of num_heads=4, got 3"),
        (dict(sliding_window_size=-5), "sliding_window_size: expected a window in tokens"),
        (dict(seq_lens=torch.tensor([4, 4])), r"seq_lens: expected shape \(1,\)"),
        (dict(dynamic_causal=torch.tensor([0.5])), "dynamic_causal: expected an integer tensor"),
    ],
)
def test_scheduler_metadata_checks(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        metadata(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_heads=8, num_kv_heads=4), "expected metadata made for num_heads=4, got"),
        (dict(causal=False), "expected metadata made for causal=1, got causal=0"),
        (dict(sliding_window_size=32), "expected metadata made for sliding_window=-1, got"),
    ],
)
def test_attention_refuses_metadata_of_another_geometry(overrides: dict, message: str) -> None:
    _, key_cache, value_cache = packed_cache(1)
    query = torch.zeros(1, HEADS, D)
    out = torch.full_like(query, 7.0)
    with pytest.raises(ValueError, match=f"scheduler_metadata: {message}"):
        ops.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, out, torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32), 1.0, True, None, -1,
            torch.zeros(1, 1, dtype=torch.int32), 0.0, metadata(**overrides), None,
        )  # fmt: skip
    assert (out == 7.0).all()


@pytest.mark.parametrize(
    ("machine", "arch"),
    [
        ("x86_64", CpuArchEnum.X86),
        ("AMD64", CpuArchEnum.X86),
        ("aarch64", CpuArchEnum.ARM),
        ("ppc64le", CpuArchEnum.POWERPC),
        ("s390x", CpuArchEnum.S390X),
        ("riscv64", CpuArchEnum.RISCV),
        ("mips", CpuArchEnum.OTHER),
        ("", CpuArchEnum.UNKNOWN),
    ],
)
def test_cpu_architecture_of_machine_names(machine: str, arch: CpuArchEnum) -> None:
    assert _cpu_architecture(machine) is arch


def test_isa_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(CpuPlatform, "get_cpu_architecture", classmethod(lambda c: CpuArchEnum.X86))
    assert _get_attn_isa(torch.bfloat16, 128) == "vec"
    assert _get_attn_isa(torch.bfloat16, 16) == "vec16"
    assert _get_attn_isa(torch.float32, 128, head_size=80) == "vec16"
    assert _get_attn_isa(torch.float32, 128, head_size=80, kv_cache_dtype="fp8") == "vec16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert _get_attn_isa(torch.bfloat16, 128) == "amx"
    assert _get_attn_isa(torch.float16, 128) == "vec"


def select(kv_cache_dtype: str, use_mla: bool = False) -> str:
    config = AttentionSelectorConfig(
        head_size=576 if use_mla else 64, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
        block_size=128, use_mla=use_mla,
    )  # fmt: skip
    return CpuPlatform.get_attn_backend_cls(None, config)


def test_cpu_platform_selects_cpu_attn_for_every_format_its_kernels_read() -> None:
    kernels = ("auto", "bfloat16", "fp8", "fp8_e5m2", "nvfp4", "int8_per_token_head")
    for dtype in (*kernels, "int4_per_token_head"):
        assert select(dtype).endswith("cpu_attn.CPUAttentionBackend")
    # Packed K+V slots: CPU_ATTN reads them too (packed_paged_attention).
    for dtype in ("turboquant_k8v4", "turboquant_3bit_nc", "ultraquant_4bit", "octave_k3v3"):
        assert select(dtype).endswith("cpu_attn.CPUAttentionBackend")
    with pytest.raises(ValueError, match="nvfp4_ds_mla"):
        select("nvfp4_ds_mla")
    assert "MLA" in select("auto", use_mla=True)
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of auto, bfloat16"):
        select("fp8", use_mla=True)


def fake_zentorch_sdpa(q, k, v, out, *, scale, is_causal, alibi_slopes, left_window_size,
                       right_window_size):  # fmt: skip
    """zentorch's op contract on [B, H, S, D] operands, in torch (the package is not here)."""
    assert left_window_size == right_window_size
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float().repeat_interleave(group, 1)) * scale
    pos = torch.arange(q.shape[2])
    dist = pos[None, :] - pos[:, None]  # key - query
    if alibi_slopes is not None:
        s = s + alibi_slopes.float()[None, :, None, None] * dist
    seen = torch.ones_like(dist, dtype=torch.bool)
    if is_causal:
        seen &= dist <= 0
    if left_window_size >= 0:
        seen &= dist.abs() <= left_window_size
    p = s.masked_fill(~seen, float("-inf")).softmax(-1)
    out.copy_(torch.einsum("bhqk,bhkd->bhqd", p, v.float().repeat_interleave(group, 1)))


@pytest.mark.parametrize("lengths", [[6, 6, 6], [3, 9, 1]])
@pytest.mark.parametrize("window", [-1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zentorch_sdpa_attn_feeds_the_op_each_sequence(
    monkeypatch: pytest.MonkeyPatch, lengths: list[int], window: int, dtype: torch.dtype
) -> None:
    from types import SimpleNamespace

    from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends import zentorch_sdpa

    monkeypatch.setattr(type(current_platform), "is_zen_cpu", classmethod(lambda c: True))
    monkeypatch.setattr(
        torch.ops, "zentorch", SimpleNamespace(zentorch_sdpa_attn=fake_zentorch_sdpa),
        raising=False,
    )  # fmt: skip
    assert has_zentorch_op(["zentorch_sdpa_attn"]) and not has_zentorch_op(["other"])
    assert not zentorch_sdpa.should_use_zentorch_sdpa(AttentionType.DECODER, torch.float32)
    torch.manual_seed(2)
    tokens = sum(lengths)
    q = torch.randn(tokens, HEADS, D, dtype=dtype)
    k = torch.randn(tokens, KV_HEADS, D, dtype=dtype)
    v = torch.randn(tokens, KV_HEADS, D, dtype=dtype)
    slopes = torch.tensor([0.3, 0.2, 0.1, 0.05])
    starts = torch.tensor([0, *lengths]).cumsum(0)
    meta = SimpleNamespace(query_start_loc=starts, causal=False)
    out = torch.empty_like(q)
    zentorch_sdpa.zentorch_sdpa_attn(q, k, v, out, meta, D**-0.5, window, slopes)
    for i, n in enumerate(lengths):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected = reference(
            q[rows], k[None, rows], v[None, rows], [n], [n], D**-0.5, causal=False,
            window=None if window == -1 else window, slopes=slopes,
        )  # fmt: skip
        torch.testing.assert_close(out[rows], expected, atol=2e-2, rtol=2e-2)


def test_has_zentorch_op_needs_a_name() -> None:
    from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op

    with pytest.raises(ValueError, match=r"op_names: expected at least one op name, got \[\]"):
        has_zentorch_op([])
    assert not has_zentorch_op(["zentorch_sdpa_attn"]) or current_platform.is_zen_cpu()


def test_spaced_heads_whose_pages_overlap_are_refused() -> None:
    packed = torch.zeros(4, KV_HEADS, 2 * BLOCK, D)
    key_cache = packed[:, :, :BLOCK].as_strided(
        (4, KV_HEADS, BLOCK, D), (BLOCK * D, 2 * BLOCK * D, D, 1)
    )  # pages one head region apart: page b's second head is page b + 2's first
    value_cache = packed[:, :, BLOCK:]
    key = torch.ones(1, KV_HEADS, D)
    message = r"key_cache: expected a page stride of at least \(H-1\)\*head_stride \+ N\*D' = 3072"
    with pytest.raises(RuntimeError, match=message):
        ops.cpu_attn_reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([0]), "vec")


def test_platform_kinds() -> None:
    from vllm.platforms.cuda import CudaPlatform

    assert CpuPlatform.is_cpu() and not CpuPlatform.is_cuda_alike() and not CpuPlatform.is_xpu()
    assert CudaPlatform.is_cuda_alike() and not CudaPlatform.is_rocm()
