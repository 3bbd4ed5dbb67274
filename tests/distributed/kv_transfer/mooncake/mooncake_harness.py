"""Test harness for the Mooncake tests: a loopback-only network namespace, a real
``mooncake_master`` and engine "instances" (separate processes driven over pipes).

Network safety: when the machine allows it (root or unprivileged user namespaces), every
process of a test runs in a fresh network namespace whose only interface is ``lo``
(``unshare --net``; processes join it with ``nsenter``), so no byte can leave 127.0.0.1 even
though Mooncake's clients listen on the wildcard address (its handshake and TCP-transport
listeners bind ``0.0.0.0`` / ``::`` unconditionally). Without namespaces the processes run in
the host namespace (also when ``VLLM_KV_TEST_HOST_NETWORK`` is set) with every address set to
127.0.0.1 (master ``--rpc_address``,
``--metrics_host``, ``local_hostname``, ``MC_TCP_BIND_ADDRESS``, P2P handshakes).

Every wait is bounded: start-up, each command, and shutdown have timeouts; processes are
stopped by PID (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import master_binary
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.formats import lookup
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    SlidingWindowSpec,
)

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[3]
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 20.0
COMMAND_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

FORMATS = (
    "bf16",
    "fp8",
    "nvfp4",
    "int8_per_token_head",
    "fp8_per_token_head",
    "hybrid",
    "nvfp4_sinks",
)
"""KV-cache formats the instances build (see :func:`make_kv_cache_config`)."""

ENCODED = {
    "fp8_hadamard": "fp8_e4m3+hadamard",
    "nvfp4_sinks": "nvfp4_mse+offset+prerope+sink",
}
"""Formats whose layers carry an encoding beyond their dtype: ``fp8_hadamard`` has fp8's page
size (other bytes), ``nvfp4_sinks`` a key sink row per page after its K and V rows."""


@dataclass(frozen=True)
class CacheFormat:
    """A KV-cache layout plus what else decides its bytes."""

    kv_cache_config: KVCacheConfig
    kv_cache_dtype: str
    scale_layouts: dict[str, tuple[str, str]]
    kv_scales: dict[str, tuple[float, float]]


def _attention(name: str, num_blocks: int, spec: Any) -> tuple[KVCacheTensor, KVCacheGroupSpec]:
    return (
        KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[name]),
        KVCacheGroupSpec([name], spec),
    )


def _small_attention(mode: KVQuantMode) -> FullAttentionSpec:
    """2 heads × 64, 16-token pages; bf16 elements unquantized, else the format's storage."""
    dtype = torch.bfloat16 if mode == KVQuantMode.NONE else torch.uint8
    if mode == KVQuantMode.INT8_PER_TOKEN_HEAD:
        dtype = lookup("int8_per_token_head").storage_dtype
    return FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=dtype, kv_quant_mode=mode
    )


