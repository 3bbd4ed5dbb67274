"""tools/run_upstream_tests.py's engine placeholders: upstream test files that import modules of
the vLLM engine (not shipped by this library) collect, and a case that uses one is skipped."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import MagicMock

import pytest
from _pytest.outcomes import Skipped

from tests.tools.test_run_upstream_tests import FILES, fake_sdist, tool

ENGINE_FILE = (
    "import pytest\n"
    "from vllm.v1.core.sched.scheduler import Scheduler\n"
    "from vllm.v1.outputs import KVConnectorOutput\n"
    "from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (\n"
    "    MultiConnector)\n"
    "from vllm.v1.core.block_pool import BlockPool\n"  # shipped: the real class
    "def test_library_only(): assert BlockPool.__module__ == 'vllm.v1.core.block_pool'\n"
    "def test_instantiates(): Scheduler(None)\n"
    "def test_class_attribute(): Scheduler._get_local_prefix_cache_hit(None, None)\n"
    "def test_bare_instance(): object.__new__(MultiConnector).bound = 1\n"
    "def test_output(): KVConnectorOutput(finished_sending=set())\n"
    "def test_core_helper():\n"
    "    from tests.v1.core.utils import create_scheduler\n"
    "    create_scheduler(enable_prefix_caching=True)\n"
)


@pytest.fixture
def placeholders() -> Iterator[object]:
    """The placeholder finder for the test's duration, with every module it made forgotten."""
    finder = tool.install_engine_placeholders()
    before = set(sys.modules)
    yield finder
    sys.meta_path.remove(finder)
    for name in set(sys.modules) - before:
        if type(sys.modules[name]).__name__ == "_EngineModule":
            del sys.modules[name]


def test_engine_imports_collect_and_their_use_skips(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(FILES, "tests/v1/core/test_engine.py", ENGINE_FILE)
    out = tmp_path / "rows.json"
    args = ["--sdist", str(fake_sdist(tmp_path)), "--json", str(out)]
    assert tool.main([*args, "tests/v1/core/test_engine.py"]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["passed"], row["failed"], row["errors"], row["skipped"]) == (1, 0, 0, 5)


def test_use_skips_with_the_name_used(placeholders) -> None:
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    with pytest.raises(Skipped, match=r"vllm\.v1\.core\.sched\.scheduler\.Scheduler: part of"):
        scheduler.Scheduler()
    with pytest.raises(Skipped, match=r"Scheduler\._mark_prefix_replay: part of the vLLM"):
        scheduler.Scheduler._mark_prefix_replay  # noqa: B018
    instance = object.__new__(scheduler.Scheduler)
    with pytest.raises(Skipped, match=r"Scheduler\.kv_cache_manager: .*not shipped by"):
        instance.kv_cache_manager = None
    with pytest.raises(Skipped, match=r"Scheduler\.schedule: "):
        instance.schedule()


def test_collection_probes_do_not_skip(placeholders) -> None:
    """What Python, pytest and mock look up on every module-level object answers plainly."""
    module = importlib.import_module("vllm.v1.outputs")
    placeholder = module.ModelRunnerOutput
    assert module.ModelRunnerOutput is placeholder  # one placeholder per name
    assert not hasattr(placeholder, "__test__")
    assert not hasattr(placeholder, "_pytestfixturefunction")
    assert not hasattr(module, "__wrapped__")
    assert isinstance(MagicMock(spec=placeholder), placeholder)
    assert (
        importlib.import_module("vllm.v1.outputs.deep.sub").__name__ == "vllm.v1.outputs.deep.sub"
    )


def test_only_modules_the_library_lacks_are_served(placeholders) -> None:
    # The finder comes last: a module the library ships is found by the path finder first,
    # even when listed.
    finder = tool.install_engine_placeholders(("vllm.v1.core",))
    try:
        for name in ("vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_planning"):
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.loader is not finder
    finally:
        sys.meta_path.remove(finder)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("vllm.no_such_engine_module")


def test_engine_modules_are_not_shipped_by_the_library() -> None:
    """Every listed module is engine code the library does not have: a module the library
    ships (or comes to ship) must not stay on the list."""
    for name in tool.ENGINE_MODULES:
        parent = name.rpartition(".")[0]
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # a parent package is missing too
            found = None
        assert found is None, f"{name} is shipped by the library (parent {parent})"
