"""CPU <-> GPU transfer handlers for KV-cache pages.

Every job copies whole pages of every registered KV-cache buffer with
``vllm._custom_ops.swap_blocks(src, dst, page_size_bytes, block_mapping)``; pages are moved as
raw bytes, so quantized pages (FP8 / NVFP4 data and their scales) survive bit for bit.

Ordering contract.

- Per handler (per direction): jobs run in submission order and
  :meth:`SingleDirectionOffloadingHandler.get_finished` reports them in submission order — a job
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
    CanonicalKVCaches,
    GPULoadStoreSpec,
    TransferSpec,
    TransferType,
)
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


def expand_block_ids(
    block_ids: np.ndarray, block_size_factor: int, output: np.ndarray, skip_count: int = 0
) -> None:
    """Write the page ids of ``block_ids`` into ``output``.

    Block ``b`` covers pages ``b * f .. b * f + f - 1`` (``f = block_size_factor``). The first
    ``skip_count`` pages of the first block are left out, so ``output`` must have
    ``len(block_ids) * f - skip_count`` entries.
    """
    pages = (block_ids[:, None] * block_size_factor + np.arange(block_size_factor)).reshape(-1)
    output[:] = pages[skip_count:]


class SingleDirectionOffloadingHandler(StreamOffloadingHandler):
    """Copies pages from ``src_tensors`` to ``dst_tensors`` (one direction), in order.

    ``src_tensors[i]`` and ``dst_tensors[i]`` are ``torch.uint8`` page tensors
    ``[num_pages, page_size_bytes]`` of the same page size. A block of the source spec covers
    ``src_block_size_factor`` pages, a block of the destination ``dst_block_size_factor``
    pages; how a job's block ids split into groups and pages is
    :meth:`build_block_mappings`. ``group_tensor_indices``: per KV-cache group, the tensors
    its blocks live in (default: one group using every tensor).

    ``depends_on``: another handler whose earlier jobs this handler's jobs wait for — every job
    of it submitted before and not yet reported (see the module's ordering contract).
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
        self.page_sizes_bytes: list[int] = []
        for i, (src, dst) in enumerate(zip(src_tensors, dst_tensors, strict=True)):
            for side, t in (("src", src), ("dst", dst)):
                if t.dtype != torch.uint8 or t.dim() != 2 or t.stride() != (t.shape[1], 1):
                    raise ValueError(
                        f"{side}_tensors[{i}]: expected a dense torch.uint8 "
                        f"[num_pages, page_size_bytes] tensor, got {t.dtype} of shape "
                        f"{tuple(t.shape)} and strides {t.stride()}"
                    )
            if src.shape[1] != dst.shape[1]:
                raise ValueError(
                    f"dst_tensors[{i}]: page size {dst.shape[1]} bytes differs from the "
                    f"source's {src.shape[1]} bytes"
                )
            self.page_sizes_bytes.append(src.shape[1])
        self.src_tensors = list(src_tensors)
        self.dst_tensors = list(dst_tensors)
        self.src_block_size_factor = src_block_size_factor
        self.dst_block_size_factor = dst_block_size_factor
        self.num_src_blocks = min(t.shape[0] for t in src_tensors) // src_block_size_factor
        self.num_dst_blocks = min(t.shape[0] for t in dst_tensors) // dst_block_size_factor
        super().__init__(transfer_type, transfer_stream, wait_for_compute, depends_on)
        self._swap_blocks = swap_blocks
        # Per KV-cache group, the tensors its blocks live in (default: one group, all).
        self.group_tensor_indices: list[list[int]] = [
            list(g) for g in (group_tensor_indices or [range(len(self.src_tensors))])
        ]

    def _check_ids(self, name: str, ids: np.ndarray, num_blocks: int) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            bad = ids[(ids < 0) | (ids >= num_blocks)]
            raise ValueError(
                f"spec: {name} block ids must be in [0, {num_blocks}), got {bad.tolist()}"
            )

    def build_block_mappings(self, spec: TransferSpec) -> list[tuple[Sequence[int], torch.Tensor]]:
        """Per KV-cache group: its tensors' indices and the int64 CPU ``[n, 2]`` (source page,
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
        if len(gpu_spec.group_sizes) != len(self.group_tensor_indices):
            raise ValueError(
                f"spec: group_sizes has {len(gpu_spec.group_sizes)} entries for "
                f"{len(self.group_tensor_indices)} KV-cache groups"
            )
        src_ids, dst_ids = src_spec.block_ids, dst_spec.block_ids
        self._check_ids(f"{self.transfer_type[0]} (source)", src_ids, self.num_src_blocks)
        self._check_ids(f"{self.transfer_type[1]} (destination)", dst_ids, self.num_dst_blocks)
        mappings: list[tuple[Sequence[int], torch.Tensor]] = []
        offsets = [0, 0]
        for size, index, tensors in zip(
            gpu_spec.group_sizes, gpu_spec.block_indices, self.group_tensor_indices, strict=True
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
            mappings.append((tensors, torch.from_numpy(mapping)))
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
        copies = [
            (self.src_tensors[t], self.dst_tensors[t], self.page_sizes_bytes[t], mapping)
            for tensors, mapping in mappings
            for t in tensors
        ]

        def copy_pages() -> None:
            for src, dst, page_size, mapping in copies:
                swap_blocks(src, dst, page_size, mapping)

        num_bytes = sum(page_size * m.shape[0] for _, _, page_size, m in copies)
        return self.submit_job(job_id, copy_pages, num_bytes)


class CpuGpuOffloadingHandlers:
    """The two handlers (GPU -> CPU and CPU -> GPU) of a worker's KV cache, and the CPU buffers.

    Per canonical tensor (``[num_gpu_blocks, page_size_bytes]`` pages) one CPU buffer
    ``[num_cpu_blocks, block_size_factor * page_size_bytes]`` of ``torch.uint8`` (pinned when
    ``pin_memory``, by default when the KV cache is on a CUDA device): CPU block ``c`` holds
    ``block_size_factor`` consecutive GPU pages of the tensor. Whole pages (padding
    included) move as raw bytes; a group's jobs touch only the tensors of its
    ``group_data_refs``. The CPU buffers are ``torch.empty``: their bytes mean something
    only once stored.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        block_size_factor: int,
        num_cpu_blocks: int,
        *,
        pin_memory: bool | None = None,
        swap_blocks: SwapBlocksFn | None = None,
        transfer_stream_factory: Callable[[torch.device, str], TransferStream] | None = None,
        wait_for_compute_on_load: bool = False,
    ):
        check_positive_int("block_size_factor", block_size_factor)
        check_positive_int("num_cpu_blocks", num_cpu_blocks)
        if not kv_caches.tensors:
            raise ValueError("kv_caches: expected at least one KV-cache tensor")
        self.block_size_factor = block_size_factor
        self.num_cpu_blocks = num_cpu_blocks
        self.gpu_tensors = [
            canonical_page_tensor(t, f"kv_caches.tensors[{i}]")
            for i, t in enumerate(kv_caches.tensors)
        ]
        self.num_gpu_blocks = min(t.shape[0] for t in self.gpu_tensors)
        device = self.gpu_tensors[0].device
        if pin_memory is None:
            pin_memory = device.type == "cuda" and torch.cuda.is_available()
        self.cpu_tensors = [
            torch.empty(
                (num_cpu_blocks * block_size_factor, t.shape[1]),
                dtype=torch.uint8,
                device="cpu",
                pin_memory=pin_memory,
            )
            for t in self.gpu_tensors
        ]
        groups = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        factory = transfer_stream_factory or make_transfer_stream
        common = dict(group_tensor_indices=groups, swap_blocks=swap_blocks)
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            src_tensors=self.gpu_tensors,
            dst_tensors=self.cpu_tensors,
            src_block_size_factor=1,
            dst_block_size_factor=block_size_factor,
            transfer_type=("GPU", "CPU"),
            transfer_stream=factory(device, "kv-offload-gpu-to-cpu"),
            wait_for_compute=True,
            **common,  # type: ignore[arg-type]
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
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
        """Wait for jobs in flight and release both handlers' streams."""
        self.gpu_to_cpu_handler.shutdown()
        self.cpu_to_gpu_handler.shutdown()
