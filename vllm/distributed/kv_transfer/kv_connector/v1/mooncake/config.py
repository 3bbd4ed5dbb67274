"""Connection settings of a Mooncake client (store or transfer engine).

Values come from, in order of precedence: keyword overrides, a mapping (upstream's
``kv_connector_extra_config``), then the environment variables that Mooncake's own config
loader reads (``MOONCAKE_MASTER``, ``MOONCAKE_LOCAL_HOSTNAME``, ``MOONCAKE_TE_META_DATA_SERVER``,
``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE``,
``MOONCAKE_LOCAL_BUFFER_SIZE``) plus ``MC_TCP_BIND_ADDRESS`` (the transfer engine's data-path
address).
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import ModuleType
from typing import Any

ENV_VARS: dict[str, str] = {
    "master_server_address": "MOONCAKE_MASTER",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
    "bind_address": "MC_TCP_BIND_ADDRESS",
}
"""Environment variable of each :class:`MooncakeConfig` field."""

MIN_SEGMENT_BYTES = 16 << 20
"""Smallest global segment Mooncake can mount (one 16 MiB slab of its allocator)."""

PROTOCOLS = ("tcp", "rdma")
"""Transfer protocols this project runs (``tcp`` everywhere, ``rdma`` with RDMA NICs)."""

P2P_HANDSHAKE = "P2PHANDSHAKE"
"""Metadata-server value for peer-to-peer handshakes (no metadata server process)."""

_SIZE_SUFFIXES = (
    ("gib", 1 << 30),
    ("gb", 1 << 30),
    ("mib", 1 << 20),
    ("mb", 1 << 20),
    ("kib", 1 << 10),
    ("kb", 1 << 10),
    ("b", 1),
)

INSTALL_HINT = (
    "install the optional extra (pip install -e '.[mooncake]', wheel "
    "mooncake-transfer-engine-non-cuda on CPU machines) and its system libraries "
    "(apt-get install -y libibverbs1 librdmacm1 libnuma1)"
)


def import_mooncake(module: str) -> ModuleType:
    """``mooncake.<module>`` (``store`` or ``engine``), or ``ImportError`` saying how to install."""
    try:
        return importlib.import_module(f"mooncake.{module}")
    except ImportError as e:
        raise ImportError(
            f"mooncake.{module} could not be imported on Python "
            f"{sys.version_info.major}.{sys.version_info.minor} ({e}); {INSTALL_HINT}"
        ) from e


def master_binary() -> str | None:
    """Path of the ``mooncake_master`` executable shipped in the wheel (None without one).

    The wheel's binary itself, not a console-script or version-manager shim in front of it, so
    that the PID of the started process is the master's.
    """
    try:
        import mooncake
    except ImportError:
        return shutil.which("mooncake_master")
    path = os.path.join(os.path.dirname(os.path.abspath(mooncake.__file__)), "mooncake_master")
    return path if os.access(path, os.X_OK) else shutil.which("mooncake_master")


def parse_size_bytes(name: str, value: int | str) -> int:
    """A positive byte count from an int or a string such as ``"512MB"`` or ``"1GiB"``."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a positive byte count, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        text = value.strip().lower()
        multiplier = 1
        for suffix, mult in _SIZE_SUFFIXES:
            if text.endswith(suffix):
                text, multiplier = text[: -len(suffix)].strip(), mult
                break
        try:
            number = int(float(text) * multiplier)
        except ValueError:
            raise ValueError(
                f"{name}: expected a byte count such as 67108864 or '64MB', got {value!r}"
            ) from None
    else:
        raise ValueError(f"{name}: expected a byte count, got {type(value).__name__}")
    if number <= 0:
        raise ValueError(f"{name}: expected a positive byte count, got {value!r}")
    return number


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _check_host_port(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}: expected 'host:port' with a port in 1..65535, got {value!r}")


@dataclass(frozen=True)
class MooncakeConfig:
    """Where a Mooncake client connects and how much memory it lends.

    ``master_server_address``: ``host:port`` of ``mooncake_master`` (store only).
    ``local_hostname``: the address peers reach this client at (an IP of this machine).
    ``metadata_server``: ``P2PHANDSHAKE`` (peers exchange segment metadata directly; no
    metadata server to run) or an etcd/HTTP metadata URL. ``protocol``: ``tcp`` or ``rdma``;
    ``device_name``: RDMA devices (empty for tcp). ``global_segment_size``: bytes this client
    contributes to the store's pool (objects put by any client may live there);
    ``local_buffer_size``: bytes of the client's transfer buffer. ``bind_address``: the
    address the TCP data path advertises and connects from (``MC_TCP_BIND_ADDRESS``; defaults
    to ``local_hostname``). ``timeout_s``: bound in seconds on waits for peers (P2P
    completion, store retries).
    """

    master_server_address: str = ""
    local_hostname: str = "127.0.0.1"
    metadata_server: str = P2P_HANDSHAKE
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 64 << 20
    local_buffer_size: int = 16 << 20
    bind_address: str = ""
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.master_server_address:
            _check_host_port("master_server_address", self.master_server_address)
        host = self.local_hostname
        if not host or (":" in host and not _is_ip_address(host)):
            raise ValueError(
                f"local_hostname: expected a host name or IP address without a port, got {host!r}"
            )
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: expected one of {PROTOCOLS}, got {self.protocol!r}")
        if self.protocol == "tcp" and self.device_name:
            raise ValueError(
                f"device_name: expected '' with protocol 'tcp' (RDMA devices only), got "
                f"{self.device_name!r}"
            )
        for name in ("global_segment_size", "local_buffer_size"):
            object.__setattr__(self, name, parse_size_bytes(name, getattr(self, name)))
        if self.global_segment_size < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"global_segment_size: expected at least {MIN_SEGMENT_BYTES} bytes (16 MiB, "
                f"Mooncake's slab size), got {self.global_segment_size}"
            )
        if not self.bind_address:
            object.__setattr__(self, "bind_address", self.local_hostname)
        if not _is_ip_address(self.bind_address):
            raise ValueError(
                f"bind_address: expected an IP address of this machine (MC_TCP_BIND_ADDRESS), "
                f"got {self.bind_address!r}"
            )
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= 3600):
            raise ValueError(f"timeout_s: expected seconds in (0, 3600], got {self.timeout_s!r}")

    @classmethod
    def from_mapping(
        cls,
        values: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> MooncakeConfig:
        """The config from ``overrides``, then ``values``, then ``env`` (default
        ``os.environ``), then the defaults. Unknown keys of ``values`` raise ``ValueError``."""
        env = os.environ if env is None else env
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"mooncake config: unknown keys {unknown}; expected {sorted(known)}")
        settings: dict[str, Any] = {}
        for name, var in ENV_VARS.items():
            if var in env and env[var] != "":
                settings[name] = env[var]
        settings.update(values)
        settings.update(overrides)
        if "timeout_s" in settings:
            settings["timeout_s"] = float(settings["timeout_s"])
        return cls(**settings)

    def with_overrides(self, **changes: Any) -> MooncakeConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def apply_environment(self) -> None:
        """Export ``MC_TCP_BIND_ADDRESS`` before a transfer engine starts in this process (the
        engine reads it at set-up to choose the address its data path uses)."""
        os.environ["MC_TCP_BIND_ADDRESS"] = self.bind_address
