"""A checked wrapper of ``mooncake.store.MooncakeDistributedStore``.

Mooncake's calls never raise: they return status codes (negative on failure; ``-704`` is a
missing key) or, for reads, the number of bytes read. This wrapper sets the client up from a
:class:`~.config.MooncakeConfig`, keeps the registered buffers alive, and turns a failed set-up
into an exception; per-key codes are returned for the caller to judge.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import (
    MooncakeConfig,
    import_mooncake,
)

OBJECT_NOT_FOUND = -704
"""Mooncake's status code for a key the master does not know (never put, evicted, or lost)."""

OBJECT_TOO_LARGE = -600
"""Mooncake's status code for a read whose buffers are smaller than the object (nothing
written)."""

RPC_FAILED = -900
"""Mooncake's status code for a call the master did not answer (stopped or unreachable)."""


class MooncakeStoreError(RuntimeError):
    """The store could not be reached or refused an operation."""


def _probe_master(config: MooncakeConfig) -> None:
    """Fail fast when nothing accepts connections at the master's address: Mooncake's set-up
    retries an unreachable master for about 90 s before it gives up."""
    host, _, port = config.master_server_address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=config.timeout_s):
            pass
    except OSError as e:
        raise MooncakeStoreError(
            f"master_server_address: no mooncake_master answers at "
            f"{config.master_server_address} ({e}); start one with mooncake_master "
            "--rpc_address=<ip> --rpc_port=<port> or fix MOONCAKE_MASTER"
        ) from None


class MooncakeStoreClient:
    """One store client: connected to ``config.master_server_address``, lending
    ``config.global_segment_size`` bytes to the pool.

    Buffers passed to :meth:`put_from` / :meth:`get_into` must lie in memory registered with
    :meth:`register` (zero-copy: the transfer engine reads and writes them directly).
    """

    def __init__(self, config: MooncakeConfig):
        if not config.master_server_address:
            raise ValueError(
                "master_server_address: expected 'host:port' of a running mooncake_master "
                "(MOONCAKE_MASTER), got ''"
            )
        store_module = import_mooncake("store")
        _probe_master(config)
        config.apply_environment()
        self.config = config
        self._store = store_module.MooncakeDistributedStore()
        code = self._store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_server_address,
        )
        if code != 0:
            raise MooncakeStoreError(
                f"mooncake store: set-up against master {config.master_server_address} failed "
                f"with code {code} (see the client's log: the segment could not be allocated "
                "or mounted, or the master refused the client)"
            )
        self._registered: list[torch.Tensor] = []
        self._closed = False

    def register(self, tensor: torch.Tensor) -> None:
        """Register ``tensor``'s bytes (contiguous) for zero-copy puts and gets."""
        if not tensor.is_contiguous():
            raise ValueError("tensor: expected a contiguous tensor to register")
        code = self._store.register_buffer(
            tensor.data_ptr(), tensor.numel() * tensor.element_size()
        )
        if code != 0:
            raise MooncakeStoreError(f"mooncake store: register_buffer failed with code {code}")
        self._registered.append(tensor)

    def exists(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 present, 0 absent, negative on error."""
        return list(self._store.batch_is_exist(list(keys))) if keys else []

    def sizes(self, keys: Sequence[str]) -> list[int]:
        """Per key: the object's size in bytes (its first memory replica), or
        :data:`OBJECT_NOT_FOUND` (missing, or the master could not say). One master query."""
        if not keys:
            return []
        replicas = self._store.batch_get_replica_desc(list(keys))
        sizes = []
        for key in keys:
            size = OBJECT_NOT_FOUND
            for replica in replicas.get(key, ()):
                if replica.is_memory_replica():
                    size = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
            sizes.append(size)
        return sizes

    def put_from(
        self, keys: Sequence[str], buffers: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Put object ``keys[i]`` as the concatenation of ``sizes[i][j]`` bytes at addresses
        ``buffers[i][j]``; per key 0 or a negative code."""
        if not keys:
            return []
        return list(
            self._store.batch_put_from_multi_buffers(
                list(keys), [list(b) for b in buffers], [list(s) for s in sizes]
            )
        )

    def get_into(
        self, keys: Sequence[str], buffers: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Scatter object ``keys[i]`` into the given buffers; per key the bytes read or a
        negative code (:data:`OBJECT_TOO_LARGE`: the buffers are smaller than the object)."""
        if not keys:
            return []
        return list(
            self._store.batch_get_into_multi_buffers(
                list(keys), [list(b) for b in buffers], [list(s) for s in sizes]
            )
        )

    def put_same(self, keys: Sequence[str], buffer: torch.Tensor) -> list[int]:
        """Put every key with the bytes of the registered ``buffer`` (e.g. a header)."""
        n = buffer.numel()
        return self.put_from(keys, [[buffer.data_ptr()]] * len(keys), [[n]] * len(keys))

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Remove keys; per key 0 or a negative code."""
        return list(self._store.batch_remove(list(keys))) if keys else []

    def close(self) -> None:
        """Disconnect; objects this client holds in its segment disappear from the store."""
        if not self._closed:
            self._closed = True
            self._store.close()
            self._registered.clear()
