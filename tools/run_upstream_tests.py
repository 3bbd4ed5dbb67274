"""Run upstream vLLM's own tests for the modules this library ships against the library.

    python tools/run_upstream_tests.py --sdist PATH/vllm-0.33.0.tar.gz [--json OUT] [-k EXPR]
        [--strict] [FILE ...]

The test tree of the source distribution is unpacked into a temporary directory (outside this
repository, so that upstream's ``vllm/`` never shadows ours) and each test file of
:data:`SUITE` (or each ``FILE`` given, a path under ``tests/``) runs in its own pytest process
with this repository first on ``PYTHONPATH`` and Triton under its interpreter. Upstream's root
``conftest.py`` starts engine machinery this library does not have, so it is replaced by
:data:`ROOT_CONFTEST`, which supplies the few fixtures the suite's files use, and so is the
helper module ``tests/v1/core/utils.py`` by :data:`CORE_UTILS`, its spec factories with
placeholders for its engine helpers (:data:`REPLACED`). Modules of the engine that the
library does not ship (:data:`ENGINE_MODULES`: the scheduler, engine core, model-runner
outputs, the engine's KV connectors) import as placeholders
(:func:`install_engine_placeholders`), so that a file that also imports them collects; a case
that uses one (calls it, reads or sets an attribute, instantiates it) is skipped with the name
it used. The test files are run unchanged. A file that does not collect counts as one error.

The report is a table, one row per file: passed, failed, errors, skipped (upstream's own skips,
CUDA-only cases among them, and with ``-k EXPR`` the cases pytest's ``-k`` deselects are not
counted) and the total; ``--json`` writes the same rows. The exit status is 0 whatever the
counts (this is a measurement), or with ``--strict`` (CI's subset) 1 when any file has a failure
or an error; 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]

SUITE: tuple[str, ...] = (
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_sharing.py",
    "tests/v1/kv_offload/cpu/policies/test_factory.py",
    "tests/v1/kv_offload/cpu/test_canonical_layout.py",
    "tests/v1/kv_offload/cpu/test_capacity.py",
    "tests/v1/kv_offload/cpu/test_gpu_worker.py",
    "tests/v1/kv_offload/cpu/test_manager.py",
    "tests/v1/kv_offload/cpu/test_shared_offload_region.py",
    "tests/v1/kv_offload/cpu/test_swap_blocks_batch.py",
    "tests/v1/kv_offload/cpu/test_swap_blocks_triton.py",
    "tests/v1/kv_offload/test_factory.py",
    "tests/v1/kv_offload/test_file_mapper.py",
    "tests/v1/kv_offload/tiering/test_async_lookup.py",
    "tests/v1/kv_offload/tiering/test_backpressure.py",
    "tests/v1/kv_offload/tiering/test_factory.py",
    "tests/v1/kv_offload/tiering/test_fs_tier.py",
    "tests/v1/kv_offload/tiering/test_metrics.py",
    "tests/v1/kv_offload/tiering/test_tier_poll_thread.py",
    "tests/v1/kv_offload/tiering/test_tiering_offloading.py",
    "tests/v1/kv_offload/tiering/test_kvcr_tier.py",
    "tests/v1/kv_offload/tiering/test_obj_tier.py",
    "tests/v1/kv_offload/tiering/p2p",
    "tests/utils_/test_torch_utils.py",
    "tests/test_triton_utils.py",
    "tests/test_attention_backend_registry.py",
    "tests/config/test_kv_cache_dtype.py",
    "tests/quantization/test_per_token_kv_cache.py",
    "tests/kernels/attention/test_cpu_attn.py",
    "tests/kernels/attention/test_triton_unified_attention.py",
)
"""Upstream test files (or folders) of the modules the library ships at upstream's paths, one
by one where a file that does not collect would stop its folder's run."""

ROOT_CONFTEST = '''"""Upstream's root conftest, replaced by tools/run_upstream_tests.py."""
import pytest
from run_upstream_tests import install_engine_placeholders

install_engine_placeholders()


@pytest.fixture
def caplog_vllm(caplog):
    return caplog


@pytest.fixture
def default_vllm_config():
    # Upstream also makes it the current config; no code here reads a current config.
    from vllm.config import VllmConfig

    yield VllmConfig()
'''

