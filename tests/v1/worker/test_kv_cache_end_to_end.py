"""End to end: specs → KVCacheConfig → allocate → reshape → reshape_and_cache_flash → the
reference backend's paged attention, compared with dense attention on the original K/V.

GPT-OSS-like model: a full-attention and a sliding-window group (8 KV heads, head size 64,
window 128, 2 layers each, sharing buffers pairwise as the planner does for hybrid models),
16 query heads (GQA 2). One batch mixes a 160-token prefill (> window), a 20-token chunked
prefill on a 140-token sequence, and two decodes (260 and 17 tokens).

Error metrics over all outputs of a layer: cosine similarity (float64), and
``max_rel_err = max|out - ref| / max|ref|`` (the largest error relative to the output scale).
Queries are fp32 so that only the cache format contributes. Bounds, with the values measured
over 4 seeds x 2 layouts x 4 layers (32 layer outputs per format):

- bf16 cache: stores the bf16 inputs exactly; only fp32-vs-fp64 rounding remains:
  cos ≥ 1 - 1e-9, max_rel_err ≤ 1e-5 (measured: 1.000000, < 1e-6).
- fp8 e4m3 (3 mantissa bits, element error ≤ 2^-4): cos ≥ 0.997 (measured 0.9987-0.9991),
  max_rel_err ≤ 0.3 (measured 0.026-0.143; an error in K also moves softmax weights, so the
  worst output element moves more than one element's 2^-4).
- fp8 e5m2 (2 mantissa bits), per-head scales: cos ≥ 0.99 (measured 0.9948-0.9959),
  max_rel_err ≤ 0.4 (measured 0.031-0.179).
- nvfp4 (E2M1 values, e4m3 scale per 16 elements): cos ≥ 0.97 (measured 0.9833-0.9877),
  max_rel_err ≤ 0.7 (measured 0.140-0.422). A wrong read fails by far: interleave4 scales
  read as linear give cos 0.35-0.47, linear read as interleave4 0.26-0.34, swapped nibbles
  -0.02-0.03 (``test_nvfp4_bound_rejects_*``). K/V magnitudes vary log-normally (sigma 0.75)
  per token, head and 16-channel group, like outlier channels, so a misplaced scale shows.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import pytest
import torch
from kv_cache_test_utils import DEVICES

from vllm import _custom_ops as ops
from vllm.kv_quant import ScaleLayout
from vllm.utils.torch_utils import nvfp4_split_data_scale
from vllm.v1.attention.backends import (
    AttentionBackend,
    AttentionLayerScales,
    FlashInferBackend,
    KVCacheScaleLayouts,
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
    compute_slot_mapping,
    kv_cache_layout,
    map_to_kernel_blocks,
    split_kv_cache,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    SlidingWindowSpec,
)
from vllm.v1.worker.gpu.attn_utils import (
    _allocate_kv_cache,
    _reshape_kv_cache,
    get_kv_cache_scale_layouts,
)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

NUM_KV_HEADS, HEAD_SIZE, NUM_HEADS, WINDOW = 8, 64, 16, 128
SEQ_LENS = [160, 260, 140, 17]
QUERY_LENS = [160, 1, 20, 1]  # prefill > window, decode, chunked prefill, decode
LAYERS = [("full.0", 0, None), ("full.1", 0, None), ("swa.0", 1, WINDOW), ("swa.1", 1, WINDOW)]


@dataclass(frozen=True)
class Fmt:
    """A cache format under test and its accuracy bounds."""

    kv_cache_dtype: str
    per_head: bool = False
    k_layout: str = "linear"
    v_layout: str = "linear"
    min_cos: float = 1 - 1e-9
    max_rel: float = 1e-5

    @property
    def quant_mode(self) -> KVQuantMode:
        if self.kv_cache_dtype == "nvfp4":
            return KVQuantMode.NVFP4
        if self.kv_cache_dtype.startswith("fp8"):
            return KVQuantMode.FP8_PER_TENSOR
        return KVQuantMode.NONE

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.quant_mode == KVQuantMode.NONE else torch.uint8

    @property
    def code_max(self) -> float:
        """Scale = amax / code_max (the dequantization scale)."""
        return {"nvfp4": 448.0 * 6.0, "fp8_e5m2": 57344.0}.get(self.kv_cache_dtype, 448.0)


BF16 = Fmt("bfloat16")
FP8 = Fmt("fp8", min_cos=0.997, max_rel=0.3)
FP8_E5M2_PER_HEAD = Fmt("fp8_e5m2", per_head=True, min_cos=0.99, max_rel=0.4)
NVFP4 = Fmt("nvfp4", min_cos=0.97, max_rel=0.7)
NVFP4_MIXED = Fmt(
    "nvfp4", per_head=True, k_layout="interleave4", v_layout="linear", min_cos=0.97, max_rel=0.7
)
FORMATS = {
    "bf16": BF16,
    "fp8": FP8,
    "fp8_e5m2_per_head": FP8_E5M2_PER_HEAD,
    "nvfp4": NVFP4,
    "nvfp4_k_interleave4": NVFP4_MIXED,
}


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Straightforward float64 causal attention of the last ``q.shape[0]`` positions of a
    sequence over all its keys ``k``/``v [L, Hkv, D]``; optional sliding window."""
    seq_len, q_len = k.shape[0], q.shape[0]
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q_len, q.shape[1], v.shape[2], dtype=torch.float64)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = 0 if window is None else max(0, p - window + 1)
            s = (kh[lo : p + 1] @ q[i, h].double()) / math.sqrt(q.shape[2])
            out[i, h] = torch.softmax(s, 0) @ vh[lo : p + 1]
    return out


