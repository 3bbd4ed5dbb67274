"""One engine instance of the Mooncake tests, run as its own process.

Reads one JSON command per line on stdin and answers one JSON line on stdout
(``{"result": ...}`` or ``{"error": "..."}``). The instance owns a KV cache of one of the
harness's formats (raw byte buffers, as the worker allocates them) and offloads / loads / sends
its pages through the code under test. Mooncake's own logging goes to stderr (the test's log
file); the protocol has a private copy of the original stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
from mooncake_harness import make_kv_cache_config

from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import MooncakeConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.p2p import (
    MooncakeP2PConnectorWorker,
    P2PAgentMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.mooncake import MooncakeOffloadingSpec
from vllm.v1.kv_offload.worker.mooncake_store import MooncakeLoadStoreSpec
from vllm.v1.kv_offload.worker.page_views import build_kv_cache_page_views

MAX_WAIT_S = 25.0


class Cache:
    """One KV cache of the instance (raw byte buffers, as the worker allocates them)."""

    def __init__(self, fmt: str, num_blocks: int) -> None:
        self.fmt = make_kv_cache_config(fmt, num_blocks)
        config = self.fmt.kv_cache_config
        self.raw = [torch.zeros(t.size, dtype=torch.uint8) for t in config.kv_cache_tensors]
        self.kv_caches = {
            name: raw
            for t, raw in zip(config.kv_cache_tensors, self.raw, strict=True)
            for name in t.shared_by
        }
        self.views = build_kv_cache_page_views(self.kv_caches, config)
        self.worker: OffloadingConnectorWorker | None = None
        self.p2p: Any = None

    def format_options(self, model: str, tp_rank: int) -> dict[str, Any]:
        return {
            "model": model,
            "tp_rank": tp_rank,
            "kv_cache_dtype": self.fmt.kv_cache_dtype,
            "scale_layouts": self.fmt.scale_layouts,
            "kv_scales": self.fmt.kv_scales,
        }

    def close(self, close_clients: bool) -> None:
        if self.worker is not None:
            if close_clients:
                self.worker.shutdown()
            else:
                for handler in self.worker.handlers:
                    handler.wait_all()  # type: ignore[attr-defined]
        if self.p2p is not None and close_clients:
            self.p2p.shutdown()


class InstanceState:
    """The instance's caches by name; every command names the cache it acts on."""

    def __init__(self) -> None:
        self.caches: dict[str, Cache] = {}

    def init_store(
        self,
        cache: str,
        fmt: str,
        num_blocks: int,
        master: str,
        segment_size: int,
        model: str = "test-model",
        tp_rank: int = 0,
        max_blocks_per_batch: int = 64,
        block_size_factor: int = 1,
    ) -> dict[str, Any]:
        entry = self.caches.setdefault(cache, Cache(fmt, num_blocks))
        extra = {
            **entry.format_options(model, tp_rank),
            "block_size_factor": block_size_factor,
            "max_blocks_per_batch": max_blocks_per_batch,
            "mooncake": {
                "master_server_address": master,
                "global_segment_size": segment_size,
                "local_buffer_size": 4 << 20,
                "local_hostname": "127.0.0.1",
            },
        }
        config = entry.fmt.kv_cache_config
        transfer = KVTransferConfig(kv_connector_extra_config=extra)
        spec = MooncakeOffloadingSpec(VllmConfig(kv_transfer_config=transfer), config)
        worker = OffloadingConnectorWorker(spec)
        worker.register_kv_caches(entry.kv_caches, config)
        entry.worker = worker
        return {"fingerprint": spec.page_format().fingerprint, "pid": os.getpid()}

    def init_p2p(
        self,
        cache: str,
        fmt: str,
        num_blocks: int,
        model: str = "test-model",
        tp_rank: int = 0,
        timeout_s: float = 5.0,
    ) -> str:
        entry = self.caches.setdefault(cache, Cache(fmt, num_blocks))
        config = MooncakeConfig(timeout_s=timeout_s)
        p2p = MooncakeP2PConnectorWorker(
            config, f"{cache}@{os.getpid()}", entry.format_options(model, tp_rank)
        )
        p2p.register_kv_caches(entry.kv_caches, entry.fmt.kv_cache_config)
        entry.p2p = p2p
        return p2p.metadata().to_json()

    def expect(self, cache: str, request_id: str, producer: str, blocks: list[int]) -> int:
        p2p = self.caches[cache].p2p
        return p2p.expect_request(request_id, P2PAgentMetadata.from_json(producer), blocks)

    def send(
        self,
        cache: str,
        request_id: str,
        consumer: str,
        slot: int,
        src_blocks: list[int],
        dst_blocks: list[int],
    ) -> None:
        p2p = self.caches[cache].p2p
        meta = P2PAgentMetadata.from_json(consumer)
        p2p.send_blocks(request_id, meta, slot, src_blocks, dst_blocks)

    def wait_p2p(
        self,
        cache: str,
        sent: list[str] = (),  # type: ignore[assignment]
        received: list[str] = (),  # type: ignore[assignment]
        timeout_s: float = MAX_WAIT_S,
    ) -> dict[str, Any]:
        """Poll ``get_finished`` until every named request finished or failed (bounded)."""
        p2p = self.caches[cache].p2p
        done_sent: set[str] = set()
        done_received: set[str] = set()
        failed: dict[str, str] = {}
        failed_blocks: set[int] = set()
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            s, r = p2p.get_finished()
            done_sent |= s or set()
            done_received |= r or set()
            failed.update(p2p.get_failed())
            failed_blocks |= p2p.get_block_ids_with_load_errors()
            if set(sent) <= done_sent | set(failed) and set(received) <= done_received | set(
                failed
            ):
                break
            time.sleep(0.002)
        return {
            "sent": sorted(done_sent),
            "received": sorted(done_received),
            "failed": failed,
            "failed_blocks": sorted(failed_blocks),
            "seconds": time.monotonic() - start,
        }

    def fill(self, cache: str, seed: int, blocks: list[int]) -> list[str]:
        gen = torch.Generator().manual_seed(seed)
        for view in self.caches[cache].views:
            for b in blocks:
                view.pages[b] = torch.randint(
                    0, 256, (view.page_size_bytes,), generator=gen, dtype=torch.uint8
                )
        return self.digest(cache, blocks)

    def digest(self, cache: str, blocks: list[int]) -> list[str]:
        out = []
        for b in blocks:
            h = hashlib.sha256()
            for view in self.caches[cache].views:
                h.update(view.pages[b].numpy().tobytes())
            out.append(h.hexdigest())
        return out

    def digest_all(self, cache: str) -> str:
        h = hashlib.sha256()
        for raw in self.caches[cache].raw:
            h.update(raw.numpy().tobytes())
        return h.hexdigest()

    def _job(self, cache: str, src: Any, dst: Any, timeout_s: float) -> dict[str, Any]:
        worker = self.caches[cache].worker
        assert worker is not None, f"cache {cache}: no store registered"
        start = time.monotonic()
        job_id = worker.transfer_async((src, dst))
        deadline = start + timeout_s
        while time.monotonic() < deadline:
            for result in worker.get_finished():
                if result.job_id == job_id:
                    errors = [h.job_error(job_id) for h in worker.handlers]  # type: ignore[attr-defined]
                    error = next((e for e in errors if e is not None), None)
                    return {
                        "success": result.success,
                        "error": None if error is None else f"{type(error).__name__}: {error}",
                        "bytes": result.transfer_size,
                        "seconds": time.monotonic() - start,
                    }
            time.sleep(0.002)
        raise TimeoutError(f"job {job_id} did not finish within {timeout_s} s")

    def offload(
        self, cache: str, hashes: list[str], blocks: list[int], timeout_s: float = MAX_WAIT_S
    ):
        keys = [bytes.fromhex(h) for h in hashes]
        return self._job(
            cache,
            GPULoadStoreSpec(blocks, [len(blocks)], [0]),
            MooncakeLoadStoreSpec(keys),
            timeout_s,
        )

    def load(self, cache: str, hashes: list[str], blocks: list[int], timeout_s: float = MAX_WAIT_S):
        keys = [bytes.fromhex(h) for h in hashes]
        return self._job(
            cache,
            MooncakeLoadStoreSpec(keys),
            GPULoadStoreSpec(blocks, [len(blocks)], [0]),
            timeout_s,
        )

    def lookup(self, cache: str, hashes: list[str]) -> dict[str, Any]:
        worker = self.caches[cache].worker
        assert worker is not None
        start = time.monotonic()
        count = worker.spec.lookup([bytes.fromhex(h) for h in hashes])  # type: ignore[attr-defined]
        return {"count": count, "seconds": time.monotonic() - start}

    def replace_object(self, cache: str, hash_hex: str, part: str, data_hex: str) -> int:
        """Replace a block's header (``part="header"``) or data with other bytes, as a foreign
        or corrupt writer would; returns the put's status code."""
        worker = self.caches[cache].worker
        assert worker is not None
        pages = worker.spec.handlers.pages  # type: ignore[attr-defined]
        key = pages.header_key(hash_hex) if part == "header" else pages.data_key(hash_hex)
        pages.client.remove([key])
        payload = torch.frombuffer(bytearray(bytes.fromhex(data_hex)), dtype=torch.uint8)
        pages.client.register(payload)
        return pages.client.put_same([key], payload)[0]

    def header_of(self, cache: str) -> str:
        worker = self.caches[cache].worker
        assert worker is not None
        return worker.spec.page_format().header().hex()  # type: ignore[attr-defined]

    def exit(self, close_clients: bool = False) -> None:
        """Stop every cache's handlers; with ``close_clients`` also disconnect from the store
        and the peers (about 2 s per store client: tests that do not check it skip it, the
        process exits either way)."""
        for entry in self.caches.values():
            entry.close(close_clients)


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout (C++ logging) goes to the log
    state = InstanceState()
    for line in sys.stdin:
        request = json.loads(line)
        cmd = request.pop("cmd")
        try:
            result = getattr(state, cmd)(**request)
            reply: dict[str, Any] = {"result": result}
        except Exception as e:  # reported to the test, which decides
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        protocol.write(json.dumps(reply) + "\n")
        if cmd == "exit":
            protocol.flush()
            os._exit(0)  # without close_clients: leave the store clients to the OS


if __name__ == "__main__":
    main()
