"""Physical order of a KV cache group's five logical axes.

Every cache is logically ``[L, B, H, N, C]``: layer, block (page), head, token within the
page, content bytes. A layout names the order those axes take in memory. It lives with the
configs (``CacheConfig.kv_cache_layout`` names one) and imports nothing; upstream's path,
``vllm.v1.kv_cache_layout``, re-exports it.
"""

from enum import Enum

_L, _B, _H, _N, _C = range(5)


class KVCacheLayout(Enum):
    """A layout's value is the logical axis found at each physical position, outermost first."""

    LBHNC = (_L, _B, _H, _N, _C)
    LBNHC = (_L, _B, _N, _H, _C)
    LHBNC = (_L, _H, _B, _N, _C)
    BLHNC = (_B, _L, _H, _N, _C)
    BLNHC = (_B, _L, _N, _H, _C)
    BHLNC = (_B, _H, _L, _N, _C)

    @property
    def stride_order(self) -> tuple[int, ...]:
        """Logical axes in physical order, outermost first."""
        return self.value

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        """The same order for one layer's 4-D ``[B, H, N, C]`` view (L removed, renumbered)."""
        return tuple(axis - 1 for axis in self.value if axis != _L)

    @property
    def is_layer_compact(self) -> bool:
        """True when each layer's pages form one run (L outermost)."""
        return self.value[0] == _L

    @property
    def is_block_contiguous(self) -> bool:
        """True when a page's ``[H, N, C]`` lie innermost, in that order."""
        return self.value[2:] == (_H, _N, _C)

    @property
    def is_block_compact(self) -> bool:
        """True when one layer's page is one contiguous run of bytes (L and B outermost)."""
        return {self.value[0], self.value[1]} == {_L, _B}

    @property
    def is_block_outermost(self) -> bool:
        """True when pages are the outermost axis (all layers of a page together)."""
        return self.value[0] == _B

    @property
    def block_interior(self) -> str:
        """A page side's order inside a block: ``"HND"`` (head-major) or ``"NHD"``."""
        return "HND" if self.value.index(_H) < self.value.index(_N) else "NHD"


LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
"""v0.22's layout names, as the v0.33 layouts they mean."""


def layout_from_name(name: str, arg_name: str = "layout") -> KVCacheLayout:
    """The layout ``name`` names (a member's name, or ``NHD`` / ``HND``)."""
    member = KVCacheLayout.__members__.get(LAYOUT_ALIASES.get(name, name))
    if member is None:
        names = ", ".join([*KVCacheLayout.__members__, *LAYOUT_ALIASES])
        raise ValueError(f"{arg_name}: expected one of {names}, got {name!r}")
    return member
