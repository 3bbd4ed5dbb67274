"""Weight-loading settings (upstream's ``LoadConfig``, reduced): the library loads no weights,
so only the format name is kept, for configs built the engine's way."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadConfig"]


@dataclass
class LoadConfig:
    """``load_format``: upstream's weight-format name (``"auto"``, ``"safetensors"``, ...)."""

    load_format: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.load_format, str):
            raise ValueError(f"load_format: expected a format name (str), got {self.load_format!r}")
