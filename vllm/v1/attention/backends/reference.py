"""Reference attention backend: pure torch, any device, every cache format.

Same cache layout and shapes as :class:`~vllm.v1.attention.backends.flashinfer.FlashInferBackend`
(``(B, 2, N, H, D')``, NHD or HND, ``D' = F(D)`` for NVFP4), plus separate K / V regions when
``head_size_v != head_size``. The impl computes paged attention straight from the cache:
per sequence it gathers the pages it needs, dequantizes them with the reference codecs of
:mod:`vllm.kv_quant` (unquantized, FP8 e4m3 / e5m2 with per-tensor or ``[H]`` scales, NVFP4 with
linear or interleave4 block scales, K and V layouts independent), then attends in fp32.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from vllm.kv_quant import (
    Fp8Format,
    ScaleLayout,
    fp8_read_cache,
    interleave4_index,
    kv_scale_as_1d,
    nvfp4_read_cache,
    per_token_head_read_cache,
)
from vllm.kv_quant.formats import cache_dtype_names, lookup
from vllm.utils import check_positive_int
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    KVCacheScaleLayouts,
    MultipleOf,
    paged_kv_cache_shape,
)
from vllm.v1.attention.backends.key_rebuild import (
    KeyRebuild,
    check_key_sinks,
    write_layer_key_sinks,
)
from vllm.v1.attention.backends.reference_metadata import (
    CheckedForward,
    ReferenceAttentionMetadata,
    as_int_list,
)
from vllm.v1.attention.backends.utils import check_sequences, key_window, split_kv_cache


class ReferenceAttentionBackend(AttentionBackend):
    """Pure-torch paged attention over every cache format, on CPU and any CUDA GPU."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(cache_dtype_names())
    supported_head_sizes: ClassVar[list[int]] = []
    supported_kernel_block_sizes: ClassVar[list[int | MultipleOf]] = [MultipleOf(1)]
    supports_head_size_v: ClassVar[bool] = True

    @staticmethod
    def get_name() -> str:
        return "REFERENCE"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, 2, block_size, num_kv_heads, F(head_size) if nvfp4 else head_size)``,
        the same as FlashInfer's."""
        return paged_kv_cache_shape(
            "ReferenceAttentionBackend",
            num_blocks,
            block_size,
            num_kv_heads,
            head_size,
            cache_dtype_str,
        )

    @staticmethod
    def get_impl_cls() -> type[ReferenceAttentionImpl]:
        return ReferenceAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[ReferenceAttentionMetadata]:
        return ReferenceAttentionMetadata