def dense_attention_fast(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """The same as :func:`dense_attention` with an explicit mask (float64, vectorised)."""
    seq_len, q_len = k.shape[0], q.shape[0]
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) / math.sqrt(q.shape[2])
    qp = torch.arange(seq_len - q_len, seq_len)[:, None]
    kp = torch.arange(seq_len)[None, :]
    mask = kp <= qp
    if window is not None:
        mask &= kp > qp - window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), vv)


def test_dense_oracles_agree() -> None:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 16, generator=g)
    k = torch.randn(20, 2, 16, generator=g)
    v = torch.randn(20, 2, 16, generator=g)
    for window in (None, 5):
        torch.testing.assert_close(
            dense_attention_fast(q, k, v, window), dense_attention(q, k, v, window)
        )


def random_kv(num_tokens: int, g: torch.Generator) -> torch.Tensor:
    """bf16 ``[T, H, D]`` with log-normal magnitudes per token, head and 16-channel group."""
    mag = torch.exp(0.75 * torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE // 16, 1, generator=g))
    mag = mag.expand(-1, -1, -1, 16).reshape(num_tokens, NUM_KV_HEADS, HEAD_SIZE)
    return (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=g) * mag).bfloat16()


def make_scale(x: torch.Tensor, fmt: Fmt) -> torch.Tensor:
    if fmt.quant_mode == KVQuantMode.NONE:
        return torch.ones(1, dtype=torch.float32)
    amax = x.float().abs().amax(dim=(0, 2)) if fmt.per_head else x.float().abs().amax().reshape(1)
    return (amax / fmt.code_max).to(torch.float32)


def metrics(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    out, ref = out.double().cpu(), ref.double().cpu()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    return cos, ((out - ref).abs().max() / ref.abs().max()).item()


@dataclass
class Model:
    """Allocated caches and the random state of one end-to-end run."""

    caches: dict
    block_tables: dict[int, torch.Tensor]
    block_size: int
    num_blocks: int
    scale_layouts: dict[str, KVCacheScaleLayouts]
    """Recorded with the caches: the backend's NVFP4 scale layouts per layer."""


def build_model(
    fmt: Fmt,
    layout: str,
    device: str,
    g: torch.Generator,
    block_size: int = 16,
    kernel_block_size: int | None = None,
    backend: type[AttentionBackend] = ReferenceAttentionBackend,
) -> Model:
    """Planner-free config: two groups, two buffers each shared by one layer per group."""
    kwargs = dict(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=fmt.storage_dtype,
        kv_quant_mode=fmt.quant_mode,
    )
    full = FullAttentionSpec(**kwargs)
    swa = SlidingWindowSpec(**kwargs, sliding_window=WINDOW)
    assert full.page_size_bytes == swa.page_size_bytes
    num_blocks = 2 * sum(math.ceil(s / block_size) for s in SEQ_LENS) + 3
    size = num_blocks * full.page_size_bytes
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=size, shared_by=["full.0", "swa.0"]),
            KVCacheTensor(size=size, shared_by=["full.1", "swa.1"]),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["full.0", "full.1"], full),
            KVCacheGroupSpec(["swa.0", "swa.1"], swa),
        ],
    )
    kernel_sizes = None if kernel_block_size is None else [kernel_block_size] * 2
    with kv_cache_layout(layout):
        raw = _allocate_kv_cache(config, device)
        caches = _reshape_kv_cache(config, raw, [backend] * 2, fmt.kv_cache_dtype, kernel_sizes)
    scale_layouts = get_kv_cache_scale_layouts(config, [backend] * 2)
    # Random, disjoint pages for every (group, sequence): the groups share the buffers.
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(math.ceil(s / block_size) for s in SEQ_LENS)
    tables, used = {}, 0
    for group in (0, 1):
        table = torch.zeros(len(SEQ_LENS), max_blocks, dtype=torch.int64)
        for i, seq_len in enumerate(SEQ_LENS):
            n = math.ceil(seq_len / block_size)
            table[i, :n] = perm[used : used + n]
            used += n
        tables[group] = table.to(device)
    return Model(caches, tables, block_size, num_blocks, scale_layouts)


