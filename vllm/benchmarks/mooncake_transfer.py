"""Benchmark of KV-page movement through Mooncake on one machine (loopback).

Two processes, as two engine instances: this one (the writer / prefill side) and a child
(the reader / decode side), plus a ``mooncake_master`` on 127.0.0.1 started here (or
``--master host:port``). Measured, per batch of ``--blocks`` offloaded blocks (every layer's
page of each block id):

- store put: cascade jobs of the writer's Mooncake tier, primary (CPU) rows into the store
  (fresh keys every repetition);
- store get: promotion jobs of the reader's Mooncake tier, store objects into its primary rows
  (the header check included);
- batch put / batch get: Mooncake's own batch calls (``batch_put_from_multi_buffers``,
  ``batch_get_into_multi_buffers``) moving the same blocks between the same rows, one call each,
  without the tier (its baseline: ``store put`` / ``store get`` over these is the tier's cost;
  the tier and the call take turns going first);
- P2P: ``send_blocks`` from the writer into the reader's pages until the send is reported;
- memcpy: ``dst.copy_(src)`` of the same number of bytes in one contiguous buffer, in the same
  run (the machine's plain copy speed, the baseline).

Reports pages/s (one page = one layer's page of one block) and GB/s (10^9 bytes/s of page bytes
moved), the median of ``--reps`` repetitions, and × memcpy. Everything listens and connects on
127.0.0.1 (Mooncake's own listeners bind the wildcard address; run under
``unshare --net sh -c 'ip link set lo up && ...'`` to keep them off the network entirely).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import master_binary
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

LOOPBACK = "127.0.0.1"
_WAIT_S = 60.0
_POLL_S = 0.0001
"""How often a tier job's end is polled: a tenth of a millisecond, so that the poll adds little
to the job's time (an engine sees it at its next scheduler step)."""


@dataclass(frozen=True)
class BenchResult:
    """One measured path: medians over the repetitions."""

    path: str
    blocks: int
    pages: int
    bytes: int
    seconds: float

    @property
    def pages_per_s(self) -> float:
        return self.pages / self.seconds

    @property
    def gb_per_s(self) -> float:
        """10^9 bytes of pages per second."""
        return self.bytes / self.seconds / 1e9


def _kv_cache(num_layers: int, num_blocks: int) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """``num_layers`` bf16 layers of 8 heads × 128 and 16-token pages (64 KiB each)."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    names = [f"layers.{i}.attn" for i in range(num_layers)]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(num_blocks * spec.page_size_bytes, [n]) for n in names],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    raw = {
        n: torch.randint(0, 256, (t.size,), dtype=torch.uint8)
        for n, t in zip(names, config.kv_cache_tensors, strict=True)
    }
    return config, raw


class _Side:
    """One instance: its KV cache (the P2P side), primary rows and a Mooncake tier over them
    (the store side)."""

    def __init__(self, master: str, num_layers: int, num_blocks: int, segment: int, name: str):
        from vllm.config import VllmConfig
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import MooncakeConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.p2p import (
            MooncakeP2PConnectorWorker,
        )
        from vllm.v1.kv_offload.tiering.mooncake.manager import MooncakeTierManager
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.config, self.raw = _kv_cache(num_layers, num_blocks)
        options = {"model": "bench", "kv_cache_dtype": "auto"}
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"num_cpu_blocks": num_blocks},
        )
        spec = TieringOffloadingSpec(VllmConfig(kv_transfer_config=transfer), self.config)
        self.rows = torch.randint(
            0, 256, (num_blocks, spec.cpu_page_size_per_worker), dtype=torch.uint8
        )
        self.tier = MooncakeTierManager(
            spec,
            memoryview(self.rows.numpy()),
            "mooncake",
            mooncake={
                "master_server_address": master,
                "global_segment_size": segment,
                "local_hostname": LOOPBACK,
            },
            max_blocks_per_batch=256,
            **options,
        )
        self.p2p = MooncakeP2PConnectorWorker(
            MooncakeConfig(local_hostname=LOOPBACK, timeout_s=_WAIT_S), name, options
        )
        self.p2p.register_kv_caches(self.raw, self.config)
        self._next_job = 0

    def job(self, keys: list[bytes], rows: list[int], promotion: bool) -> float:
        """Seconds of one tier job (cascade, or promotion with ``promotion``)."""
        import numpy as np

        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import JobMetadata

        job = JobMetadata(
            self._next_job,
            [make_offload_key(k, 0) for k in keys],
            np.array(rows, dtype=np.int64),
            promotion,
            ReqContext(req_id="bench"),
        )
        self._next_job += 1
        start = time.perf_counter()
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        while True:
            for result in self.tier.get_finished():
                if result.job_id == job.job_id:
                    if not result.success:
                        error = self.tier.failure(job.keys[0])
                        raise RuntimeError(f"tier job {job.job_id} failed: {error}")
                    return time.perf_counter() - start
            if time.perf_counter() - start > _WAIT_S:
                raise TimeoutError(f"tier job {job.job_id} did not finish in {_WAIT_S} s")
            time.sleep(_POLL_S)

    def batch_call(self, hashes: list[bytes], rows: list[int], put: bool) -> float:
        """Seconds of one Mooncake batch call moving the blocks ``hashes`` (keys of their own)
        between ``rows`` and the store, as the tier's rows do, without the tier."""
        store = self.tier.rows
        size = self.rows.shape[1]
        keys = [f"bench-batch/{h.hex()}" for h in hashes]
        addresses = [[self.rows.data_ptr() + row * size] for row in rows]
        sizes = [[store.page_format.block_bytes]] * len(rows)
        start = time.perf_counter()
        codes = (store.client.put_from if put else store.client.get_into)(keys, addresses, sizes)
        seconds = time.perf_counter() - start
        expected = 0 if put else store.page_format.block_bytes
        if any(code != expected for code in codes):
            raise RuntimeError(f"mooncake batch {'put' if put else 'get'} failed: {set(codes)}")
        return seconds

    def offload(self, hashes: list[bytes], rows: list[int]) -> float:
        return self.job(hashes, rows, promotion=False)

    def load(self, hashes: list[bytes], rows: list[int]) -> float:
        return self.job(hashes, rows, promotion=True)

    def shutdown(self) -> None:
        self.tier.shutdown()
        self.p2p.shutdown()

    def wait_p2p(self, request_id: str, sending: bool) -> None:
        deadline = time.perf_counter() + _WAIT_S
        while time.perf_counter() < deadline:
            sent, received = self.p2p.get_finished()
            failed = self.p2p.get_failed()
            if request_id in failed:
                raise RuntimeError(failed[request_id])
            if request_id in ((sent if sending else received) or ()):
                return
            time.sleep(0.0002)
        raise TimeoutError(f"P2P request {request_id} did not finish in {_WAIT_S} s")


