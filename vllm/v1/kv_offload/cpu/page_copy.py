"""CPU <-> GPU page copies through ``ops.swap_blocks`` (tensor + unit mapping):
:class:`PageCopyHandler` (one direction) and :class:`CpuGpuOffloadingHandlers` (both, v0.22's
API). Upstream v0.33's address-batch handler is :mod:`~vllm.v1.kv_offload.cpu.gpu_worker`'s.

Every job copies pages of every registered KV-cache buffer (the bytes each KV-cache group's
data references name) with ``vllm._custom_ops.swap_blocks(src, dst, unit, unit_mapping)``,
addressing both sides in units of bytes that divide the page size and the row strides, so the
CPU side may be dense pages or a :class:`SharedOffloadRegion`'s strided per-worker cells. Pages
are moved as raw bytes, so quantized pages (FP8 / NVFP4 / per-token-head data and their
scales) survive bit for bit.

Ordering contract.

- Per handler (per direction): jobs run in submission order and
  :meth:`PageCopyHandler.get_finished` reports them in submission order — a job
  is never reported before an earlier job of the same handler.
- Across directions (read-after-write on CPU blocks): the CPU -> GPU handler waits for every
  earlier unreported store of the GPU -> CPU handler (``depends_on``), whatever blocks it
  touches, without blocking the host (CUDA: ``cudaStreamWaitEvent`` on the stores' end events;
  thread path: the load's thread waits on their completion events). A load whose awaited store
  failed fails too (thread path; on CUDA a failed copy is a sticky device error). Stores do not
  wait for loads: the engine never stores a GPU block before the load into it is reported,
  and never reuses a CPU block while a load reads it.
- :class:`~vllm.v1.kv_offload.worker.worker.OffloadingWorker` passes each handler's results
  through as they come; it holds nothing back across directions.

Only the device-specific part differs, a
:class:`~vllm.v1.kv_offload.worker.transfer_stream.TransferStream`:

- :class:`CudaTransferStream`: one CUDA stream per handler (jobs serialize on it), one event
  per job, polled in submission order. A GPU -> CPU job waits on an event recorded on the
  submitting thread's compute stream, so it copies what the work queued so far produced.
- :class:`ThreadTransferStream` (CPU-only machines): one worker thread per handler runs the
  jobs FIFO; host writes made before submission happen-before the copy.

Completion of a CPU -> GPU job means the pages are in GPU memory; the engine must not read them
before it has seen the job finish (:meth:`get_finished` / :meth:`wait`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from vllm.utils import check_positive_int
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalPageMapping,
    GPULoadStoreSpec,
    TransferSpec,
    TransferType,
)
from vllm.v1.kv_offload.cpu.canonical_copy import (
    CopyPlan,
    UnitPlan,
    build_copy_plan,
    canonical_block_sizes,
    canonical_page_ids,
    unit_plan,
    whole_page_plan,
)
from vllm.v1.kv_offload.cpu.region_pinning import pin_region
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.worker.page_views import canonical_page_tensor
from vllm.v1.kv_offload.worker.transfer_stream import (
    StreamOffloadingHandler,
    TransferStream,
    make_transfer_stream,
)

SwapBlocksFn = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], None]
"""``swap_blocks(src, dst, block_size_in_bytes, block_mapping)``: copy page ``m[i, 0]`` of
``src`` to page ``m[i, 1]`` of ``dst`` for every row of the int64 CPU ``[n, 2]`` mapping."""


def default_swap_blocks() -> SwapBlocksFn:
    """``vllm._custom_ops.swap_blocks`` (imported on first use; the extension must be built)."""
    try:
        from vllm import _custom_ops as ops
    except ImportError as e:
        raise ImportError(
            "KV offloading copies pages with vllm._custom_ops.swap_blocks, but the compiled "
            f"extension could not be imported: {e}"
        ) from e
    return ops.swap_blocks


def check_worker_inputs(
    kv_caches: CanonicalKVCaches,
    pages_per_host_page_name: str,
    pages_per_host_page: int,
    num_host_pages_name: str,
    num_host_pages: int,
    mmap_region: SharedOffloadRegion | None,
) -> None:
    """What a CPU<->GPU worker checks before it holds anything: positive counts (named as
    its signature names them), at least one cache tensor, and a shared region of
    ``num_host_pages`` host pages."""
    check_positive_int(pages_per_host_page_name, pages_per_host_page)
    check_positive_int(num_host_pages_name, num_host_pages)
    if not kv_caches.tensors:
        raise ValueError("kv_caches: expected at least one KV-cache tensor, got none")
    if mmap_region is not None and mmap_region.num_blocks != num_host_pages:
        raise ValueError(
            f"mmap_region: expected {num_host_pages} host pages ({num_host_pages_name}), "
            f"got {mmap_region.num_blocks}"
        )


def expand_block_ids(
    block_ids: np.ndarray, block_size_factor: int, output: np.ndarray, skip_count: int = 0
) -> None:
    """Write the page ids of ``block_ids`` into ``output`` (the host page numbering of
    :func:`~vllm.v1.kv_offload.cpu.canonical_copy.canonical_page_ids`).

    Block ``b`` covers pages ``b * f .. b * f + f - 1`` (``f = block_size_factor``). The first
    ``skip_count`` pages of the first block are left out, so ``output`` must have
    ``len(block_ids) * f - skip_count`` entries.
    """
    output[:] = canonical_page_ids(block_ids, block_size_factor, len(output), skip_count)


class PageCopyHandler(StreamOffloadingHandler):
    """Copies pages from ``src_tensors`` to ``dst_tensors`` (one direction), in order.

    ``src_tensors[i]`` and ``dst_tensors[i]`` are ``torch.uint8`` ``[num_rows, row_bytes]``
    tensors (unit column stride, rows possibly strided apart) of the same page size, fixed by
    the side whose blocks are one page; each row holds one page or one block of pages. A block
    of the source spec covers ``src_block_size_factor`` pages, a block of the destination
    ``dst_block_size_factor`` pages; how a job's block ids split into groups and pages is
    :meth:`build_block_mappings`. ``group_data_refs`` (upstream's
    ``kv_cache_groups_data_refs``): per KV-cache group, the tensors its blocks live in and the
    leading bytes of each page it moves; without it ``group_tensor_indices`` names the tensors
    and whole pages move (default: one group using every tensor). ``mmap_region``: the shared
    offload region this handler cleans up on :meth:`shutdown`.

    ``depends_on``: another handler whose earlier jobs this handler's jobs wait for — every job
    of it submitted before and not yet reported (see the module's ordering contract).

    ``canonical_layout``: the host side's pages are canonical pages
    (:mod:`~vllm.v1.kv_offload.cpu.canonical_copy`): ``group_data_refs`` must all carry a
    mapping, host rows hold ``canonical_block_sizes`` bytes per page, and a store writes only
    the pages this worker is the writer of.
    """

    def __init__(
        self,
        src_tensors: Sequence[torch.Tensor],
        dst_tensors: Sequence[torch.Tensor],
        src_block_size_factor: int,
        dst_block_size_factor: int,
        transfer_type: TransferType,
        transfer_stream: TransferStream,
        wait_for_compute: bool,
        swap_blocks: SwapBlocksFn | None = None,
        depends_on: StreamOffloadingHandler | None = None,
        group_tensor_indices: Sequence[Sequence[int]] | None = None,
        group_data_refs: Sequence[Sequence[CanonicalKVCacheRef]] | None = None,
        mmap_region: SharedOffloadRegion | None = None,
        canonical_layout: bool = False,
    ):
        if len(src_tensors) != len(dst_tensors) or not src_tensors:
            raise ValueError(
                f"src_tensors/dst_tensors: expected the same non-zero number of tensors, got "
                f"{len(src_tensors)} and {len(dst_tensors)}"
            )
        for factor_name, factor in (
            ("src_block_size_factor", src_block_size_factor),
            ("dst_block_size_factor", dst_block_size_factor),
        ):
            check_positive_int(factor_name, factor)
        if canonical_layout and group_data_refs is None:
            raise ValueError(
                "group_data_refs: expected mapped refs with canonical_layout, got None"
            )
        # The GPU side's pages are the worker's own; with canonical_layout the host's differ.
        gpu_col = 0 if transfer_type[0] == "GPU" else 1
        host_pages = (
            canonical_block_sizes(group_data_refs, len(src_tensors))
            if canonical_layout and group_data_refs is not None
            else None
        )
        self.page_sizes_bytes: list[int] = []
        self._side_pages: list[tuple[int, int]] = []
        for i, (src, dst) in enumerate(zip(src_tensors, dst_tensors, strict=True)):
            for side, t in (("src", src), ("dst", dst)):
                if (
                    t.dtype != torch.uint8
                    or t.dim() != 2
                    or t.stride(1) != 1
                    or (t.shape[0] > 1 and t.stride(0) < t.shape[1])
                ):
                    raise ValueError(
                        f"{side}_tensors[{i}]: expected a torch.uint8 [num_rows, row_bytes] "
                        f"tensor of non-overlapping rows, got {t.dtype} of shape "
                        f"{tuple(t.shape)} and strides {t.stride()}"
                    )
            # The side whose blocks are single pages fixes the page size; the other side's
            # rows hold one page or one block of pages.
            page = (src, dst)[gpu_col].shape[1] if host_pages is not None else None
            if page is None:
                page = src.shape[1] if src_block_size_factor == 1 else dst.shape[1]
            sides = (page, page) if host_pages is None else (page, host_pages[i])
            sides = sides if gpu_col == 0 else sides[::-1]
            for side, t, factor, side_page in (
                ("src", src, src_block_size_factor, sides[0]),
                ("dst", dst, dst_block_size_factor, sides[1]),
            ):
                if t.shape[1] not in (side_page, factor * side_page):
                    raise ValueError(
                        f"{side}_tensors[{i}]: page size {t.shape[1]} bytes differs from the "
                        f"{'destination' if side == 'src' else 'source'}'s {side_page} bytes "
                        f"(rows of {factor} pages allowed)"
                    )
            self.page_sizes_bytes.append(page)
            self._side_pages.append(sides)
        self.src_tensors = src_tensors if isinstance(src_tensors, list) else list(src_tensors)
        self.dst_tensors = dst_tensors if isinstance(dst_tensors, list) else list(dst_tensors)
        self.src_block_size_factor = src_block_size_factor
        self.dst_block_size_factor = dst_block_size_factor
        self.num_src_blocks = self._num_pages(self.src_tensors, 0) // src_block_size_factor
        self.num_dst_blocks = self._num_pages(self.dst_tensors, 1) // dst_block_size_factor
        super().__init__(transfer_type, transfer_stream, wait_for_compute, depends_on)
        self._swap_blocks = swap_blocks
        # Per KV-cache group, the tensors its blocks live in and the bytes of each page moved
        # (default: one group using every tensor's whole pages).
        if group_data_refs is None:
            group_data_refs = [
                [CanonicalKVCacheRef(t, self.page_sizes_bytes[t]) for t in g]
                for g in (group_tensor_indices or [range(len(self.src_tensors))])
            ]
        for refs in group_data_refs:
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(self.src_tensors) or not (
                    0 < ref.page_size_bytes <= self.page_sizes_bytes[ref.tensor_idx]
                ):
                    raise ValueError(
                        f"group_data_refs: {ref} is not a tensor index with at most that "
                        f"tensor's page size ({len(self.src_tensors)} tensors, page sizes "
                        f"{self.page_sizes_bytes})"
                    )
        self.kv_cache_groups_data_refs: list[list[CanonicalKVCacheRef]] = [
            list(refs) for refs in group_data_refs
        ]
        self.group_tensor_indices: list[list[int]] = [
            [ref.tensor_idx for ref in refs] for refs in self.kv_cache_groups_data_refs
        ]
        # Per data reference (by identity: the refs live as long as the handler), its copy in
        # units, bytes per page, and the mapping whose writer takes turns (stores only).
        self._plans: dict[int, tuple[UnitPlan, int, CanonicalPageMapping | None]] = {}
        for refs in self.kv_cache_groups_data_refs:
            for ref in refs:
                self._plans[id(ref)] = self._plan_ref(ref, canonical_layout, gpu_col == 0)
        # The shared offload region this handler cleans up on shutdown (the store side owns it).
        self._mmap_region = mmap_region

    def _plan_ref(
        self, ref: CanonicalKVCacheRef, canonical: bool, store: bool
    ) -> tuple[UnitPlan, int, CanonicalPageMapping | None]:
        plan: CopyPlan = (
            build_copy_plan(ref, store) if canonical else whole_page_plan(ref.page_size_bytes)
        )
        t = ref.tensor_idx
        src, dst = self.src_tensors[t], self.dst_tensors[t]
        units = unit_plan(plan, src.stride(0), dst.stride(0), *self._side_pages[t])
        writers = ref.mapping if canonical and store else None
        return units, plan.total_bytes, writers

    def _num_pages(self, tensors: list[torch.Tensor], col: int) -> int:
        return min(
            t.shape[0] * (t.shape[1] // pages[col])
            for t, pages in zip(tensors, self._side_pages, strict=True)
        )

    def _check_ids(self, name: str, ids: np.ndarray, num_blocks: int) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            bad = ids[(ids < 0) | (ids >= num_blocks)]
            raise ValueError(
                f"spec: {name} block ids must be in [0, {num_blocks}), got {bad.tolist()}"
            )

    def build_block_mappings(
        self, spec: TransferSpec
    ) -> list[tuple[Sequence[CanonicalKVCacheRef], np.ndarray]]:
        """Per KV-cache group: its data references and the int64 ``[n, 2]`` (source page,
        destination page) mapping of ``spec``.

        The GPU side is a :class:`GPULoadStoreSpec`; the other side lists the blocks of group
        0, then group 1, ...: group ``g`` starting at request block ``i = block_indices[g]``
        with ``n = group_sizes[g]`` GPU blocks spans ``ceil((i % f + n) / f)`` blocks of ``f``
        pages, whose first ``i % f`` pages it skips.
        """
        src_spec, dst_spec = spec
        for side, s in (("source", src_spec), ("destination", dst_spec)):
            if not isinstance(s, BlockIDsLoadStoreSpec):
                raise ValueError(
                    f"spec: expected block-id specs, got {type(s).__name__} as the {side}"
                )
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        gpu_spec = src_spec if isinstance(src_spec, GPULoadStoreSpec) else dst_spec
        if not isinstance(gpu_spec, GPULoadStoreSpec):
            raise ValueError(f"spec: expected a GPULoadStoreSpec side, got {spec!r}")
        if len(gpu_spec.group_sizes) != len(self.kv_cache_groups_data_refs):
            raise ValueError(
                f"spec: group_sizes has {len(gpu_spec.group_sizes)} entries for "
                f"{len(self.kv_cache_groups_data_refs)} KV-cache groups"
            )
        src_ids, dst_ids = src_spec.block_ids, dst_spec.block_ids
        self._check_ids(f"{self.transfer_type[0]} (source)", src_ids, self.num_src_blocks)
        self._check_ids(f"{self.transfer_type[1]} (destination)", dst_ids, self.num_dst_blocks)
        mappings: list[tuple[Sequence[CanonicalKVCacheRef], np.ndarray]] = []
        offsets = [0, 0]
        for size, index, refs in zip(
            gpu_spec.group_sizes,
            gpu_spec.block_indices,
            self.kv_cache_groups_data_refs,
            strict=True,
        ):
            if size < 0 or index < 0:
                raise ValueError(f"spec: negative group size {size} or block index {index}")
            if size == 0:
                continue
            mapping = np.empty((size, 2), dtype=np.int64)
            for col, (ids, factor) in enumerate(
                ((src_ids, self.src_block_size_factor), (dst_ids, self.dst_block_size_factor))
            ):
                skip = index % factor
                count = -(-(skip + size) // factor)
                blocks = ids[offsets[col] : offsets[col] + count]
                if blocks.size != count:
                    raise ValueError(
                        f"spec: {ids.size} {self.transfer_type[col]} block ids are too few for "
                        f"group sizes {list(gpu_spec.group_sizes)} and block indices "
                        f"{list(gpu_spec.block_indices)} ({factor} pages per block)"
                    )
                pages = np.empty(count * factor - skip, dtype=np.int64)
                expand_block_ids(blocks, factor, pages, skip)
                mapping[:, col] = pages[:size]
                offsets[col] += count
            mappings.append((refs, mapping))
        if offsets != [src_ids.size, dst_ids.size]:
            raise ValueError(
                f"spec: {src_ids.size} source and {dst_ids.size} destination block ids, but the "
                f"groups use {offsets[0]} and {offsets[1]}"
            )
        return mappings

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if job_id in self._in_flight:
            raise ValueError(f"job_id: job {job_id} is already in flight")
        mappings = self.build_block_mappings(spec)
        swap_blocks = self._swap_blocks or default_swap_blocks()
        self._swap_blocks = swap_blocks
        copies: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]] = []
        num_bytes = 0
        for refs, mapping in mappings:
            for ref in refs:
                src, dst, unit, byte_mapping, ref_bytes = self._byte_mapping(ref, mapping)
                copies.append((src, dst, unit, byte_mapping))
                num_bytes += ref_bytes

        def copy_pages() -> None:
            for src, dst, unit, byte_mapping in copies:
                swap_blocks(src, dst, unit, byte_mapping)

        return self.submit_job(job_id, copy_pages, num_bytes)

    def _byte_mapping(
        self, ref: CanonicalKVCacheRef, mapping: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, int]:
        """``swap_blocks`` arguments that copy ``ref``'s bytes of page ``mapping[i, 0]`` of its
        source tensor to page ``mapping[i, 1]`` of its destination tensor, and the bytes moved.

        Page ``p`` of a tensor whose rows hold ``k`` pages lies ``(p // k) * row stride +
        (p % k) * page size`` bytes after its data pointer, so strided rows (a
        :class:`SharedOffloadRegion` view, whose rows interleave every worker's pages) work as
        well as dense pages: the copy runs in units dividing the row strides, page sizes and
        the reference's fragments (its first ``page_size_bytes``, or its canonical fragments),
        each page moving the same units on both sides. A store of replicated canonical pages
        keeps the pages this worker writes.
        """
        units, page_bytes, writers = self._plans[id(ref)]
        if writers is not None and writers.num_writers > 1:
            keep = mapping[:, 1] % writers.num_writers == writers.writer_index
            mapping = mapping[keep]
        t = ref.tensor_idx
        src, dst = self.src_tensors[t], self.dst_tensors[t]
        columns = []
        for col, tensor, within in ((0, src, units.src_units), (1, dst, units.dst_units)):
            page = self._side_pages[t][col]
            per_row = tensor.shape[1] // page
            pages = mapping[:, col]
            offsets = (pages // per_row) * tensor.stride(0) + (pages % per_row) * page
            columns.append((offsets[:, None] // units.unit + within).reshape(-1))
        byte_mapping = torch.from_numpy(np.stack(columns, axis=1))
        return src, dst, units.unit, byte_mapping, page_bytes * mapping.shape[0]

    def shutdown(self) -> None:
        super().shutdown()
        if self._mmap_region is not None:
            # The region's buffer cannot be unmapped while views of it exist: drop this
            # handler's (shared with its peer and CpuGpuOffloadingHandlers) first.
            self.src_tensors.clear()
            self.dst_tensors.clear()
            self._mmap_region.cleanup()
            self._mmap_region = None


class CpuGpuOffloadingHandlers:
    """The two handlers (GPU -> CPU and CPU -> GPU) of a worker's KV cache, and the CPU buffers.

    Per canonical tensor (``[num_gpu_blocks, page_size_bytes]`` pages) one CPU buffer of
    ``torch.uint8``: without ``mmap_region`` a ``[num_cpu_blocks * block_size_factor,
    page_size_bytes]`` tensor (pinned when ``pin_memory``, by default when the KV cache is on
    a CUDA device), CPU block ``c`` holding pages ``c * f .. c * f + f - 1``; with
    ``mmap_region`` (a :class:`SharedOffloadRegion` opened with this worker's rank) the
    region's next view ``[num_cpu_blocks, block_size_factor * page_size_bytes]``, whose rows
    are this worker's cells of the region's interleaved rows (pinned with ``cudaHostRegister``
    when ``pin_memory``). The GPU -> CPU handler owns the region: its :meth:`shutdown` drops
    the views and cleans the region up. A group moves the first ``page_size_bytes`` of each
    page of the tensors its :attr:`kv_cache_groups_data_refs` name, as raw bytes. The CPU
    buffers are not initialised: their bytes mean something only once stored.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        block_size_factor: int,
        num_cpu_blocks: int,
        mmap_region: SharedOffloadRegion | None = None,
        *,
        pin_memory: bool | None = None,
        swap_blocks: SwapBlocksFn | None = None,
        transfer_stream_factory: Callable[[torch.device, str], TransferStream] | None = None,
        wait_for_compute_on_load: bool = False,
        canonical_layout: bool = False,
    ):
        check_worker_inputs(
            kv_caches,
            "block_size_factor",
            block_size_factor,
            "num_cpu_blocks",
            num_cpu_blocks,
            mmap_region,
        )
        self.block_size_factor = block_size_factor
        self.num_cpu_blocks = num_cpu_blocks
        self.kv_cache_groups_data_refs = kv_caches.group_data_refs
        self.gpu_tensors = [
            canonical_page_tensor(t, f"kv_caches.tensors[{i}]")
            for i, t in enumerate(kv_caches.tensors)
        ]
        self.num_gpu_blocks = min(t.shape[0] for t in self.gpu_tensors)
        device = self.gpu_tensors[0].device
        if pin_memory is None:
            pin_memory = device.type == "cuda" and torch.cuda.is_available()
        # Host bytes per GPU block of each tensor: its canonical page, or the worker's own.
        host_pages = (
            canonical_block_sizes(kv_caches.group_data_refs, len(self.gpu_tensors))
            if canonical_layout
            else [t.shape[1] for t in self.gpu_tensors]
        )
        if mmap_region is not None:
            if pin_memory and not mmap_region.is_pinned:
                pin_region(mmap_region)
            next_view = (
                mmap_region.create_next_canonical_view
                if canonical_layout
                else mmap_region.create_next_worker_view
            )
            self.cpu_tensors = [
                next_view(block_size_factor * page).view(torch.uint8) for page in host_pages
            ]
        else:
            self.cpu_tensors = [
                torch.empty(
                    (num_cpu_blocks * block_size_factor, page),
                    dtype=torch.uint8,
                    device="cpu",
                    pin_memory=pin_memory,
                )
                for page in host_pages
            ]
        factory = transfer_stream_factory or make_transfer_stream
        common = dict(
            group_data_refs=kv_caches.group_data_refs,
            swap_blocks=swap_blocks,
            canonical_layout=canonical_layout,
        )
        self.gpu_to_cpu_handler = PageCopyHandler(
            src_tensors=self.gpu_tensors,
            dst_tensors=self.cpu_tensors,
            src_block_size_factor=1,
            dst_block_size_factor=block_size_factor,
            transfer_type=("GPU", "CPU"),
            transfer_stream=factory(device, "kv-offload-gpu-to-cpu"),
            wait_for_compute=True,
            mmap_region=mmap_region,
            **common,  # type: ignore[arg-type]
        )
        self.cpu_to_gpu_handler = PageCopyHandler(
            src_tensors=self.cpu_tensors,
            dst_tensors=self.gpu_tensors,
            src_block_size_factor=block_size_factor,
            dst_block_size_factor=1,
            transfer_type=("CPU", "GPU"),
            transfer_stream=factory(device, "kv-offload-cpu-to-gpu"),
            wait_for_compute=wait_for_compute_on_load,
            # Read-after-write on CPU blocks: a load waits for every earlier unreported store.
            depends_on=self.gpu_to_cpu_handler,
            **common,  # type: ignore[arg-type]
        )

    def shutdown(self) -> None:
        """Wait for jobs in flight and release both handlers' streams (and the region)."""
        self.cpu_to_gpu_handler.shutdown()
        self.gpu_to_cpu_handler.shutdown()