CORE_UTILS = '''"""Upstream's tests/v1/core/utils.py, replaced by tools/run_upstream_tests.py:
its spec factories and planning call (same names, arguments and defaults); its scheduler and
connector helpers, which build the engine, are placeholders (a case calling one is skipped);
its request helper builds the library's requests."""
import torch
from run_upstream_tests import engine_placeholder

create_scheduler = engine_placeholder(__name__, "create_scheduler")
mock_kv = engine_placeholder(__name__, "mock_kv")

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)


def new_kv_cache_spec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                      page_size_padded=None, sliding_window=None, attention_chunk_size=None,
                      kv_quant_mode=KVQuantMode.NONE):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype, page_size_padded=page_size_padded,
                             sliding_window=sliding_window,
                             attention_chunk_size=attention_chunk_size,
                             kv_quant_mode=kv_quant_mode)


def new_sliding_window_spec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                            page_size_padded=None, sliding_window=1):
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype, page_size_padded=page_size_padded,
                             sliding_window=sliding_window)


def new_mamba_spec(block_size=16, shapes=((2, 512), (3, 32, 32)),
                   dtypes=(torch.float32, torch.float32), num_speculative_blocks=2,
                   mamba_cache_mode="none", page_size_padded=None):
    return MambaSpec(block_size=block_size, shapes=shapes, dtypes=dtypes,
                     page_size_padded=page_size_padded, mamba_cache_mode=mamba_cache_mode,
                     num_speculative_blocks=num_speculative_blocks)


def new_mla_spec(cache_dtype_str=None, block_size=16):
    # DeepSeek's latent: kv_lora_rank 512 + qk_rope_head_dim 64.
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1,
                            head_size=576, dtype=torch.float32, cache_dtype_str=cache_dtype_str)


EOS_TOKEN_ID = 50256
_none_hash_initialized = False


def create_requests(num_requests, num_tokens=10, mm_hashes_list=None, mm_positions=None,
                    ignore_eos=False, max_tokens=16, stop_token_ids=None, prompt_logprobs=None,
                    same_prompt=False, block_size=16, req_ids=None):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _none_hash_initialized
    if not _none_hash_initialized:
        init_none_hash(sha256)
        _none_hash_initialized = True
    block_hasher = get_request_block_hasher(block_size, sha256)
    sampling_params = SamplingParams(ignore_eos=ignore_eos, max_tokens=max_tokens,
                                     stop_token_ids=stop_token_ids,
                                     prompt_logprobs=prompt_logprobs)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    if mm_hashes_list is not None:
        assert mm_positions is not None and len(mm_hashes_list) == len(mm_positions)
    req_ids = req_ids or [f"{i}" for i in range(num_requests)]
    assert len(req_ids) == num_requests
    requests = []
    for i in range(num_requests):
        features = [
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(), mm_position=position, modality="image",
                identifier=(mm_hashes_list[i][j] if mm_hashes_list is not None
                            else f"hash{i}_{j}"))
            for j, position in enumerate(mm_positions[i] if mm_positions is not None else [])
        ]
        prompt = [0] * num_tokens if same_prompt else [i] * num_tokens
        requests.append(Request(request_id=req_ids[i], prompt_token_ids=prompt,
                                sampling_params=sampling_params, pooling_params=None,
                                mm_features=features or None, block_hasher=block_hasher))
    return requests


def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
    from vllm.v1.core import kv_cache_planning

    return kv_cache_planning.get_kv_cache_configs(
        vllm_config, kv_cache_specs, available_memory,
        kv_cache_planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs))
'''

REPLACED = {"tests/conftest.py": ROOT_CONFTEST, "tests/v1/core/utils.py": CORE_UTILS}
"""Upstream test-tree files that import the engine, by what replaces them."""