def make_kv_cache_config(fmt: str, num_blocks: int) -> CacheFormat:
    """A small two/three-buffer KV cache of format ``fmt``.

    ``bf16``, ``fp8`` (e4m3, per-tensor scales), ``nvfp4`` (E2M1 data + e4m3 block scales in
    one page, interleave4 scale layout), ``int8_per_token_head`` and ``fp8_per_token_head``
    (one fp32 scale inline per row): two full-attention layers of 2 heads × 64.
    ``fp8_hadamard`` and ``nvfp4_sinks``: two layers of :data:`ENCODED`'s encodings.
    ``hybrid``: an NVFP4 full-attention layer, a bf16 sliding-window layer of head size 128
    and a Mamba state layer: three buffers with three different page sizes. ``large``: three
    bf16 layers with 2 MiB pages (6 MiB blocks); ``huge``: nine of them (18 MiB blocks, larger
    than the smallest, 16 MiB, segment).
    """
    if fmt in ENCODED:
        encoding = KVCacheEncoding.parse(ENCODED[fmt])
        spec = FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
            kv_quant_mode=encoding.format.quant_mode, encoding=encoding,
        )  # fmt: skip
        parts = [_attention(f"layers.{i}.attn", num_blocks, spec) for i in range(2)]
        dtype, layouts = ENCODED[fmt], {}
        scales = {f"layers.{i}.attn": (0.05 * (i + 1), 0.03 * (i + 1)) for i in range(2)}
    elif fmt == "bf16":
        spec = _small_attention(KVQuantMode.NONE)
        parts = [_attention(f"layers.{i}.attn", num_blocks, spec) for i in range(2)]
        dtype, layouts, scales = "auto", {}, {}
    elif fmt == "fp8":
        spec = _small_attention(KVQuantMode.FP8_PER_TENSOR)
        parts = [_attention(f"layers.{i}.attn", num_blocks, spec) for i in range(2)]
        dtype, layouts = "fp8_e4m3", {}
        scales = {f"layers.{i}.attn": (0.05 * (i + 1), 0.03 * (i + 1)) for i in range(2)}
    elif fmt == "nvfp4":
        spec = _small_attention(KVQuantMode.NVFP4)
        parts = [_attention(f"layers.{i}.attn", num_blocks, spec) for i in range(2)]
        dtype, scales = "nvfp4", {}
        layouts = {f"layers.{i}.attn": ("interleave4", "interleave4") for i in range(2)}
    elif fmt in ("int8_per_token_head", "fp8_per_token_head"):
        spec = _small_attention(lookup(fmt).quant_mode)
        parts = [_attention(f"layers.{i}.attn", num_blocks, spec) for i in range(2)]
        dtype, layouts, scales = fmt, {}, {}
    elif fmt == "hybrid":
        full = _small_attention(KVQuantMode.NVFP4)
        swa = SlidingWindowSpec(
            block_size=16, num_kv_heads=1, head_size=128, dtype=torch.bfloat16, sliding_window=64
        )
        mamba = MambaSpec(
            block_size=16, shapes=((3, 96), (4, 16, 8)), dtypes=(torch.bfloat16, torch.float32)
        )
        parts = [
            _attention("layers.0.attn", num_blocks, full),
            _attention("layers.1.swa", num_blocks, swa),
            _attention("layers.2.mamba", num_blocks, mamba),
        ]
        dtype, scales = "nvfp4", {}
        layouts = {"layers.0.attn": ("interleave4", "interleave4")}
    elif fmt in ("large", "huge"):
        spec = FullAttentionSpec(
            block_size=16, num_kv_heads=128, head_size=256, dtype=torch.bfloat16
        )
        layers = 3 if fmt == "large" else 9
        parts = [_attention(f"layers.{i}.attn", num_blocks, spec) for i in range(layers)]
        dtype, layouts, scales = "auto", {}, {}
    else:
        raise ValueError(
            f"fmt: expected one of {FORMATS}, {tuple(ENCODED)} or 'large', 'huge', got {fmt!r}"
        )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[t for t, _ in parts],
        kv_cache_groups=[g for _, g in parts],
    )
    return CacheFormat(config, dtype, layouts, scales)


# ------------------------------------------------------------------------------ processes


