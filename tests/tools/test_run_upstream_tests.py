"""tools/run_upstream_tests.py on a small fake source distribution: its counts per file, the
first problem of a file that does not collect, the replaced root conftest, bad arguments."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "run_upstream_tests.py"
_spec = importlib.util.spec_from_file_location("run_upstream_tests", TOOL)
assert _spec is not None and _spec.loader is not None
tool = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tool  # dataclasses look their module up while the class is built
_spec.loader.exec_module(tool)

FILES = {
    # Upstream's root conftest needs the engine: the tool must not run it.
    "tests/conftest.py": "raise RuntimeError('the engine-wide conftest ran')\n",
    "tests/test_mixed.py": (
        "import pytest\n"
        "def test_pass(caplog_vllm): assert caplog_vllm is not None\n"
        "def test_fail(): assert False, 'on purpose'\n"
        "@pytest.mark.skip(reason='needs a GPU')\n"
        "def test_skip(): pass\n"
        "import vllm.utils.math_utils\n"  # the library under test is importable
    ),
    "tests/sub/test_missing.py": "from vllm.no_such_module import nothing\n",
    # Upstream's core test helper imports the engine: the tool replaces it.
    "tests/v1/core/utils.py": "raise RuntimeError('the engine-importing helper ran')\n",
    "tests/v1/core/test_specs.py": (
        "from tests.v1.core.utils import new_kv_cache_spec, new_mla_spec\n"
        "def test_factories(): assert new_kv_cache_spec().block_size == 16\n"
    ),
    # A folder whose conftest does not load: pytest stops before writing a report.
    "tests/broken/conftest.py": "from vllm.no_such_config import nothing\n",
    "tests/broken/test_fine.py": "def test_fine(): pass\n",
    "vllm/__init__.py": "raise RuntimeError('upstream vllm shadowed ours')\n",
}


def fake_sdist(tmp_path: Path) -> Path:
    path = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_counts_per_file_and_first_problems(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    args = ["--sdist", str(fake_sdist(tmp_path)), "--json", str(out)]
    files = ["tests/test_mixed.py", "tests/sub", "tests/broken", "tests/v1/core/test_specs.py"]
    assert tool.main([*args, *files]) == 0
    rows = {row["file"]: row for row in json.loads(out.read_text())}
    mixed, missing = rows["tests/test_mixed.py"], rows["tests/sub"]
    assert (mixed["passed"], mixed["failed"], mixed["errors"], mixed["skipped"]) == (1, 1, 0, 1)
    assert "on purpose" in mixed["first_problem"]
    assert (missing["passed"], missing["errors"]) == (0, 1)
    assert "No module named 'vllm.no_such_module'" in missing["first_problem"]
    broken = rows["tests/broken"]
    assert (broken["passed"], broken["errors"]) == (0, 1)
    assert "No module named 'vllm.no_such_config'" in broken["first_problem"]
    assert rows["tests/v1/core/test_specs.py"]["passed"] == 1
    table = capsys.readouterr().out
    assert "tests/test_mixed.py" in table and "of 3" in table
    assert table.splitlines()[2 + len(files)].startswith("all")


def test_bad_arguments_are_one_line_errors(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        tool.main(["--sdist", str(tmp_path / "none.tar.gz")])
    assert exc.value.code == 2 and "--sdist: expected a .tar.gz file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        tool.main(["--sdist", str(fake_sdist(tmp_path)), "tests/nope.py"])
    assert exc.value.code == 2
    assert "FILE: expected a test file or folder of the sdist, got 'tests/nope.py'" in (
        capsys.readouterr().err
    )


def test_keyword_selects_cases_and_strict_fails_on_a_failure(tmp_path: Path, capsys) -> None:
    sdist = str(fake_sdist(tmp_path))
    out = tmp_path / "rows.json"
    args = ["--sdist", sdist, "--json", str(out), "--strict", "tests/test_mixed.py"]
    assert tool.main([*args, "-k", "not fail"]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["passed"], row["failed"], row["skipped"]) == (1, 0, 1)
    assert tool.main(args) == 1
    assert tool.main(["--sdist", sdist, "tests/test_mixed.py"]) == 0  # a measurement by default
    assert tool.main([*args[:-1], "tests/sub"]) == 1  # a file that does not collect
    capsys.readouterr()