ENGINE_MODULES: tuple[str, ...] = (
    "vllm.v1.core.sched",
    "vllm.v1.engine",
    "vllm.v1.outputs",
    "vllm.v1.structured_output",
    "vllm.v1.worker.gpu_worker",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
)
"""Upstream modules (and their submodules) of the engine, not of the KV-cache subsystem: the
library does not ship them and will not. Only these import as placeholders, and only while the
library has no module of the name (the placeholder finder comes after every other)."""


def _skip_engine(name: str) -> NoReturn:
    import pytest  # the placeholders run inside upstream's tests only

    pytest.skip(f"{name}: part of the vLLM engine, not shipped by vllm-kvcache")


_PROBES = ("__", "_pytest", "_mock_", "_is_coroutine")
"""Prefixes of the attribute names that Python, pytest and unittest.mock (asyncio's coroutine
check among them) look up on any object while collecting or building a mock."""


def _probe(name: str) -> bool:
    """Whether ``name`` is such a probe: answered with AttributeError, not a skip."""
    return name.startswith(_PROBES)


class _EngineClass(type):
    """The type of a placeholder: calling it or reading a class attribute skips the case."""

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        _skip_engine(f"{cls.__module__}.{cls.__qualname__}")

    def __getattr__(cls, name: str) -> Any:
        if _probe(name):
            raise AttributeError(name)
        _skip_engine(f"{cls.__module__}.{cls.__qualname__}.{name}")


class _EngineObject(metaclass=_EngineClass):
    """Base of the placeholders; an instance made by ``object.__new__(placeholder)`` (how some
    tests build a connector without its constructor) skips on any attribute use."""

    def __getattr__(self, name: str) -> Any:
        if _probe(name):
            raise AttributeError(name)
        _skip_engine(f"{type(self).__module__}.{type(self).__qualname__}.{name}")

    def __setattr__(self, name: str, value: object) -> None:
        _skip_engine(f"{type(self).__module__}.{type(self).__qualname__}.{name}")


def engine_placeholder(module: str, name: str) -> type:
    """A placeholder for the engine object ``module.name``: using it skips the case."""
    return _EngineClass(name, (_EngineObject,), {"__module__": module})


class _EngineModule(types.ModuleType):
    """A placeholder module: each public name it is asked for is a placeholder class."""

    def __getattr__(self, name: str) -> type:
        if _probe(name):
            raise AttributeError(name)
        placeholder = engine_placeholder(self.__name__, name)
        setattr(self, name, placeholder)
        return placeholder


class _EngineFinder(MetaPathFinder, Loader):
    """Serves :data:`ENGINE_MODULES` and their submodules, as packages so that any submodule
    of them imports too."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = tuple(modules)

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        if not any(fullname == m or fullname.startswith(m + ".") for m in self.modules):
            return None
        return ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        module = _EngineModule(spec.name, "vLLM engine module (placeholder)")
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # a placeholder module has no code


def install_engine_placeholders(modules: Sequence[str] = ENGINE_MODULES) -> MetaPathFinder:
    """Let ``modules`` (and their submodules) import as placeholders where nothing else on
    ``sys.meta_path`` finds them; returns the finder (remove it from ``sys.meta_path`` to
    undo)."""
    finder = _EngineFinder(modules)
    sys.meta_path.append(finder)
    return finder


TIMEOUT_S = 1800
"""Per test file: a hung file is reported as one error, the run goes on."""


@dataclass(frozen=True)
class Row:
    """One test file's outcome (test counts)."""

    file: str
    passed: int
    failed: int
    errors: int
    skipped: int
    first_problem: str = ""
    """The message of the first failure or error (why a file does not collect, say)."""

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errors + self.skipped


def unpack_tests(sdist: Path, into: Path) -> Path:
    """The sdist's ``tests/`` tree under ``into`` (returned: the directory holding ``tests``),
    with the files of :data:`REPLACED` in place of upstream's."""
    with tarfile.open(sdist) as tar:
        found = 0
        for member in tar.getmembers():
            # An sdist holds one top folder (vllm-X.Y.Z/); its tests/ is the suite.
            parts = member.name.split("/", 1)
            name = parts[1] if len(parts) == 2 and parts[0] != "tests" else member.name
            if not (member.isfile() and name.startswith("tests/")):
                continue
            found += 1
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None  # a regular file
            target.write_bytes(source.read())
    if not found:
        raise ValueError(f"--sdist: expected a source distribution with tests/, got {sdist}")
    for name, text in REPLACED.items():
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_text(text)
    return into


