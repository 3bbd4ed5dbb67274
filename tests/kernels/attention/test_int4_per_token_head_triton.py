"""The ``int4_per_token_head`` Triton path (vllm.v1.attention.ops.int4_per_token_head): the writer
byte for byte against the reference codec (vllm.kv_quant.int4_per_token_head) in upstream's
inline page layout, and the reader against attention over the codec's decoded values. Without a
GPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant.int4_per_token_head import dequantize_int4_rows, quantize_int4_rows
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops.int4_per_token_head import (
    reshape_and_cache_int4,
    triton_compile_cases,
    unified_attention_int4,
)
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
    triton_reshape_and_cache_flash_per_token_head_quant,
)
from vllm.v1.attention.ops.triton_unified_attention import unified_attention
from vllm.v1.kv_cache_interface import KVQuantMode

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton cannot launch kernels here")


def _inline_cache(num_blocks: int, block_size: int, heads: int, d: int):
    """Upstream's page (B, H, N, 2 * (D/2 + 4)) and its K / V sides and scale views."""
    row = d // 2 + 4
    kv = torch.full((num_blocks, heads, block_size, 2 * row), 0xAA, dtype=torch.uint8)
    k_side, v_side = kv.transpose(1, 2).split(row, dim=-1)
    words = kv.view(torch.float32)  # rows are multiples of 4 bytes
    k_scale = words[..., (row - 4) // 4].transpose(1, 2)
    v_scale = words[..., (2 * row - 4) // 4].transpose(1, 2)
    return kv, k_side, v_side, k_scale, v_scale


@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_writer_matches_codec_bytes(head_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_size)
    tokens, heads = 6, 2
    key = (torch.randn(tokens, heads, head_size, generator=gen) * 3).to(dtype)
    value = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    key[1, 0] = 0  # scale floor
    value[2, 1, 3] = 1e4  # a spike; the rotation spreads it (finite in fp16)
    kv, k_side, v_side, k_scale, v_scale = _inline_cache(3, 4, heads, head_size)
    untouched = kv.clone()
    slots = torch.tensor([5, -1, 0, 11, 7])  # one padding token after the mapped ones
    reshape_and_cache_int4(key, value, k_side, v_side, slots, k_scale_cache=k_scale,
                           v_scale_cache=v_scale)  # fmt: skip
    half = head_size // 2
    for x, side, scale in ((key, k_side, k_scale), (value, v_side, v_scale)):
        packed, word = quantize_int4_rows(x)
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            assert torch.equal(side[s // 4, s % 4, :, :half], packed[i])
            assert torch.equal(scale[s // 4, s % 4].view(torch.int32), word[i].view(torch.int32))
    written = torch.zeros(3, 4, dtype=torch.bool)
    for s in (5, 0, 11, 7):
        written[s // 4, s % 4] = True
    assert torch.equal(kv.transpose(1, 2)[~written], untouched.transpose(1, 2)[~written])


def test_upstream_dispatch_writes_int4() -> None:
    key = torch.randn(3, 1, 64, dtype=torch.bfloat16)
    k_cache = torch.zeros(2, 4, 1, 32, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    k_sc, v_sc = torch.ones(2, 4, 1), torch.ones(2, 4, 1)
    slots = torch.tensor([0, 5, 2])
    triton_reshape_and_cache_flash_per_token_head_quant(
        key, key, k_cache, v_cache, k_sc, v_sc, slots,
        kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD,
    )  # fmt: skip
    packed, word = quantize_int4_rows(key)
    assert torch.equal(k_cache[1, 1], packed[1]) and torch.equal(v_cache[0, 2], packed[2])
    assert torch.equal(k_sc[0, 0].view(torch.int32), word[0].view(torch.int32))


def test_writer_errors_write_nothing() -> None:
    key = torch.randn(2, 1, 64)
    _, k_side, v_side, k_scale, v_scale = _inline_cache(1, 4, 1, 64)
    before = k_side.clone()
    bad = {
        "slot_mapping: expected slots < 4": dict(slot_mapping=torch.tensor([0, 4])),
        "key: expected a float32": dict(key=key.to(torch.int32)),
        "key_cache: expected a uint8": dict(key_cache=k_side[..., :16]),
        "k_scale_cache: expected a float32": dict(k_scale_cache=k_scale.double()),
    }
    for message, change in bad.items():
        args = dict(key=key, value=key, key_cache=k_side, value_cache=v_side,
                    slot_mapping=torch.tensor([0, 1]), k_scale_cache=k_scale,
                    v_scale_cache=v_scale) | change  # fmt: skip
        with pytest.raises(ValueError, match=message):
            reshape_and_cache_int4(**args)  # type: ignore[arg-type]
    assert torch.equal(k_side, before)


def _attention_case(head_size: int, window: int, softcap: float, sinks: bool):
    torch.manual_seed(head_size + window)
    num_blocks, block_size, hq, hkv = 6, 16, 4, 2
    query_lens, kv_lens = [1, 5], [20, 37]
    q = torch.randn(sum(query_lens), hq, head_size, dtype=torch.bfloat16)
    kv, k_side, v_side, k_scale, v_scale = _inline_cache(num_blocks, block_size, hkv, head_size)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    for seq, n in enumerate(kv_lens):
        slots = torch.tensor([int(table[seq, t // block_size]) * block_size + t % block_size
                              for t in range(n)])  # fmt: skip
        x = torch.randn(n, hkv, head_size, dtype=torch.bfloat16)
        reshape_and_cache_int4(x, torch.randn_like(x), k_side, v_side, slots,
                               k_scale_cache=k_scale, v_scale_cache=v_scale)  # fmt: skip
    args = dict(
        cu_seqlens_q=torch.tensor([0, 1, 6], dtype=torch.int32), max_seqlen_q=5,
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32), max_seqlen_k=37,
        softmax_scale=head_size**-0.5, window_size=(window - 1, 0) if window else (-1, -1),
        block_table=table, softcap=softcap,
        sinks=torch.randn(hq) if sinks else None,
    )  # fmt: skip
    return q, (k_side, v_side, k_scale, v_scale), args


@pytest.mark.parametrize(
    ("head_size", "window", "softcap", "sinks"),
    [(64, 0, 0.0, False), (96, 8, 0.0, True), (128, 0, 20.0, False)],
)
def test_reader_is_attention_over_decoded_values(
    head_size: int, window: int, softcap: float, sinks: bool
) -> None:
    q, (k_side, v_side, k_scale, v_scale), args = _attention_case(head_size, window, softcap,
                                                                   sinks)  # fmt: skip
    out = torch.empty_like(q)
    unified_attention_int4(q, k_side, v_side, out, **args, alibi_slopes=None,
                           use_alibi_sqrt=False, qq_bias=None, output_scale=None,
                           mm_prefix_range=None, k_scale_cache=k_scale,
                           v_scale_cache=v_scale)  # fmt: skip
    # Reference: the codec's decoded (original-domain) values, attention in fp32 torch.
    half = head_size // 2
    keys = dequantize_int4_rows(k_side[..., :half].contiguous(), k_scale.contiguous())
    vals = dequantize_int4_rows(v_side[..., :half].contiguous(), v_scale.contiguous())
    cu, lens, table = args["cu_seqlens_q"], args["seqused_k"], args["block_table"]
    ref = torch.empty(out.shape)
    for seq in range(2):
        n, start, stop = int(lens[seq]), int(cu[seq]), int(cu[seq + 1])
        pos = torch.arange(n)
        kk = keys[table[seq].long()[pos // 16], pos % 16].repeat_interleave(2, dim=1)
        vv = vals[table[seq].long()[pos // 16], pos % 16].repeat_interleave(2, dim=1)
        qq = q[start:stop].float()
        s = torch.einsum("thd,nhd->htn", qq, kk) * args["softmax_scale"]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = n - (stop - start) + torch.arange(stop - start)
        mask = pos[None, :] <= qpos[:, None]
        if window:
            mask &= pos[None, :] > qpos[:, None] - window
        s = s.masked_fill(~mask, float("-inf"))
        if sinks:
            sink = args["sinks"][:, None, None].expand(-1, stop - start, 1)
            p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :n]
        else:
            p = torch.softmax(s, -1)
        ref[start:stop] = torch.einsum("htn,nhd->thd", p, vv)
    # q is rotated and rounded to bf16 first (upstream's step), and the output is bf16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)


def test_upstream_unified_attention_dispatches_int4() -> None:
    q, (k_side, v_side, k_scale, v_scale), args = _attention_case(64, 0, 0.0, False)
    direct, routed = torch.empty_like(q), torch.empty_like(q)
    unified_attention_int4(q, k_side, v_side, direct, **args, alibi_slopes=None,
                           use_alibi_sqrt=False, qq_bias=None, output_scale=None,
                           mm_prefix_range=None, k_scale_cache=k_scale,
                           v_scale_cache=v_scale)  # fmt: skip
    sinks = args.pop("sinks")
    unified_attention(q=q, k=k_side[..., :32], v=v_side[..., :32], out=routed, causal=True,
                      q_descale=None, k_descale=None, v_descale=None, sinks=sinks,
                      kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD, k_scale_cache=k_scale,
                      v_scale_cache=v_scale, **args)  # fmt: skip
    assert torch.equal(direct, routed)


def test_reader_refuses_output_scale() -> None:
    q, (k_side, v_side, k_scale, v_scale), args = _attention_case(64, 0, 0.0, False)
    with pytest.raises(ValueError, match="output_scale: expected None"):
        unified_attention_int4(q, k_side, v_side, torch.empty_like(q), **args,
                               alibi_slopes=None, use_alibi_sqrt=False, qq_bias=None,
                               output_scale=torch.ones(1), mm_prefix_range=None,
                               k_scale_cache=k_scale, v_scale_cache=v_scale)  # fmt: skip


def test_compile_cases_name_the_kernels() -> None:
    names = [c.name for c in triton_compile_cases()]
    assert names == ["store/d128", "store/d96", "decode/d128"]


def test_reference_backend_reads_int4_pages() -> None:
    """REFERENCE over an engine-allocated INT4 cache (72-byte rows per token and head at D=64)
    gives attention over the codec's decoded values, as the Triton reader does."""
    from vllm.kv_quant.int4_per_token_head import (
        int4_per_token_head_read_cache,
        int4_per_token_head_write_cache,
    )
    from vllm.v1.attention.backends import (
        AttentionLayerScales,
        ReferenceAttentionBackend,
        ReferenceAttentionImpl,
        ReferenceAttentionMetadata,
        split_kv_cache,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.worker.gpu.attn_utils import init_layer_kv_caches

    spec = FullAttentionSpec(block_size=8, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)  # fmt: skip
    assert spec.page_size_bytes == 8 * 2 * 2 * (32 + 4)
    config = KVCacheConfig(
        num_blocks=12,
        kv_cache_tensors=[KVCacheTensor(size=12 * spec.page_size_bytes, shared_by=["l"])],
        kv_cache_groups=[KVCacheGroupSpec(["l"], spec)],
    )
    cache = init_layer_kv_caches(config, [ReferenceAttentionBackend], "cpu",
                                 model_dtype=torch.float32,
                                 cache_dtype="int4_per_token_head")["l"]  # fmt: skip
    key_cache, value_cache = split_kv_cache(cache)
    g = torch.Generator().manual_seed(1)
    seq_lens, query_lens = [31, 20], [31, 1]
    k = torch.randn(51, 2, 64, generator=g)
    v = torch.randn(51, 2, 64, generator=g)
    table = torch.randperm(12, generator=g)[:8].reshape(2, 4)
    positions = torch.cat([torch.arange(s) for s in seq_lens])
    req = torch.repeat_interleave(torch.arange(2), torch.tensor(seq_lens))
    slots = table[req, positions // 8] * 8 + positions % 8
    int4_per_token_head_write_cache(k, key_cache, slots)
    int4_per_token_head_write_cache(v, value_cache, slots)
    impl = ReferenceAttentionImpl(8, 64, num_kv_heads=2, kv_cache_dtype="int4_per_token_head")
    q = torch.randn(32, 8, 64, generator=g)
    metadata = ReferenceAttentionMetadata.build(seq_lens, query_lens, table, 8)
    layer = AttentionLayerScales(torch.ones(1), torch.ones(1))
    out = impl.forward(layer, q, None, None, cache, metadata)
    keys = int4_per_token_head_read_cache(key_cache)
    vals = int4_per_token_head_read_cache(value_cache)
    pos = torch.arange(20)
    kk = keys[table[1][pos // 8], pos % 8].repeat_interleave(4, 1)
    vv = vals[table[1][pos // 8], pos % 8].repeat_interleave(4, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[31], kk) / 8, -1)
    torch.testing.assert_close(out[31], torch.einsum("hn,nhd->hd", p, vv), atol=1e-6, rtol=1e-6)


_PTX_SCRIPT = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm.v1.attention.ops.int4_per_token_head import triton_compile_cases

opcodes = {}
for case in triton_compile_cases():
    signature = {**case.signature, **{name: "constexpr" for name in case.constexprs}}
    compiled = triton.compile(
        ASTSource(case.kernel, signature, dict(case.constexprs)),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": case.num_warps, "enable_fp_fusion": case.enable_fp_fusion},
    )
    found = re.findall(r"^\\s*(?:@!?%p\\d+\\s+)?([a-z][\\w.]*)", compiled.asm["ptx"], re.M)
    opcodes[case.name] = sorted(set(found))
print(json.dumps(opcodes))
"""


def test_store_ptx_rounds_every_fp32_step_as_the_codec() -> None:
    """The sm_90 store has no approximate division and no fused multiply-add (Triton's ``/`` is
    ``div.full.f32``; fusion would round ``r * inv + zp`` once), so a GPU writes the codec's
    bytes; the only float-to-int conversion truncates in-range values (clamped first), and
    the source's fp16 / bf16 widening is exact."""
    import json
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600, check=True)  # fmt: skip
    opcodes = json.loads(run.stdout.strip().splitlines()[-1])
    allowed = {"add.rn.f32", "sub.rn.f32", "mul.rn.f32", "div.rn.f32", "selp.f32", "abs.f32",
               "neg.f32", "min.f32", "max.f32", "cvt.rzi.s32.f32", "cvt.rn.f32.s32",
               "cvt.rn.f32.u32", "cvt.f32.bf16", "cvt.f32.f16", "mov.f32", "mov.b32",
               *(f"setp.{c}.f32" for c in ("eq", "ne", "lt", "le", "gt", "ge", "geu", "ltu",
                                            "neu", "nan", "num"))}  # fmt: skip
    float_op = re.compile(r"\.f32(\.|$)")
    for name in ("store/d128", "store/d96"):
        floats = {op for op in opcodes[name] if float_op.search(op)}
        assert "div.rn.f32" in floats, name
        assert floats <= allowed, f"{name}: {sorted(floats - allowed)}"


def test_upstream_unified_attention_int4_argument_errors() -> None:
    q, (k_side, v_side, k_scale, v_scale), args = _attention_case(64, 0, 0.0, False)
    args.pop("sinks")
    common = dict(q=q, k=k_side, v=v_side, out=torch.empty_like(q), q_descale=None,
                  k_descale=None, v_descale=None, kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD,
                  **args)  # fmt: skip
    with pytest.raises(ValueError, match="causal: expected True for INT4_PER_TOKEN_HEAD"):
        unified_attention(**common, causal=False, k_scale_cache=k_scale, v_scale_cache=v_scale)
    with pytest.raises(ValueError, match="k_scale_cache, v_scale_cache: expected both"):
        unified_attention(**common, causal=True, k_scale_cache=k_scale)