def write_layer(
    model: Model,
    name: str,
    group: int,
    fmt: Fmt,
    g: torch.Generator,
    device: str,
    writer: ReferenceAttentionImpl | None = None,
):
    """Write every token of every sequence (shuffled order) with reshape_and_cache_flash in
    ``fmt``'s scale layouts, or with ``writer.do_kv_cache_update`` (its layouts) when given."""
    total = sum(SEQ_LENS)
    k, v = random_kv(total, g), random_kv(total, g)
    k_scale, v_scale = make_scale(k, fmt).to(device), make_scale(v, fmt).to(device)
    positions = torch.cat([torch.arange(s) for s in SEQ_LENS])
    req = torch.repeat_interleave(torch.arange(len(SEQ_LENS)), torch.tensor(SEQ_LENS))
    slots = compute_slot_mapping(model.block_tables[group].cpu(), positions, model.block_size, req)
    order = torch.randperm(total, generator=g)
    layer = AttentionLayerScales(k_scale, v_scale)
    if writer is not None:
        writer.do_kv_cache_update(
            layer, k[order].to(device), v[order].to(device), model.caches[name], slots[order]
        )
        return k, v, layer
    key_cache, value_cache = split_kv_cache(model.caches[name])
    ops.reshape_and_cache_flash(
        k[order].to(device),
        v[order].to(device),
        key_cache,
        value_cache,
        slots[order].to(device),
        fmt.kv_cache_dtype,
        k_scale,
        v_scale,
        fmt.k_layout,
        fmt.v_layout,
    )
    return k, v, layer


