"""Scheduler-side helpers of the offloading connector (upstream v0.33's
``kv_connector.v1.offloading.scheduler``): turning a request into the :class:`ReqContext` the
offloading managers see.

A request may restrict the tiers it loads from with ``kv_transfer_params["kv_load_tiers"]``: a
list of ``{"medium": ..., "locality": ...}`` matchers (either key optional, values
case-insensitive, e.g. ``[{"medium": "storage"}]``). As upstream, malformed input is not an
error: it is logged and ignored (a bad entry is skipped; nothing usable left means every
tier), because it arrives with a user's request and must not fail it; ``[]`` allows no tier.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import Locality, Medium, ReqContext, TierFilter, TierMatcher

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

KV_LOAD_TIERS_KEY = "kv_load_tiers"
MATCHER_MEDIUM_KEY = "medium"
MATCHER_LOCALITY_KEY = "locality"


def _parse_enum(enum_cls: type[Medium] | type[Locality], raw: Any) -> Medium | Locality:
    if not isinstance(raw, str):
        raise ValueError(raw)
    return enum_cls(raw.upper())


def _parse_matcher(entry: Any) -> TierMatcher | None:
    if not isinstance(entry, dict):
        logger.warning("%s: ignoring entry %r, not a dict", KV_LOAD_TIERS_KEY, entry)
        return None
    fields: dict[str, Any] = {}
    for key, enum_cls in ((MATCHER_MEDIUM_KEY, Medium), (MATCHER_LOCALITY_KEY, Locality)):
        raw = entry.get(key)
        if raw is None:
            continue
        try:
            fields[key] = _parse_enum(enum_cls, raw)
        except ValueError:
            logger.warning(
                "%s: ignoring entry %r, unknown %s %r", KV_LOAD_TIERS_KEY, entry, key, raw
            )
            return None
    return TierMatcher(**fields)


def _parse_tier_filter(raw: Any) -> TierFilter:
    """The :class:`TierFilter` a request's ``kv_load_tiers`` value describes."""
    if not isinstance(raw, list):
        logger.warning(
            "%s: expected a list of matchers, got %s; loading from every tier",
            KV_LOAD_TIERS_KEY,
            type(raw).__name__,
        )
        return TierFilter.ALL
    if not raw:
        return TierFilter(matchers=())
    matchers = tuple(m for m in map(_parse_matcher, raw) if m is not None)
    return TierFilter(matchers=matchers) if matchers else TierFilter.ALL


def _create_req_context(req: Request) -> ReqContext:
    """The offloading managers' view of ``req``."""
    params = req.kv_transfer_params
    raw_tiers = params.get(KV_LOAD_TIERS_KEY) if params else None
    return ReqContext(
        req_id=req.request_id,
        kv_transfer_params=params,
        kv_hints=getattr(req, "kv_hints", None),
        load_tier_filter=TierFilter.ALL if raw_tiers is None else _parse_tier_filter(raw_tiers),
    )


__all__ = ["KV_LOAD_TIERS_KEY", "MATCHER_LOCALITY_KEY", "MATCHER_MEDIUM_KEY"]
