"""NIXL's Python API, imported once for every tier that moves bytes with it.

``NixlWrapper`` is NIXL's agent class and ``nixl_agent_config`` its config class; both are
``None`` when NIXL's package is not installed (the ``obj`` and ``kvcr`` extras bring it), and
each user refuses to start then, naming the missing package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NixlWrapper", "nixl_agent_config"]

NixlWrapper: Any
nixl_agent_config: Any
try:
    from nixl._api import nixl_agent as NixlWrapper  # noqa: N812 (upstream's name)
    from nixl._api import nixl_agent_config
except ImportError:
    NixlWrapper = nixl_agent_config = None