def _counts(junit: Path) -> tuple[int, int, int, int, str]:
    """(passed, failed, errors, skipped, first problem) of a pytest JUnit XML report."""
    suites = ET.parse(junit).getroot()
    totals = [0, 0, 0, 0]  # tests, failures, errors, skipped
    for suite in suites.iter("testsuite"):
        for i, key in enumerate(("tests", "failures", "errors", "skipped")):
            totals[i] += int(suite.get(key, 0))
    problem = next((_message(p) for p in suites.iter() if p.tag in ("failure", "error")), "")
    tests, failed, errors, skipped = totals
    return tests - failed - errors - skipped, failed, errors, skipped, problem


def _message(problem: ET.Element) -> str:
    """A failure's message; for a collection error, the last line of its traceback (the
    exception), since pytest's message then only says that collection failed."""
    lines = [line.strip() for line in (problem.text or "").splitlines() if line.strip()]
    if problem.get("message", "").startswith("collection failure") and lines:
        return lines[-1]
    return problem.get("message", "")


def run_file(root: Path, file: str, keyword: str | None = None) -> Row:
    """Run one upstream test file (or folder) from ``root`` against this repository, only the
    cases that pytest's ``-k keyword`` selects when given."""
    if not (root / file).exists():
        raise ValueError(f"FILE: expected a test file or folder of the sdist, got {file!r}")
    junit = root / f".{file.replace('/', '_')}.xml"
    env = {
        **os.environ,
        # tools/ for the replaced root conftest, which imports this module's placeholders.
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(REPO / "tools"), os.environ.get("PYTHONPATH", "")]
        ),
        "TRITON_INTERPRET": "1",
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", file]
    if keyword is not None:
        command += ["-k", keyword]
    try:
        done = subprocess.run(
            [*command, f"--junitxml={junit}"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Row(file, 0, 0, 1, 0, f"timed out after {TIMEOUT_S} s")
    if not junit.exists():  # pytest stopped before collecting (a conftest that fails to load)
        output = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        errors = [line for line in output if "Error" in line]
        return Row(file, 0, 0, 1, 0, (errors or output or ["pytest wrote no report"])[-1])
    return Row(file, *_counts(junit))


def format_table(rows: list[Row]) -> str:
    """The report: one line per file and a total."""
    header = f"{'upstream test file':<56} {'passed':>6} {'failed':>6} {'errors':>6} {'skipped':>7}"
    lines = [header, "-" * len(header)]
    for row in [*rows, _total(rows)]:
        lines.append(
            f"{row.file:<56} {row.passed:>6} {row.failed:>6} {row.errors:>6} {row.skipped:>7}"
            f"  of {row.total}"
        )
    lines += [f"{row.file}: {row.first_problem[:300]}" for row in rows if row.first_problem]
    return "\n".join(lines)


def _total(rows: list[Row]) -> Row:
    return Row(
        "all",
        sum(r.passed for r in rows),
        sum(r.failed for r in rows),
        sum(r.errors for r in rows),
        sum(r.skipped for r in rows),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, required=True, help="upstream vLLM's .tar.gz")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("-k", dest="keyword", help="only the cases pytest's -k EXPR selects")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when any file has a failure or an error"
    )
    parser.add_argument("files", nargs="*", help="test files under tests/ (default: the suite)")
    args = parser.parse_args(argv)
    if not args.sdist.is_file():
        parser.error(f"--sdist: expected a .tar.gz file, got {str(args.sdist)!r}")
    with tempfile.TemporaryDirectory(prefix="upstream-tests-") as tmp:
        try:
            root = unpack_tests(args.sdist, Path(tmp))
            rows = [run_file(root, file, args.keyword) for file in args.files or SUITE]
        except (ValueError, tarfile.TarError) as exc:
            parser.error(str(exc))
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 1 if args.strict and any(r.failed or r.errors for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
