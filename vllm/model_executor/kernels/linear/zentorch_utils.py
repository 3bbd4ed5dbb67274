"""Whether zentorch's kernels (AMD's CPU kernel package) can be called here."""

from __future__ import annotations

import torch

from vllm.platforms import current_platform

__all__ = ["has_zentorch_op"]


def has_zentorch_op(op_names: list[str]) -> bool:
    """True on a Zen CPU platform (:meth:`~vllm.platforms.interface.Platform.is_zen_cpu`) whose
    ``torch.ops.zentorch`` has every op of ``op_names`` registered."""
    if not op_names:
        raise ValueError("op_names: expected at least one op name, got []")
    if not current_platform.is_zen_cpu():
        return False
    namespace = getattr(torch.ops, "zentorch", None)
    return namespace is not None and all(hasattr(namespace, name) for name in op_names)