def stop_process(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM ``proc`` (by its PID), SIGKILL it after ``timeout_s``; reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


class Sandbox:
    """Where the test's processes run: a loopback-only network namespace when available."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self._holder: subprocess.Popen | None = None
        tools = all(shutil.which(t) for t in ("unshare", "nsenter", "ip", "ss"))
        if tools and not os.environ.get("VLLM_KV_TEST_HOST_NETWORK"):
            holder = subprocess.Popen(
                ["unshare", "--net", "--", "sh", "-c", "ip link set lo up && exec sleep 600"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and holder.poll() is None:
                if self._lo_is_up(holder.pid):
                    self._holder = holder
                    break
                time.sleep(0.05)
            if self._holder is None:
                stop_process(holder)

    @property
    def isolated(self) -> bool:
        """True when the processes run in a private network namespace with only ``lo``."""
        return self._holder is not None

    @staticmethod
    def _lo_is_up(pid: int) -> bool:
        out = subprocess.run(
            ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "ip", "-o", "link", "show", "lo"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.returncode == 0 and "UP" in out.stdout.split("link/")[0]

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``nsenter`` execs it: the PID is the program's)."""
        if self._holder is None:
            return list(argv)
        return ["nsenter", f"--net=/proc/{self._holder.pid}/ns/net", "--", *argv]

    def run(self, argv: Sequence[str]) -> str:
        """Output of a short command run in the namespace (10 s limit)."""
        return subprocess.run(
            self.command(argv), capture_output=True, text=True, timeout=10, check=True
        ).stdout

    def listening(self, port: int) -> bool:
        """True when something listens on TCP ``port`` of 127.0.0.1 where the processes run."""
        if self._holder is not None:
            return f":{port} " in self.run(["ss", "-Htln", f"sport = :{port}"])
        try:
            with socket.create_connection((LOOPBACK, port), timeout=1):
                return True
        except OSError:
            return False

    def free_port(self) -> int:
        """A TCP port free on 127.0.0.1 where the processes run."""
        if self._holder is None:
            with socket.socket() as s:
                s.bind((LOOPBACK, 0))
                return s.getsockname()[1]
        code = "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])"
        return int(self.run([sys.executable, "-c", code]))

    def close(self) -> None:
        if self._holder is not None:
            stop_process(self._holder)
            self._holder = None


class MooncakeMaster:
    """A ``mooncake_master`` on 127.0.0.1 (RPC and metrics), no HTTP metadata server."""

    def __init__(self, sandbox: Sandbox, log_dir: Path, extra_args: Sequence[str] = ()):
        self.rpc_port = sandbox.free_port()
        self.metrics_port = sandbox.free_port()
        while self.metrics_port == self.rpc_port:
            self.metrics_port = sandbox.free_port()
        self.log_path = log_dir / f"master-{self.rpc_port}.log"
        binary = master_binary()
        assert binary is not None, "mooncake_master is not on PATH"
        argv = [
            binary,
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            *extra_args,
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                sandbox.command(argv), stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        # The log line comes before the RPC port listens: wait for both.
        while not (
            "Master service started" in self.log_path.read_text()
            and sandbox.listening(self.rpc_port)
        ):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start: {self.log_path.read_text()}")
            time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        stop_process(self.proc)


class InstanceError(RuntimeError):
    """A command failed inside an instance (its message is the instance's error)."""


class Instance:
    """An engine instance in its own process (``mooncake_instance.py``), driven by JSON lines."""

    def __init__(self, sandbox: Sandbox, log_dir: Path, name: str):
        self.name = name
        self.log_path = log_dir / f"instance-{name}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(HERE)])
        env["MC_TCP_BIND_ADDRESS"] = LOOPBACK
        env["OMP_NUM_THREADS"] = "1"
        self.region_prefix = f"mooncake_test_{name}_{os.getpid()}_{time.monotonic_ns()}"
        env["VLLM_KV_TEST_REGION_PREFIX"] = self.region_prefix
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                sandbox.command([sys.executable, str(HERE / "mooncake_instance.py")]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=REPO_ROOT,
                env=env,
            )
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        self._buffer = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_line(self, timeout_s: float) -> bytes:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"instance {self.name}: no answer within {timeout_s} s")
            if not self._selector.select(timeout=left):
                continue
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(
                    f"instance {self.name} exited ({self.proc.poll()}): "
                    f"{self.log_path.read_text()[-3000:]}"
                )
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def call(self, cmd: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> Any:
        """Run ``cmd`` in the instance; its result, or :class:`InstanceError`."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self.proc.stdin.flush()
        reply = json.loads(self._read_line(timeout_s))
        if "error" in reply:
            raise InstanceError(reply["error"])
        return reply["result"]

    def kill(self) -> None:
        """SIGKILL (a crashed instance)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def remove_regions(self) -> None:
        """Remove the shared offload regions the instance left (killed, or not closed)."""
        for path in Path("/dev/shm").glob(f"vllm_offload_{self.region_prefix}_*.mmap"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, ValueError):
                self.call("exit", timeout_s=STOP_TIMEOUT_S)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        stop_process(self.proc)
        self._selector.close()
        self.remove_regions()


class CacheHandle:
    """One named cache of an :class:`Instance`: commands go to that cache."""

    def __init__(self, instance: Instance, cache: str):
        self.instance = instance
        self.cache = cache

    def call(self, cmd: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> Any:
        args.setdefault("cache", self.cache)
        return self.instance.call(cmd, timeout_s, **args)

    def kill(self) -> None:
        self.instance.kill()


def block_hashes(prefix: str, n: int) -> list[str]:
    """``n`` distinct hex block hashes (32 bytes each) for a prompt named ``prefix``."""
    import hashlib

    return [hashlib.sha256(f"{prefix}/{i}".encode()).hexdigest() for i in range(n)]


_LOOPBACK = ("127.", "[::1]", "[::ffff:127.")
_WILDCARD = ("*:", "0.0.0.0:", "[::]:")


def assert_loopback_only(sandbox: Sandbox, pids: Sequence[int]) -> None:
    """Every TCP socket of the test's processes is on 127.0.0.1 / ::1 (connections: both
    ends; listeners: loopback or wildcard) and at least one connection exists. In an isolated
    sandbox every socket of the namespace counts, its only interface is ``lo``, and none of
    ``pids`` has a socket in the test's own namespace; on the host network only the sockets
    of ``pids`` count (the machine has other users)."""
    rows = [line.split() for line in sandbox.run(["ss", "-Htanp"]).splitlines()]
    if not sandbox.isolated:
        rows = [f for f in rows if any(f"pid={pid}," in " ".join(f) for pid in pids)]
    sockets = [(f[0], f[3], f[4]) for f in rows if len(f) >= 5]
    assert any(state == "ESTAB" for state, _, _ in sockets), "no connection: proves nothing"
    for state, local, peer in sockets:
        if state == "LISTEN":
            assert local.startswith(_LOOPBACK + _WILDCARD), (state, local, peer)
        else:
            assert local.startswith(_LOOPBACK) and peer.startswith(_LOOPBACK), (state, local, peer)
    if sandbox.isolated:
        interfaces = sandbox.run(["ip", "-o", "link", "show"]).splitlines()
        assert [line.split(":")[1].strip() for line in interfaces] == ["lo"]
        host = subprocess.run(["ss", "-Htanp"], capture_output=True, text=True, timeout=10)
        for pid in pids:
            assert f"pid={pid}," not in host.stdout
