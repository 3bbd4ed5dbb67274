"""Run upstream vLLM's own tests for the modules this library ships against the library.

    python tools/run_upstream_tests.py --sdist PATH/vllm-0.33.0.tar.gz [--json OUT] [-k EXPR]
        [--strict] [FILE ...]

The test tree of the source distribution is unpacked into a temporary directory (outside this
repository, so that upstream's ``vllm/`` never shadows ours) and each test file of
:data:`SUITE` (or each ``FILE`` given, a path under ``tests/``) runs in its own pytest process
with this repository first on ``PYTHONPATH`` and Triton under its interpreter. Upstream's root
``conftest.py`` starts engine machinery this library does not have, so it is replaced by
:data:`ROOT_CONFTEST`, which supplies the few fixtures the suite's files use, and so is the
helper module ``tests/v1/core/utils.py`` by :data:`CORE_UTILS`, its spec factories without its
engine helpers (:data:`REPLACED`). The test files are run unchanged. A file that does not
collect counts as one error.

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
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

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


@pytest.fixture
def caplog_vllm(caplog):
    return caplog
'''

CORE_UTILS = '''"""Upstream's tests/v1/core/utils.py, replaced by tools/run_upstream_tests.py:
its spec factories and planning call (same names, arguments and defaults); its scheduler,
request and connector helpers, which import the engine, are left out."""
import torch

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


def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
    from vllm.v1.core import kv_cache_planning

    return kv_cache_planning.get_kv_cache_configs(
        vllm_config, kv_cache_specs, available_memory,
        kv_cache_planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs))
'''

REPLACED = {"tests/conftest.py": ROOT_CONFTEST, "tests/v1/core/utils.py": CORE_UTILS}
"""Upstream test-tree files that import the engine, by what replaces them."""

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
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
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