def _reader_main(conn: Any, args: dict[str, Any]) -> None:
    """The child (decode side): answers the parent's commands over a pipe."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.p2p import P2PAgentMetadata

    os.environ["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    side = _Side(**args, name="reader")
    conn.send(side.p2p.metadata().to_json())
    while True:
        cmd, payload = conn.recv()
        if cmd == "load":
            conn.send(side.load(*payload))
        elif cmd == "batch_get":
            conn.send(side.batch_call(*payload, put=False))
        elif cmd == "expect":
            request_id, producer, blocks = payload
            conn.send(
                side.p2p.expect_request(request_id, P2PAgentMetadata.from_json(producer), blocks)
            )
        elif cmd == "wait_recv":
            side.wait_p2p(payload, sending=False)
            conn.send(True)
        else:
            conn.send(None)
            return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _start_master(log_dir: str) -> tuple[subprocess.Popen, str]:
    binary = master_binary()
    if binary is None:
        raise SystemExit("mooncake_master not found: pip install -e '.[mooncake]'")
    port, metrics = _free_port(), _free_port()
    log = open(os.path.join(log_dir, "master.log"), "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [
            binary,
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={metrics}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return proc, f"{LOOPBACK}:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("mooncake_master did not start within 20 s")


def _memcpy_seconds(num_bytes: int, reps: int) -> float:
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(layers: int, blocks: int, reps: int, master: str | None, progress: bool = True):
    """Measure every path; returns the results (memcpy first)."""
    os.environ["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    torch.set_num_threads(1)
    num_blocks = 2 * blocks
    page = 16 * 8 * 256 * 2
    block_bytes = layers * page
    segment = max(64 << 20, 2 * (reps + 1) * blocks * block_bytes)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if progress else (lambda *a: None)
    with tempfile.TemporaryDirectory() as tmp:
        master_proc = None
        if master is None:
            master_proc, master = _start_master(tmp)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        args = {
            "master": master,
            "num_layers": layers,
            "num_blocks": num_blocks,
            "segment": segment,
        }
        reader = ctx.Process(target=_reader_main, args=(child, args), daemon=True)
        reader.start()
        try:
            writer = _Side(**args, name="writer")
            if not parent.poll(_WAIT_S):
                raise TimeoutError("the reader process did not start")
            consumer_meta = parent.recv()
            from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.p2p import (
                P2PAgentMetadata,
            )

            consumer = P2PAgentMetadata.from_json(consumer_meta)
            producer = writer.p2p.metadata().to_json()
            src = list(range(blocks))
            dst = list(range(blocks, 2 * blocks))
            total = blocks * block_bytes
            times: dict[str, list[float]] = {
                "store put": [],
                "batch put": [],
                "store get": [],
                "batch get": [],
                "P2P": [],
            }
            for rep in range(reps + 1):  # the first repetition warms up, not counted
                hashes = [os.urandom(32) for _ in range(blocks)]
                # The tier and the batch call take turns going first (a first mover may pay
                # for the other's warm caches and segments).
                if rep % 2:
                    batch_put = writer.batch_call(hashes, src, put=True)
                    put = writer.offload(hashes, src)
                else:
                    put = writer.offload(hashes, src)
                    batch_put = writer.batch_call(hashes, src, put=True)
                gets = [("load", (hashes, dst)), ("batch_get", (hashes, dst))]
                answers = {}
                for cmd, payload in gets[::-1] if rep % 2 else gets:
                    parent.send((cmd, payload))
                    answers[cmd] = parent.recv()
                get, batch_get = answers["load"], answers["batch_get"]
                request_id = f"bench-{rep}"
                parent.send(("expect", (request_id, producer, dst)))
                slot = parent.recv()
                start = time.perf_counter()
                writer.p2p.send_blocks(request_id, consumer, slot, src, dst)
                writer.wait_p2p(request_id, sending=True)
                p2p = time.perf_counter() - start
                parent.send(("wait_recv", request_id))
                parent.recv()
                if rep:
                    for path, seconds in (
                        ("store put", put),
                        ("batch put", batch_put),
                        ("store get", get),
                        ("batch get", batch_get),
                        ("P2P", p2p),
                    ):
                        times[path].append(seconds)
                log(
                    f"rep {rep}/{reps}{' (warm-up)' if rep == 0 else ''}: put {put * 1e3:.1f} ms "
                    f"(batch call {batch_put * 1e3:.1f}), get {get * 1e3:.1f} ms (batch call "
                    f"{batch_get * 1e3:.1f}), P2P {p2p * 1e3:.1f} ms for {total / 2**20:.0f} MiB"
                )
            memcpy = _memcpy_seconds(total, max(reps, 5))
            pages = blocks * layers
            results = [BenchResult("memcpy", blocks, pages, total, memcpy)]
            results += [
                BenchResult(path, blocks, pages, total, statistics.median(ts))
                for path, ts in times.items()
            ]
            parent.send(("exit", None))
            parent.poll(10) and parent.recv()
            writer.shutdown()
        finally:
            reader.join(timeout=10)
            if reader.is_alive():
                reader.kill()
            if master_proc is not None:
                master_proc.terminate()
                try:
                    master_proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    master_proc.kill()
    return results


BASELINES = {"store put": "batch put", "store get": "batch get"}
"""The tier's paths and the Mooncake batch call each is compared with."""


