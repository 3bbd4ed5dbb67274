"""Memory sizes for messages (upstream's ``vllm.utils.mem_utils`` helper the KV-cache code uses)."""

from vllm.utils.mem_constants import GiB_bytes

__all__ = ["format_gib"]


def format_gib(num_bytes: int) -> str:
    """``num_bytes`` in GiB, rounded to two decimals, without a unit (``"1.5"``)."""
    return f"{round(num_bytes / GiB_bytes, 2)}"
