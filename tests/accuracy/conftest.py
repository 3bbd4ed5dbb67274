"""Shared fixtures of the accuracy tests: one synthetic sample and its default report."""

from __future__ import annotations

import pytest

from vllm.accuracy.formats import parse_formats
from vllm.accuracy.runner import CheckReport, run_check
from vllm.accuracy.samples import KVSample
from vllm.accuracy.synthetic import synthetic_sample


@pytest.fixture(scope="session")
def synth() -> KVSample:
    """The default synthetic sample (seed 0: 2 sequences, 512 tokens, 8 KV heads, D=128)."""
    return synthetic_sample(seed=0)


@pytest.fixture(scope="session")
def synth_report(synth: KVSample) -> CheckReport:
    """The default formats over the synthetic sample, written the way ``vllm-kv check`` does
    (the compiled op when built) and read through the reference backend."""
    return run_check(
        [synth], parse_formats(None), source="synthetic", description="test", reader="backend"
    )
