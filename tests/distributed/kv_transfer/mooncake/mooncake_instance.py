"""One engine instance of the Mooncake tests, run as its own process.

Reads one JSON command per line on stdin and answers one JSON line on stdout
(``{"result": ...}`` or ``{"error": "..."}``). The instance owns KV caches of the harness's
formats (raw byte buffers, as the worker allocates them) and moves their pages through the
code under test, as an engine does: the store tier is a ``TieringOffloadingSpec`` whose CPU
primary tier (a shared offload region of the instance) cascades into a ``"mooncake"``
secondary tier; the scheduler side (the tiering manager) and the worker side (the offloading
connector worker) both run here. Mooncake's own logging goes to stderr (the test's log file);
the protocol has a private copy of the original stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
import uuid
from typing import Any

import torch
from mooncake_harness import make_kv_cache_config

from vllm import _custom_ops as ops
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
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.mooncake.blocks import offload_key_name
from vllm.v1.kv_offload.tiering.mooncake.manager import MooncakeTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.kv_offload.worker.page_views import build_kv_cache_page_views

MAX_WAIT_S = 25.0
REGION_PREFIX = os.environ.get("VLLM_KV_TEST_REGION_PREFIX", f"mooncake_test_{os.getpid()}")
"""Start of the instance ids of this process's shared offload regions
(``/dev/shm/vllm_offload_<id>.mmap``): the harness removes what a killed instance leaves."""


def keys_of(hashes: list[str]) -> list[OffloadKey]:
    return [make_offload_key(bytes.fromhex(h), 0) for h in hashes]


class Store:
    """A cache's offloading as an engine runs it: the tiering manager (scheduler side) over
    the CPU primary tier and the Mooncake tier, and the worker's CPU <-> GPU handlers."""

    def __init__(self, spec: TieringOffloadingSpec, kv_caches: dict[str, torch.Tensor]):
        self.spec = spec
        manager = spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, MooncakeTierManager)
        self.tier = tier
        self.worker = OffloadingConnectorWorker(spec)
        try:
            self.worker.register_kv_caches(kv_caches, spec.kv_cache_config)
        except BaseException:
            manager.shutdown()
            raise
        self.context = ReqContext(req_id="instance")

    def worker_job(self, job_id: int, deadline: float) -> bool:
        while time.monotonic() < deadline:
            for result in self.worker.get_finished():
                if result.job_id == job_id:
                    return result.success
            time.sleep(0.002)
        raise TimeoutError(f"worker job {job_id} did not finish in time")

    def settle(self, deadline: float) -> None:
        """Run engine steps until the tier has no job in flight."""
        while True:
            list(self.manager.take_events())
            if self.tier.jobs_in_flight == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the Mooncake tier's jobs did not finish in time")
            time.sleep(0.002)

    def error_of(self, keys: list[OffloadKey]) -> str | None:
        for key in keys:
            error = self.tier.failure(key)
            if error is not None:
                return f"{type(error).__name__}: {error}"
        return None

    def close(self, close_clients: bool) -> None:
        self.worker.shutdown()
        if close_clients:
            self.manager.shutdown()
        else:  # leave the store client to the OS; the region file goes now
            region = f"/dev/shm/vllm_offload_{self.spec.vllm_config.instance_id}.mmap"
            if os.path.exists(region):
                os.unlink(region)


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
        self.store: Store | None = None
        self.p2p: Any = None

    def format_options(self, model: str, tp_rank: int | None = None) -> dict[str, Any]:
        options = {
            "model": model,
            "kv_cache_dtype": self.fmt.kv_cache_dtype,
            "scale_layouts": self.fmt.scale_layouts,
            "kv_scales": self.fmt.kv_scales,
        }
        return options if tp_rank is None else {**options, "tp_rank": tp_rank}

    def close(self, close_clients: bool) -> None:
        if self.store is not None:
            self.store.close(close_clients)
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
        max_blocks_per_batch: int = 64,
        block_size_factor: int = 1,
        layout: str = "NHD",
    ) -> dict[str, Any]:
        """Offloading for ``cache``: a CPU primary tier of ``num_blocks`` offloaded blocks and
        a Mooncake tier at ``master`` lending ``segment_size`` bytes, for pages in ``layout``
        order."""
        entry = self.caches.setdefault(cache, Cache(fmt, num_blocks))
        if entry.store is not None:
            raise RuntimeError(f"init_store: cache {cache!r} has a store already")
        tier = {
            "type": "mooncake",
            **entry.format_options(model),
            "kv_cache_layout": layout,
            "max_blocks_per_batch": max_blocks_per_batch,
            "retry_after_s": 2.0,
            "mooncake": {
                "master_server_address": master,
                "global_segment_size": segment_size,
                "local_buffer_size": 4 << 20,
                "local_hostname": "127.0.0.1",
            },
        }
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "num_cpu_blocks": num_blocks,
            "block_size_factor": block_size_factor,
            "secondary_tiers": [tier],
        }
        engine = VllmConfig(
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
            instance_id=f"{REGION_PREFIX}_{uuid.uuid4().hex[:8]}",
        )
        spec = TieringOffloadingSpec(engine, entry.fmt.kv_cache_config, swap_blocks=ops.swap_blocks)
        entry.store = Store(spec, entry.kv_caches)
        return {"fingerprint": entry.store.tier.page_format.fingerprint, "pid": os.getpid()}

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

    def offload(
        self, cache: str, hashes: list[str], blocks: list[int], timeout_s: float = MAX_WAIT_S
    ) -> dict[str, Any]:
        """Offload GPU ``blocks`` as blocks ``hashes``: prepare the store, copy GPU -> CPU,
        complete it (the cascade into the Mooncake tier starts), and run engine steps until
        the tier is done. Success: every key is in the primary tier and its cascade put it."""
        store = self.caches[cache].store
        assert store is not None, f"cache {cache}: no store registered"
        keys = keys_of(hashes)
        start = time.monotonic()
        deadline = start + timeout_s
        out = store.manager.prepare_store(keys, store.context)
        if out is None:
            return {"success": False, "error": "the primary tier has no room"}
        rows = [int(b) for b in out.store_spec.block_ids]
        if len(out.keys_to_store) != len(keys):
            raise RuntimeError(f"offload: {len(keys) - len(out.keys_to_store)} keys held already")
        ok = store.worker_job(store.worker.store(blocks, rows), deadline)
        store.manager.complete_store(keys, store.context, ok)
        store.settle(deadline)
        error = None if ok else "the GPU -> CPU copy failed"
        error = error or store.error_of(keys)
        return {"success": error is None, "error": error, "seconds": time.monotonic() - start}

    def load(
        self, cache: str, hashes: list[str], blocks: list[int], timeout_s: float = MAX_WAIT_S
    ) -> dict[str, Any]:
        """Load blocks ``hashes`` into GPU ``blocks`` as an engine does: look every key up
        (promoting it from the Mooncake tier into the primary tier), step until each is ready
        or missing; only when all are ready, copy CPU -> GPU. A missing key fails the load
        before any GPU page is written."""
        store = self.caches[cache].store
        assert store is not None, f"cache {cache}: no store registered"
        keys = keys_of(hashes)
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            found = [store.manager.lookup(key, store.context) for key in keys]
            list(store.manager.take_events())  # end of step: promotions are submitted
            missing = [k for k, f in zip(keys, found, strict=True) if f is LookupResult.MISS]
            if missing:
                error = store.error_of(missing)
                name = offload_key_name(missing[0])
                error = error or f"miss: {len(missing)} blocks in no tier, first {name}"
                return {"success": False, "error": error, "seconds": time.monotonic() - start}
            if all(f is LookupResult.HIT for f in found):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("load: the keys' promotions did not finish in time")
            time.sleep(0.002)
        spec = store.manager.prepare_load(keys, store.context)
        try:
            rows = [int(b) for b in spec.block_ids]
            ok = store.worker_job(store.worker.load(rows, blocks), deadline)
        finally:
            store.manager.complete_load(keys, store.context)
        error = None if ok else "the CPU -> GPU copy failed (see the instance log)"
        return {"success": ok, "error": error, "seconds": time.monotonic() - start}

    def lookup(self, cache: str, hashes: list[str]) -> dict[str, Any]:
        """How many leading blocks of ``hashes`` the Mooncake tier holds."""
        store = self.caches[cache].store
        assert store is not None
        start = time.monotonic()
        count = 0
        for key in keys_of(hashes):
            if store.tier.lookup(key, store.context) is not LookupResult.HIT:
                break
            count += 1
        return {"count": count, "seconds": time.monotonic() - start}

    def replace_object(self, cache: str, hash_hex: str, part: str, data_hex: str) -> int:
        """Replace a block's object, as a foreign or corrupt writer would: with ``data_hex`` as
        its header and zeros as its block (``part="header"``: an object of the right size),
        or with ``data_hex`` alone; returns the put's status code."""
        store = self.caches[cache].store
        assert store is not None
        rows = store.tier.rows
        key = rows.key(offload_key_name(keys_of([hash_hex])[0]))
        payload = bytes.fromhex(data_hex)
        if part == "header":
            payload = payload.ljust(rows.object_bytes, b"\0")
        rows.client.remove([key])
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows.client.register(buffer)
        return rows.client.put_from([key], [[buffer.data_ptr()]], [[buffer.numel()]])[0]

    def header_of(self, cache: str) -> str:
        store = self.caches[cache].store
        assert store is not None
        return store.tier.page_format.header().hex()

    def exit(self, close_clients: bool = False) -> None:
        """Stop every cache's handlers and remove its offload region; with ``close_clients``
        also disconnect from the store and the peers (about 2 s per store client: tests that
        do not check it skip it, the process exits either way)."""
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
