"""Model presets shipped with the package: the KV-relevant keys of real models' ``config.json``.

Each ``<name>.json`` holds ``name`` (the checkpoint), ``source``, ``config`` (the HF keys, copied
verbatim) and ``derived`` (cross-checked numbers). The preset name is the file stem, e.g.
``gpt-oss-120b``. Files are read with ``importlib.resources``, so presets work from an installed
wheel as well as from a source tree.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

__all__ = ["available_presets", "load_preset", "DEFAULT_PRESET"]

DEFAULT_PRESET = "llama-3.1-8b-instruct"
"""The preset ``vllm-kv plan`` uses when no ``--model`` is given."""

_SUFFIX = ".json"


@lru_cache(maxsize=1)
def _preset_files() -> dict[str, Any]:
    root = resources.files(__name__)
    return {
        entry.name[: -len(_SUFFIX)]: entry
        for entry in root.iterdir()
        if entry.name.endswith(_SUFFIX) and entry.is_file()
    }


def available_presets() -> list[str]:
    """Sorted names of the shipped presets."""
    return sorted(_preset_files())


def load_preset(name: str) -> dict[str, Any]:
    """The parsed preset ``name`` (the whole wrapper: name, source, config, derived, ...).

    Raises ``ValueError`` naming the available presets when ``name`` is unknown. Each call
    returns a fresh dict, so callers may mutate it.
    """
    files = _preset_files()
    if name not in files:
        raise ValueError(
            f"model: unknown preset {name!r}; available presets: {', '.join(sorted(files))}"
        )
    return json.loads(files[name].read_text(encoding="utf-8"))