def versus_batch_call(results: list[BenchResult]) -> dict[str, float]:
    """Per tier path, its speed over that of Mooncake's batch call in the same run (1: the
    tier costs nothing over the call)."""
    by_path = {r.path: r for r in results}
    return {
        path: by_path[base].seconds / by_path[path].seconds
        for path, base in BASELINES.items()
        if path in by_path and base in by_path
    }


def markdown(results: list[BenchResult]) -> str:
    memcpy = results[0]
    ratios = versus_batch_call(results)
    lines = [
        "| path | blocks | pages | MiB | ms (median) | pages/s | GB/s | × memcpy | × batch call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"{ratios[r.path]:.2f}" if r.path in ratios else ""
        lines.append(
            f"| {r.path} | {r.blocks} | {r.pages} | {r.bytes / 2**20:.0f} | "
            f"{r.seconds * 1e3:.2f} | {r.pages_per_s:,.0f} | {r.gb_per_s:.2f} | "
            f"{r.gb_per_s / memcpy.gb_per_s:.3f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="layers (one 64 KiB page each)")
    parser.add_argument("--blocks", type=int, default=32, help="blocks per batch")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (+1 warm-up)")
    parser.add_argument(
        "--master", help="host:port of a running mooncake_master (default: start one on 127.0.0.1)"
    )
    parser.add_argument("--json", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    for name in ("layers", "blocks", "reps"):
        if getattr(args, name) <= 0:
            print(f"--{name}: expected a positive int, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        print(f"mooncake: not installed ({e}); pip install -e '.[mooncake]'", file=sys.stderr)
        return 2
    results = run(args.layers, args.blocks, args.reps, args.master)
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {
                        **asdict(r),
                        "pages_per_s": r.pages_per_s,
                        "gb_per_s": r.gb_per_s,
                        "vs_batch_call": versus_batch_call(results).get(r.path),
                    }
                    for r in results
                ],
                f,
                indent=2,
            )
    return 0
