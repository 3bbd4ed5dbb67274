"""CPU attention backend: compiled paged attention that reads every cache format in place.

Same cache shape and layouts as the reference backend
(:class:`~vllm.v1.attention.backends.reference.ReferenceAttentionBackend`:
``(B, 2, N, H, D')``, NHD or HND, separate K / V regions when ``head_size_v != head_size``), so
either backend reads what the other wrote; same metadata and impl constructor. The impl runs
``torch.ops._C_cache_ops.paged_attention`` (``csrc/cpu/paged_attention.h``): per (sequence, KV
head, query block, key split) it decodes one page at a time (unquantized, FP8 e4m3 / e5m2 with
per-tensor or per-head scales, NVFP4 with linear or interleave4 block scales, per-token-head
INT8 / FP8 rows with their inline scales) with SIMD decoders, in registers or bf16-dot panels
where the values are exact in bf16, and attends with an online softmax in fp32 (GQA, causal and
chunked prefill, sliding window, sinks, logits soft cap, ``head_size_v``). Packed-slot layers
(TurboQuant, UltraQuant, Octave; the reference backend's TURBOQUANT-shaped cache) run
``packed_paged_attention``
(:mod:`vllm._packed_attention_ops`), the same kernel over slots decoded in the formats' frames.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from vllm.kv_quant.formats import formats
from vllm.kv_quant.slot_codecs import OCTAVE_CHECK_ROPE_DIM, is_packed
from vllm.v1.attention.backends.abstract import AttentionLayer, DeviceCapability
from vllm.v1.attention.backends.reference import (
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
)
from vllm.v1.attention.backends.reference_metadata import CheckedForward


class CPUAttentionBackend(ReferenceAttentionBackend):
    """Compiled paged attention on CPU over every cache format (needs the built extension)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # The formats the compiled kernels write and read (the others fall to REFERENCE).
    supported_kv_cache_dtypes: ClassVar[list[str]] = [
        name
        for fmt in formats()
        if not fmt.mla_only and (is_packed(fmt) or (fmt.cache_kind is not None and fmt.has_kernel))
        for name in fmt.accepted_names
    ]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        """CPU only (``capability is None``)."""
        return capability is None

    @classmethod
    def _runtime_reasons(cls) -> list[str]:
        """The compiled kernel, when it is not loadable."""
        missing = _kernel_missing()
        return [] if missing is None else [f"CPU_ATTN needs {missing}"]

    @staticmethod
    def get_impl_cls() -> type[CPUAttentionImpl]:
        return CPUAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[CPUAttentionMetadata]:
        return CPUAttentionMetadata


class CPUAttentionMetadata(ReferenceAttentionMetadata):
    """The reference backend's metadata (``build(seq_lens, query_lens, block_table,
    block_size)``); the impl passes its int32 copies to the kernel."""


def _int32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int32).contiguous()


def _get_attn_isa(
    dtype: torch.dtype,
    block_size: int,
    head_size: int | None = None,
    kv_cache_dtype: str | None = None,
) -> str:
    """The name upstream's CPU attention ops give this host's instruction set for a layer
    (``amx``, ``neon``, ``rvv``, ``vxe``, ``vsx``, ``vec``, or ``vec16`` for head sizes and
    pages that are multiples of 16 but not of 32), as their ``isa`` argument. This library's
    kernels read every name on every host (:mod:`vllm._cpu_attn_args`), FP8 caches included,
    so unlike upstream no combination is refused; ``kv_cache_dtype`` does not change the name."""
    from vllm.platforms import CpuArchEnum, current_platform

    if head_size is not None and head_size % 32 != 0 and head_size % 16 == 0:
        return "vec16"
    arch = current_platform.get_cpu_architecture()
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    if arch == CpuArchEnum.ARM:
        return "neon"
    if block_size % 32 != 0:
        return "vec16"
    return {CpuArchEnum.RISCV: "rvv", CpuArchEnum.S390X: "vxe", CpuArchEnum.POWERPC: "vsx"}.get(
        arch, "vec"
    )