def _gather_pages(side: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Copy pages ``pages`` of a cache side ``(B, N, H, F)`` into a new ``(p, N, H, F)`` tensor
    whose pages keep the side's byte order within a page (NHD or HND), so that the NVFP4
    ``[data | scales]`` split still applies."""
    inner = sorted(range(1, 4), key=lambda d: (side.shape[d] != 1, side.stride(d)), reverse=True)
    perm = [0, *inner]
    gathered = side.permute(perm).index_select(0, pages)
    return gathered.permute([perm.index(d) for d in range(4)])


def _copy_op() -> Any | None:
    """``vllm._custom_ops.reshape_and_cache_flash`` when the extension is built, else None."""
    try:
        from vllm import _custom_ops as ops

        fn = getattr(ops, "reshape_and_cache_flash", None)
        if fn is None:
            return None
        if getattr(ops, "is_available", None) is not None and not ops.is_available():
            return None
        return fn
    except (ImportError, OSError, RuntimeError):
        return None


_UNIT_SCALE = torch.ones(1, dtype=torch.float32)
"""The scale that an unquantized cache's reads and writes ignore (never written to)."""


class ReferenceAttentionImpl(AttentionImpl):
    """Paged attention read straight from the cache (decode, prefill, chunked prefill).

    ``scale`` defaults to ``1/sqrt(head_size)``. ``sliding_window`` W: the query at position
    ``p`` sees keys in ``(p - W, p]``. ``num_heads`` must be a multiple of ``num_kv_heads``
    (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``). ``sinks`` (fp32
    ``[num_heads]``) are per-head logits added to each softmax denominator (GPT-OSS).
    ``k_scale_layout`` / ``v_scale_layout`` name the NVFP4 block-scale layout of each side, for
    the write (:meth:`do_kv_cache_update`) and the read (:meth:`forward`): pass the layouts
    recorded with the cache (``get_kv_cache_scale_layouts``). Defaults (:meth:`scale_layouts`):
    the op's default for the cache's geometry; ``v_scale_layout=None`` means K's when
    ``k_scale_layout`` is given.
    """

    cache_device_type: ClassVar[str | None] = None
    """The device type that the cache must be on (``None``: any device)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float | None = None,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        *,
        head_size_v: int | None = None,
        k_scale_layout: ScaleLayout | str | None = None,
        v_scale_layout: ScaleLayout | str | None = None,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_size_v = head_size if head_size_v is None else head_size_v
        for name, value in (
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_size", head_size),
            ("head_size_v", head_size_v),
        ):
            check_positive_int(name, value)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={num_kv_heads} (GQA), "
                f"got {num_heads}"
            )
        if sliding_window is not None and (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or sliding_window <= 0
        ):
            raise ValueError(
                f"sliding_window: expected None or a positive int (tokens), got {sliding_window!r}"
            )
        fmt = lookup(kv_cache_dtype, include_mla_only=False)
        group = fmt.block_scale_group
        if group is not None:
            for name, value in (("head_size", head_size), ("head_size_v", head_size_v)):
                if value % group != 0:
                    raise ValueError(
                        f"{name}: {fmt.label.upper()} KV cache needs a multiple of {group}, "
                        f"got {value}"
                    )
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(
                f"logits_soft_cap: expected None or a positive float, got {logits_soft_cap!r}"
            )
        if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != num_heads):
            raise ValueError(
                f"sinks: expected shape [num_heads] = [{num_heads}], got {list(sinks.shape)}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.head_size = head_size
        self.head_size_v = head_size_v
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_cache_format = fmt
        self._cache_dims = {h: fmt.last_dim(h) for h in (head_size, head_size_v)}  # D -> D'
        self.logits_soft_cap = logits_soft_cap
        self.sinks = sinks
        # None: the backend's default for the cache's geometry, known at the first cache.
        self.k_scale_layout = None if k_scale_layout is None else ScaleLayout.parse(k_scale_layout)
        self.v_scale_layout = (
            ScaleLayout.parse(v_scale_layout) if v_scale_layout is not None else self.k_scale_layout
        )
        # Block size -> scale_layouts() checked to fit its pages; the layouts and head sizes
        # are fixed here, so an entry never goes stale.
        self._fitting_layouts: dict[int, KVCacheScaleLayouts] = {}

    def scale_layouts(self, block_size: int) -> KVCacheScaleLayouts:
        """NVFP4 scale layouts (K, V) of this impl's caches with pages of ``block_size``
        tokens: the named ones, else :class:`ReferenceAttentionBackend`'s default for the
        geometry (upstream's interleave4 where it fits, else linear)."""
        default = ReferenceAttentionBackend.get_kv_cache_scale_layouts(
            block_size, self.head_size, self.head_size_v
        )
        return KVCacheScaleLayouts(
            default.k_scale_layout if self.k_scale_layout is None else self.k_scale_layout,
            default.v_scale_layout if self.v_scale_layout is None else self.v_scale_layout,
        )

    # ----------------------------------------------------------------------------- checks

    @property
    def _is_nvfp4(self) -> bool:
        return self.kv_cache_format.is_nvfp4

    @property
    def _is_fp8(self) -> bool:
        return self.kv_cache_format.is_fp8

    @property
    def _fp8_format(self) -> Fp8Format:
        assert self.kv_cache_format.fp8_variant is not None
        return Fp8Format(self.kv_cache_format.fp8_variant)

    def _check_side(self, side: torch.Tensor, name: str, head_size: int) -> None:
        expected_dim = self._cache_dims[head_size]
        if side.dim() != 4 or side.shape[2] != self.num_kv_heads or side.shape[3] != expected_dim:
            raise ValueError(
                f"{name}: expected a (B, N, {self.num_kv_heads}, {expected_dim}) cache side for "
                f"kv_cache_dtype={self.kv_cache_dtype!r}, head size {head_size}, got shape "
                f"{list(side.shape)}"
            )
        quantized = self.kv_cache_format.is_quantized
        storage = self.kv_cache_format.storage_dtype
        if quantized and side.dtype != storage:
            raise ValueError(
                f"{name}: expected dtype {storage} for a {self.kv_cache_dtype} cache, "
                f"got {side.dtype}"
            )
        if not quantized and not side.dtype.is_floating_point:
            raise ValueError(
                f"{name}: expected a floating dtype for kv_cache_dtype="
                f"{self.kv_cache_dtype!r}, got {side.dtype}"
            )

    def _check_scale(self, scale: torch.Tensor, name: str) -> torch.Tensor:
        scale = kv_scale_as_1d(scale, name, self.num_kv_heads)
        # One host copy of the (at most num_kv_heads) values: cheaper per call than tensor ops.
        values = scale.tolist()
        if not all(0 < v < math.inf for v in values):  # NaN fails too
            raise ValueError(f"{name}: a quantized KV cache needs finite scales > 0, got {values}")
        return scale

    # ------------------------------------------------------------------------------ write

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key [T_pad, H, D]`` / ``value [T_pad, H, Dv]`` into the cache at
        ``slot_mapping [T]`` (negative slots skipped), quantizing on the way.

        Uses the compiled ``reshape_and_cache_flash`` when the extension is built, else the
        reference codecs of :mod:`vllm.kv_quant` (the same bytes by contract).
        """
        key_cache, value_cache = split_kv_cache(kv_cache)
        self._check_side(key_cache, "key_cache", self.head_size)
        self._check_side(value_cache, "value_cache", self.head_size_v)
        check_key_sinks(layer, *key_cache.shape[:3], self.head_size, self.kv_cache_format)
        self._write(layer, key, value, key_cache, value_cache, slot_mapping)

    def _write(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """:meth:`do_kv_cache_update` on cache sides that passed :meth:`_check_side`, then the
        layer's key sinks (:mod:`vllm.kv_quant.key_sinks`): the page writer checks every
        argument first, so the sink rows are written only once the pages are."""
        k_layout, v_layout = self._fitting_scale_layouts(key_cache.shape[1])
        op = _copy_op()
        if op is not None:
            op(
                key,
                value,
                key_cache,
                value_cache,
                slot_mapping,
                self.kv_cache_dtype,
                layer._k_scale,
                layer._v_scale,
                k_scale_layout=k_layout.value,
                v_scale_layout=v_layout.value,
            )
        else:  # the reference codecs (no extension built)
            from vllm.kv_quant import fp8_write_cache, nvfp4_write_cache, per_token_head_write_cache
            from vllm.kv_quant.nvfp4_cache import check_slot_mapping

            for x, side, scale, layout in (
                (key, key_cache, layer._k_scale, k_layout),
                (value, value_cache, layer._v_scale, v_layout),
            ):
                if self._is_nvfp4:
                    nvfp4_write_cache(
                        x,
                        side,
                        slot_mapping,
                        scale.to(side.device),
                        layout,
                        scale_search=self.kv_cache_format.scale_search,
                    )
                elif self.kv_cache_format.is_per_token_head:  # scales computed per row, not read
                    per_token_head_write_cache(x, side, slot_mapping, self.kv_cache_format)
                elif self._is_fp8:
                    fp8_write_cache(x, side, slot_mapping, scale.to(side.device), self._fp8_format)
                else:
                    num_slots = side.shape[0] * side.shape[1]
                    check_slot_mapping(slot_mapping, x.shape[0], num_slots, side.device)
                    keep = slot_mapping >= 0
                    slots = slot_mapping[keep]
                    rows = x[: slot_mapping.shape[0]][keep].to(side.dtype)
                    side[slots // side.shape[1], slots % side.shape[1]] = rows
        write_layer_key_sinks(layer, key, slot_mapping, key_cache.shape[1], self._is_nvfp4)

    # ------------------------------------------------------------------------------- read

    def _dequantize(
        self,
        pages: torch.Tensor,
        scale: torch.Tensor,
        head_size: int,
        layout: ScaleLayout,
    ) -> torch.Tensor:
        """fp32 ``(p, N, H, D)`` values of gathered cache pages."""
        if self._is_nvfp4:
            return nvfp4_read_cache(pages, scale, head_size, layout, torch.float32)
        if self._is_fp8:
            return fp8_read_cache(pages, scale, self._fp8_format, torch.float32)
        if self.kv_cache_format.is_per_token_head:  # each row's own scale
            return per_token_head_read_cache(pages, self.kv_cache_format, torch.float32)
        return pages.to(torch.float32)

    def _check_forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor | None,
    ) -> CheckedForward:
        """Validate every argument of :meth:`forward` (nothing is written here) and return the
        normalised inputs (``output`` allocated when ``None``). ``key`` / ``value`` themselves
        are checked by the writer, before it writes anything."""
        if (key is None) != (value is None):
            raise ValueError("key, value: pass both (to write them first) or neither")
        if query.dim() == 2:
            query = query.reshape(query.shape[0], self.num_heads, self.head_size)
        if query.dim() != 3 or tuple(query.shape[1:]) != (self.num_heads, self.head_size):
            raise ValueError(
                f"query: expected shape [T, {self.num_heads}, {self.head_size}], "
                f"got {list(query.shape)}"
            )
        supported = ReferenceAttentionBackend.supported_dtypes
        if query.dtype not in supported:
            raise ValueError(
                f"query: expected one of {', '.join(map(str, supported))}, got {query.dtype}"
            )
        key_cache, value_cache = split_kv_cache(kv_cache)
        self._check_side(key_cache, "key_cache", self.head_size)
        self._check_side(value_cache, "value_cache", self.head_size_v)
        if key_cache.shape[:2] != value_cache.shape[:2]:
            raise ValueError(
                f"value_cache: expected {list(key_cache.shape[:2])} pages x tokens like "
                f"key_cache, got {list(value_cache.shape[:2])}"
            )
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        self._fitting_scale_layouts(block_size)
        check_key_sinks(layer, *key_cache.shape[:3], self.head_size, self.kv_cache_format)
        device = key_cache.device
        wanted = self.cache_device_type
        if wanted is not None and device.type != wanted:
            raise ValueError(f"kv_cache: expected a tensor on {wanted}, got {device}")
        if query.device != device:
            raise ValueError(f"query: expected device {device} (the cache's), got {query.device}")
        k_scale = v_scale = _UNIT_SCALE
        fmt = self.kv_cache_format
        if fmt.is_quantized and not fmt.is_per_token_head:  # per-token-head: scales unread
            k_scale = self._check_scale(layer._k_scale, "k_scale").to(device)
            v_scale = self._check_scale(layer._v_scale, "v_scale").to(device)

        num_tokens = attn_metadata.num_actual_tokens
        if num_tokens > query.shape[0]:
            raise ValueError(
                f"query: expected at least num_actual_tokens={num_tokens} rows, "
                f"got {query.shape[0]}"
            )
        if output is None:
            output = torch.zeros(
                query.shape[0], self.num_heads, self.head_size_v, dtype=query.dtype, device=device
            )
        else:
            self._check_output(output, query, num_tokens)
        qsl = as_int_list(attn_metadata.query_start_loc, "query_start_loc")
        seq_lens = as_int_list(attn_metadata.seq_lens, "seq_lens")
        block_table = attn_metadata.block_table
        if len(qsl) != len(seq_lens) + 1 or qsl[0] != 0 or qsl[-1] != num_tokens:
            raise ValueError(
                f"query_start_loc: expected {len(seq_lens) + 1} entries from 0 to "
                f"num_actual_tokens={num_tokens}, got {qsl}"
            )
        if block_table.dim() != 2 or block_table.shape[0] < len(seq_lens):
            raise ValueError(
                f"block_table: expected shape [{len(seq_lens)}, max_blocks], "
                f"got {list(block_table.shape)}"
            )
        check_sequences(qsl, seq_lens, block_table, block_size, num_blocks, self.sliding_window)
        return CheckedForward(
            query, key_cache, value_cache, output, k_scale, v_scale, qsl, seq_lens
        )

    def _check_output(self, output: torch.Tensor, query: torch.Tensor, num_tokens: int) -> None:
        if output.dim() != 3 or tuple(output.shape[1:]) != (self.num_heads, self.head_size_v):
            raise ValueError(
                f"output: expected shape [T, {self.num_heads}, {self.head_size_v}], "
                f"got {list(output.shape)}"
            )
        if output.shape[0] < num_tokens:
            raise ValueError(
                f"output: expected at least num_actual_tokens={num_tokens} rows, "
                f"got {output.shape[0]}"
            )
        if output.dtype != query.dtype or output.device != query.device:
            raise ValueError(
                f"output: expected dtype {query.dtype} on {query.device} (the query's), "
                f"got {output.dtype} on {output.device}"
            )

    def _fitting_scale_layouts(self, block_size: int) -> KVCacheScaleLayouts:
        """:meth:`scale_layouts`, checked (NVFP4) to fit pages of ``block_size`` tokens
        (interleave4's needs: ``ValueError``); computed once per block size."""
        layouts = self._fitting_layouts.get(block_size)
        if layouts is None:
            layouts = self.scale_layouts(block_size)
            group = self.kv_cache_format.block_scale_group
            for layout, head_size in zip(layouts, (self.head_size, self.head_size_v), strict=True):
                if group is not None and layout is ScaleLayout.INTERLEAVE4:
                    interleave4_index(block_size, head_size // group, "meta")
            self._fitting_layouts[block_size] = layouts
        return layouts

    def _begin_forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor | None,
    ) -> CheckedForward:
        """:meth:`_check_forward`, then (only once every argument has passed) the write of
        ``key`` / ``value`` at ``attn_metadata.slot_mapping`` when given."""
        checked = self._check_forward(layer, query, key, value, kv_cache, attn_metadata, output)
        if key is not None and value is not None:
            self._write(
                layer,
                key,
                value,
                checked.key_cache,
                checked.value_cache,
                attn_metadata.slot_mapping,
            )
        return checked

    @staticmethod
    def _kernel_io(checked: CheckedForward) -> tuple[torch.Tensor, torch.Tensor]:
        """For the compiled impls' kernels, which need unit last strides: the query (a
        contiguous copy when its last stride is not 1) and the tensor to write the output into
        (``checked.output``, or a new one whose first ``num_actual_tokens`` rows the caller
        copies back)."""
        query = checked.query if checked.query.stride(-1) == 1 else checked.query.contiguous()
        output = checked.output
        if output.stride(-1) == 1:
            return query, output
        return query, torch.empty(output.shape, dtype=output.dtype, device=output.device)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query [T, num_heads, D]`` (or ``[T, num_heads*D]``) over the cache.

        When ``key`` / ``value`` are given they are first written at
        ``attn_metadata.slot_mapping``. Returns ``[T, num_heads, head_size_v]`` in the query
        dtype (written into ``output`` when given; rows past ``num_actual_tokens`` untouched).
        """
        checked = self._begin_forward(layer, query, key, value, kv_cache, attn_metadata, output)
        query, key_cache, value_cache, output = (
            checked.query,
            checked.key_cache,
            checked.value_cache,
            checked.output,
        )
        k_scale, v_scale = checked.k_scale, checked.v_scale
        qsl, seq_lens = checked.query_start_loc, checked.seq_lens
        block_table = attn_metadata.block_table
        device = key_cache.device
        block_size = key_cache.shape[1]
        k_layout, v_layout = self._fitting_scale_layouts(block_size)
        block_table = block_table.to(device=device, dtype=torch.int64)
        rebuild = KeyRebuild.of(layer, block_table, len(seq_lens), k_scale, self._is_nvfp4)

        for i, seq_len in enumerate(seq_lens):
            q_start, q_end = qsl[i], qsl[i + 1]
            q_len = q_end - q_start
            if q_len == 0:
                continue
            first_q = seq_len - q_len
            first_key, last_key = key_window(seq_len, q_len, self.sliding_window)
            p0, p1 = first_key // block_size, last_key // block_size
            pages = block_table[i, p0 : p1 + 1]
            start = first_key - p0 * block_size
            stop = last_key + 1 - p0 * block_size
            k = self._dequantize(_gather_pages(key_cache, pages), k_scale, self.head_size, k_layout)
            v = self._dequantize(
                _gather_pages(value_cache, pages), v_scale, self.head_size_v, v_layout
            )
            k = k.reshape(-1, self.num_kv_heads, self.head_size)[start:stop]
            v = v.reshape(-1, self.num_kv_heads, self.head_size_v)[start:stop]
            key_pos = torch.arange(first_key, last_key + 1, device=device)
            if rebuild is not None:
                k = rebuild.keys(k, i, key_pos)
            q_pos = torch.arange(first_q, seq_len, device=device)
            out = self._attend(query[q_start:q_end], k, v, q_pos, key_pos, attn_metadata.causal)
            output[q_start:q_end] = out.to(output.dtype)
        return output

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        key_pos: torch.Tensor,
        causal: bool,
    ) -> torch.Tensor:
        """fp32 attention of ``q [q, Hq, D]`` over ``k [k, Hkv, D]``, ``v [k, Hkv, Dv]``."""
        group = self.num_queries_per_kv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.to(torch.float32), k) * self.scale
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        delta = q_pos[:, None] - key_pos[None, :]  # query position - key position
        allowed = torch.ones_like(delta, dtype=torch.bool)
        if causal:
            allowed &= delta >= 0
        if self.sliding_window is not None:
            allowed &= delta < self.sliding_window
            if not causal:
                allowed &= delta > -self.sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.to(device=scores.device, dtype=torch.float32)
            sink = sink[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)