def read_layer(
    model: Model,
    name: str,
    group: int,
    window: int | None,
    fmt: Fmt,
    layer: AttentionLayerScales,
    q: torch.Tensor,
    device: str,
    k_layout: str | None = None,
    v_layout: str | None = None,
) -> torch.Tensor:
    """Read through a ``ReferenceAttentionImpl`` in ``k_layout`` / ``v_layout`` (default:
    ``fmt``'s scale layouts)."""
    cache = model.caches[name]
    kernel_block = split_kv_cache(cache)[0].shape[1]
    table = map_to_kernel_blocks(model.block_tables[group], model.block_size // kernel_block)
    impl = ReferenceAttentionImpl(
        NUM_HEADS,
        HEAD_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        sliding_window=window,
        kv_cache_dtype=fmt.kv_cache_dtype,
        k_scale_layout=k_layout or fmt.k_layout,
        v_scale_layout=v_layout or fmt.v_layout,
    )
    metadata = ReferenceAttentionMetadata.build(SEQ_LENS, QUERY_LENS, table, kernel_block)
    return impl.forward(layer, q.to(device), None, None, cache, metadata)


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None):
    outs, k_off, q_off = [], 0, 0
    for seq_len, q_len in zip(SEQ_LENS, QUERY_LENS, strict=True):
        outs.append(
            dense_attention_fast(
                q[q_off : q_off + q_len],
                k[k_off : k_off + seq_len].float(),
                v[k_off : k_off + seq_len].float(),
                window,
            )
        )
        k_off += seq_len
        q_off += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_end_to_end_reference_attention(fmt_name: str, layout: str, device: str) -> None:
    fmt = FORMATS[fmt_name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{fmt_name}/{layout}".encode()))
    model = build_model(fmt, layout, device, g)
    written = {name: write_layer(model, name, grp, fmt, g, device) for name, grp, _ in LAYERS}
    for name, group, window in LAYERS:
        k, v, layer = written[name]
        q = torch.randn(sum(QUERY_LENS), NUM_HEADS, HEAD_SIZE, generator=g)
        out = read_layer(model, name, group, window, fmt, layer, q, device)
        assert out.shape == (sum(QUERY_LENS), NUM_HEADS, HEAD_SIZE)
        cos, rel = metrics(out, dense_reference(q, k, v, window))
        msg = f"{fmt_name}/{layout}/{device} layer {name}: cos={cos:.6f} max_rel_err={rel:.4f}"
        assert cos >= fmt.min_cos and rel <= fmt.max_rel, (
            f"{msg} (bounds: cos >= {fmt.min_cos}, max_rel_err <= {fmt.max_rel})"
        )


@pytest.mark.parametrize("fmt_name", ["bf16", "nvfp4_k_interleave4"])
def test_end_to_end_kernel_block_split(fmt_name: str) -> None:
    """Pages of 32 tokens viewed as kernel pages of 16: the expanded block table reads back
    what the same slot numbers wrote."""
    fmt = FORMATS[fmt_name]
    g = torch.Generator().manual_seed(11)
    model = build_model(fmt, "HND", "cpu", g, block_size=32, kernel_block_size=16)
    assert split_kv_cache(model.caches["full.0"])[0].shape[:2] == (2 * model.num_blocks, 16)
    for name, group, window in (LAYERS[0], LAYERS[2]):
        k, v, layer = write_layer(model, name, group, fmt, g, "cpu")
        q = torch.randn(sum(QUERY_LENS), NUM_HEADS, HEAD_SIZE, generator=g)
        out = read_layer(model, name, group, window, fmt, layer, q, "cpu")
        cos, rel = metrics(out, dense_reference(q, k, v, window))
        assert cos >= fmt.min_cos and rel <= fmt.max_rel, f"{name}: cos={cos:.6f} rel={rel:.4f}"


def _nvfp4_layer(layout: str = "NHD", k_layout: str = "linear", v_layout: str = "linear"):
    fmt = replace(NVFP4, k_layout=k_layout, v_layout=v_layout)
    g = torch.Generator().manual_seed(3)
    model = build_model(fmt, layout, "cpu", g)
    name, group, window = LAYERS[0]
    k, v, layer = write_layer(model, name, group, fmt, g, "cpu")
    q = torch.randn(sum(QUERY_LENS), NUM_HEADS, HEAD_SIZE, generator=g)
    return fmt, model, (name, group, window), (k, v, layer, q)


def _within_bound(fmt: Fmt, cos: float, rel: float) -> bool:
    return cos >= fmt.min_cos and rel <= fmt.max_rel


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_nvfp4_bound_rejects_wrong_scale_layout(layout: str) -> None:
    """Written with interleave4 scales: read correctly it meets the bound; read as linear it
    must fail it."""
    fmt, model, (name, group, window), (k, v, layer, q) = _nvfp4_layer(
        layout, "interleave4", "interleave4"
    )
    ref = dense_reference(q, k, v, window)
    good = metrics(read_layer(model, name, group, window, fmt, layer, q, "cpu"), ref)
    assert _within_bound(fmt, *good), f"correct read: cos={good[0]:.6f} rel={good[1]:.4f}"
    for k_layout, v_layout in (("linear", "linear"), ("linear", "interleave4")):
        bad = metrics(
            read_layer(model, name, group, window, fmt, layer, q, "cpu", k_layout, v_layout), ref
        )
        assert not _within_bound(fmt, *bad), (
            f"reading interleave4 scales as K={k_layout}, V={v_layout} went unnoticed: "
            f"cos={bad[0]:.6f} rel={bad[1]:.4f}"
        )


def test_flashinfer_nvfp4_scale_layout_travels_with_the_cache() -> None:
    """A FlashInfer NVFP4 cache (HND; trtllm-gen reads interleave4 scales) gets its scale
    layouts recorded with its views. Written through the recorded layouts (the reference
    writer built from them gives the bytes of ``reshape_and_cache_flash`` called with them) and
    read with them, attention meets the NVFP4 bound; read as linear, it fails it."""
    interleave4 = KVCacheScaleLayouts(ScaleLayout.INTERLEAVE4, ScaleLayout.INTERLEAVE4)
    model = build_model(
        NVFP4, "HND", "cpu", torch.Generator().manual_seed(7), backend=FlashInferBackend
    )
    direct = build_model(
        NVFP4, "HND", "cpu", torch.Generator().manual_seed(7), backend=FlashInferBackend
    )
    assert model.scale_layouts == {name: interleave4 for name, _, _ in LAYERS}
    for name, group, window in (LAYERS[0], LAYERS[2]):
        k_layout, v_layout = (layout.value for layout in model.scale_layouts[name])
        fmt = replace(NVFP4, k_layout=k_layout, v_layout=v_layout)
        writer = ReferenceAttentionImpl(
            NUM_HEADS,
            HEAD_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            kv_cache_dtype="nvfp4",
            **model.scale_layouts[name]._asdict(),
        )
        k, v, layer = write_layer(
            model, name, group, fmt, torch.Generator().manual_seed(8), "cpu", writer=writer
        )
        write_layer(direct, name, group, fmt, torch.Generator().manual_seed(8), "cpu")
        assert torch.equal(model.caches[name], direct.caches[name])
        q = torch.randn(
            sum(QUERY_LENS), NUM_HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(9)
        )
        ref = dense_reference(q, k, v, window)
        good = metrics(read_layer(model, name, group, window, fmt, layer, q, "cpu"), ref)
        assert _within_bound(fmt, *good), f"{name}: cos={good[0]:.6f} rel={good[1]:.4f}"
        bad = metrics(
            read_layer(model, name, group, window, fmt, layer, q, "cpu", "linear", "linear"), ref
        )
        assert not _within_bound(fmt, *bad), (
            f"{name}: interleave4 scales read as linear went unnoticed: "
            f"cos={bad[0]:.6f} rel={bad[1]:.4f}"
        )


def test_nvfp4_bound_rejects_swapped_nibbles() -> None:
    fmt, model, (name, group, window), (k, v, layer, q) = _nvfp4_layer()
    ref = dense_reference(q, k, v, window)
    assert _within_bound(
        fmt, *metrics(read_layer(model, name, group, window, fmt, layer, q, "cpu"), ref)
    )
    for side in split_kv_cache(model.caches[name]):
        data, _ = nvfp4_split_data_scale(side)
        data.copy_((data >> 4) | (data << 4))
    cos, rel = metrics(read_layer(model, name, group, window, fmt, layer, q, "cpu"), ref)
    assert not _within_bound(fmt, cos, rel), f"swapped nibbles went unnoticed: cos={cos:.6f}"


def test_reference_write_path_matches_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """``do_kv_cache_update`` (the op when built) and the pure-codec fallback give the same
    bytes, so the reference backend also works without the extension."""
    from vllm.v1.attention.backends import reference

    fmt = NVFP4_MIXED
    g = torch.Generator().manual_seed(2)
    a = build_model(fmt, "HND", "cpu", g)
    b = build_model(fmt, "HND", "cpu", torch.Generator().manual_seed(2))
    k, v = random_kv(40, g), random_kv(40, g)
    layer = AttentionLayerScales(make_scale(k, fmt), make_scale(v, fmt))
    slots = torch.randperm(a.num_blocks * 16, generator=g)[:40]
    slots[::7] = -1
    impl = ReferenceAttentionImpl(
        NUM_HEADS,
        HEAD_SIZE,
        num_kv_heads=NUM_KV_HEADS,
        kv_cache_dtype="nvfp4",
        k_scale_layout="interleave4",
        v_scale_layout="linear",
    )
    assert reference.compiled_writer() is not None
    impl.do_kv_cache_update(layer, k, v, a.caches["full.0"], slots)
    monkeypatch.setattr(reference, "compiled_writer", lambda: None)
    impl.do_kv_cache_update(layer, k, v, b.caches["full.0"], slots)
    assert torch.equal(a.caches["full.0"], b.caches["full.0"])
    assert a.caches["full.0"].any()