@functools.cache
def _kernel_missing() -> str | None:
    """Why ``vllm._custom_ops.paged_attention`` cannot run here, or ``None`` when it can."""
    try:
        from vllm import _custom_ops as ops

        ops.paged_attention_simd_levels()
    except (ImportError, OSError, RuntimeError, AttributeError) as e:
        return f"the compiled extension's paged_attention ({type(e).__name__}: {e})"
    return None


@functools.cache
def _simd_levels() -> tuple[str, ...]:
    """:func:`vllm._custom_ops.paged_attention_simd_levels` (fixed by the build)."""
    from vllm import _custom_ops as ops

    return tuple(ops.paged_attention_simd_levels())


class CPUAttentionImpl(ReferenceAttentionImpl):
    """The reference impl's constructor, checks and cache writer; :meth:`forward` runs the
    compiled kernel. ``simd`` (class attribute or per instance) picks the kernels' instruction
    set: ``"auto"`` or one of :func:`vllm._custom_ops.paged_attention_simd_levels`."""

    simd: str = "auto"
    cache_device_type: ClassVar[str | None] = "cpu"

    def _reads_packed_slots(self) -> bool:
        """This impl's :meth:`forward` reads them (``packed_paged_attention``)."""
        return type(self).forward is CPUAttentionImpl.forward

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
        """The reference impl's checks (a cache on the CPU included) plus :attr:`simd`, so that
        the kernel's own checks cannot fail once the new tokens are written."""
        if self.simd != "auto" and self.simd not in (levels := _simd_levels()):
            raise ValueError(
                f"simd: expected 'auto' or one of {', '.join(levels)}, got {self.simd!r}"
            )
        return super()._check_forward(layer, query, key, value, kv_cache, attn_metadata, output)

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
        """Attention of ``query [T, num_heads, D]`` (or ``[T, num_heads*D]``) over the cache,
        as :meth:`ReferenceAttentionImpl.forward` (same arguments, result and errors)."""
        checked = self._begin_forward(layer, query, key, value, kv_cache, attn_metadata, output)
        query, target = self._kernel_io(checked)
        output = checked.output
        sinks = None
        if self.sinks is not None:
            sinks = self.sinks.to(device=query.device, dtype=torch.float32).contiguous()
        if self._packed is not None:
            self._packed_forward(checked, query, target, sinks, attn_metadata)
        else:
            self._paged_forward(checked, query, target, sinks, attn_metadata)
        if target is not output:
            rows = attn_metadata.num_actual_tokens
            output[:rows] = target[:rows]
        return output

    def _packed_forward(
        self,
        checked: CheckedForward,
        query: torch.Tensor,
        target: torch.Tensor,
        sinks: torch.Tensor | None,
        attn_metadata: ReferenceAttentionMetadata,
    ) -> None:
        from vllm._packed_attention_ops import packed_paged_attention

        device = checked.key_cache.device
        packed_paged_attention(
            target,
            query,
            checked.key_cache.transpose(1, 2),  # the logical (B, H, N, slot) cache
            _int32(attn_metadata.block_table, device),
            _int32(attn_metadata.seq_lens, device),
            _int32(attn_metadata.query_start_loc, device),
            self.kv_cache_dtype,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            sinks,
            attn_metadata.causal,
            simd=self.simd,
            default_rope_dim=OCTAVE_CHECK_ROPE_DIM,
        )

    def _paged_forward(
        self,
        checked: CheckedForward,
        query: torch.Tensor,
        target: torch.Tensor,
        sinks: torch.Tensor | None,
        attn_metadata: ReferenceAttentionMetadata,
    ) -> None:
        from vllm import _custom_ops as ops

        device = checked.key_cache.device
        rebuild = self._key_rebuild(checked, attn_metadata.block_table)
        ops.paged_attention(
            target,
            query,
            checked.key_cache,
            checked.value_cache,
            _int32(attn_metadata.block_table, device),
            _int32(attn_metadata.seq_lens, device),
            _int32(attn_metadata.query_start_loc, device),
            self.kv_cache_dtype,
            checked.k_scale.contiguous(),  # already [1] or [H]: _check_forward applied the rule
            checked.v_scale.contiguous(),
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            sinks,
            attn_metadata.causal,
            self.k_scale_layout,
            self.v_scale_layout,
            simd=self.simd,
            **({} if rebuild is None else rebuild.kernel_args()),
        )
