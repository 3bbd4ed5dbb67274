"""NIXL 1.5's UCX backend crashes the interpreter at exit: a segmentation fault in its teardown,
after every test has finished (``nixl_agent(name, nixl_agent_config(backends=["UCX"]))`` then
exit reproduces it, with or without torch). When this folder's tests made a real agent, the run
ends with ``os._exit`` and pytest's own status once pytest has written its report, so the
library's teardown-free crash cannot turn a passing run into a failing one, or a failing one
into a crash."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

import vllm.v1.kv_offload.tiering.p2p.data.nixl as nixl_module

_state = {"agents": 0, "status": 0}

if nixl_module._NixlAgent is not None:
    _make_agent = nixl_module._NixlAgent

    def _counted_agent(*args: Any, **kwargs: Any) -> Any:
        _state["agents"] += 1
        return _make_agent(*args, **kwargs)

    nixl_module._NixlAgent = _counted_agent


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _state["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _state["agents"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_state["status"])
