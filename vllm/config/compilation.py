"""Upstream's ``vllm.config.compilation``, reduced to what the KV-cache worker code reads: the
CUDA-graph modes, the registry of a model's attention layers (``static_forward_context``) and
the layer lookup over it."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = [
    "AttentionCGSupport",
    "CUDAGraphMode",
    "CompilationConfig",
    "get_layers_from_vllm_config",
]

T = TypeVar("T")


class AttentionCGSupport(enum.Enum):
    """Which batches an attention backend's metadata builder can run inside a full CUDA graph,
    weakest first (compare ``.value``). Upstream defines it in ``vllm.v1.attention.backend``;
    it lives here, below the attention layer, so that the config and the worker share one
    definition."""

    NEVER = 0
    """No full graphs (piecewise graphs around attention still work)."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Only decode batches of one token per request."""
    UNIFORM_BATCH = 2
    """Only batches whose requests all have the same query length."""
    ALWAYS = 3
    """Any batch, prefills included."""


class CUDAGraphMode(enum.Enum):
    """How a batch runs: eagerly, as piecewise graphs around attention, or as one full graph.

    ``NONE``, ``PIECEWISE`` and ``FULL`` are the modes a batch actually runs in; the two tuple
    modes name a ``(decode, mixed)`` pair, one mode for pure-decode batches and one for the
    rest."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        """Whether decode and mixed batches run in different modes (a tuple mode)."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        """The mode a pure-decode batch runs in."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        """The mode a batch with prefills runs in."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """Whether some batch runs in ``mode`` (a runtime mode)."""
        if mode.separate_routine():
            raise ValueError(f"mode: expected NONE, PIECEWISE or FULL, got {mode.name}")
        if self.separate_routine():
            return mode.value in self.value
        return self == mode

    def requires_piecewise_compilation(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def without_piecewise(self) -> CUDAGraphMode:
        """This mode with its piecewise part run eagerly instead."""
        if self == CUDAGraphMode.PIECEWISE:
            return CUDAGraphMode.NONE
        if self == CUDAGraphMode.FULL_AND_PIECEWISE:
            return CUDAGraphMode.FULL_DECODE_ONLY
        return self

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return self.max_cudagraph_mode() == CUDAGraphMode.FULL

    def has_piecewise_cudagraphs(self) -> bool:
        return self.requires_piecewise_compilation()

    @classmethod
    def valid_runtime_modes(cls) -> frozenset[CUDAGraphMode]:
        return frozenset({cls.NONE, cls.PIECEWISE, cls.FULL})

    def is_valid_runtime_mode(self) -> bool:
        return self in CUDAGraphMode.valid_runtime_modes()

    def __str__(self) -> str:
        return self.name

    def __bool__(self) -> bool:
        return self != CUDAGraphMode.NONE


@dataclass
class CompilationConfig:
    """``cudagraph_mode``: the requested graph mode (None: not resolved yet).
    ``static_forward_context``: every attention layer of the model by its layer name (the
    layers register themselves when built)."""

    cudagraph_mode: CUDAGraphMode | None = None
    static_forward_context: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cudagraph_mode is not None and not isinstance(self.cudagraph_mode, CUDAGraphMode):
            raise TypeError(
                f"cudagraph_mode: expected a CUDAGraphMode or None, got "
                f"{type(self.cudagraph_mode).__name__}"
            )


def get_layers_from_vllm_config(
    vllm_config: Any, layer_type: type[T], layer_names: Iterable[str] | None = None
) -> dict[str, T]:
    """The layers of ``vllm_config.compilation_config.static_forward_context`` that are
    ``layer_type`` instances, in registration order (or in ``layer_names``' order, skipping
    names that are absent or of another type)."""
    compilation_config = getattr(vllm_config, "compilation_config", None)
    if compilation_config is None:
        raise ValueError(
            "vllm_config: expected a config with a compilation_config (its "
            "static_forward_context lists the layers), got none"
        )
    forward_context = compilation_config.static_forward_context
    names = forward_context.keys() if layer_names is None else layer_names
    return {
        name: layer
        for name in names
        if name in forward_context and isinstance(layer := forward_context[name], layer_type)
    }
