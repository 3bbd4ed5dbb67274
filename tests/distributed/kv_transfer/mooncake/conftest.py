"""Fixtures of the Mooncake tests: a loopback sandbox, a real master, instance processes.

The tests need the optional ``mooncake`` extra; they skip (with the reason) only where it
cannot be imported, i.e. where no wheel exists for this Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mooncake_harness import Instance, MooncakeMaster, Sandbox

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import master_binary

try:
    import mooncake.engine  # noqa: F401
    import mooncake.store  # noqa: F401

    MOONCAKE_MISSING = None if master_binary() else "the wheel has no mooncake_master"
except ImportError as e:
    MOONCAKE_MISSING = f"mooncake-transfer-engine is not installed for this Python ({e})"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_mooncake: runs real Mooncake processes")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if MOONCAKE_MISSING is None:
        return
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here and "needs_mooncake" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=MOONCAKE_MISSING))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """One loopback-only network namespace per test module (see ``mooncake_harness``)."""
    box = Sandbox(tmp_path_factory.mktemp("sandbox"))
    yield box
    box.close()


@pytest.fixture
def master(sandbox: Sandbox, tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A fresh mooncake_master for one test."""
    server = MooncakeMaster(sandbox, tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_master(
    sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MooncakeMaster]:
    """One mooncake_master for the tests of a module that do not break it."""
    server = MooncakeMaster(sandbox, tmp_path_factory.mktemp("master"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_instances(
    sandbox: Sandbox, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Instance, Instance]]:
    """Two instance processes kept for a module (starting one takes seconds)."""
    log_dir = tmp_path_factory.mktemp("instances")
    pair = (Instance(sandbox, log_dir, "a"), Instance(sandbox, log_dir, "b"))
    yield pair
    for instance in pair:
        instance.close()


@pytest.fixture
def spawn(sandbox: Sandbox, tmp_path: Path) -> Iterator[Callable[[str], Instance]]:
    """Start instance processes; every one is stopped (by PID) at the end of the test."""
    started: list[Instance] = []

    def start(name: str) -> Instance:
        instance = Instance(sandbox, tmp_path, name)
        started.append(instance)
        return instance

    yield start
    for instance in reversed(started):
        instance.close()
