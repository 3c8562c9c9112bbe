"""Where a hit's tokens come from: its split by tier, as engines' metrics report cached tokens.

An engine accepts the last `external_tokens` of a `HitPlan`'s ``matched`` tokens as loaded
from kvpack (vLLM: those past its own prefix cache). Each of those tokens lies in one chunk
of the plan: a whole chunk (``plan.tiers[i]``: where the lookup found each member) or the
tail (``plan.tail.tiers``). A chunk whose members sit in several tiers counts under the
farthest of them (the last in the store's tier order: the one its load waits on), and every
tier maps to the `Medium` it keeps bytes in. A chunk with no tier known (a prefill
instance's handoff: planned from the claim, not a lookup) counts under `UNKNOWN_TIER`.

The split always sums to `external_tokens` (vLLM checks that and otherwise reports the whole
hit as unattributed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..policy.hits import HitPlan
from ..tiers.base import Medium, Tier

UNKNOWN_TIER = "unknown"
"""The tier label of tokens no lookup located (their medium is None)."""


@dataclass(frozen=True, slots=True)
class HitSources:
    """One accepted hit's tokens by tier name and by medium; both sum to the hit's tokens."""

    by_tier: dict[str, int]
    """Tier name (or `UNKNOWN_TIER`) -> tokens; only non-zero counts."""
    by_medium: dict[Medium | None, int]
    """`Medium` (None: not known) -> tokens; only non-zero counts."""

    @property
    def tokens(self) -> int:
        return sum(self.by_tier.values())


def hit_sources(plan: HitPlan, external_tokens: int, chunk_tokens: int, tiers: Sequence[Tier]) -> HitSources:
    """The split of the last `external_tokens` of `plan`'s hit (chunks of `chunk_tokens`
    tokens) over `tiers` (a store's tiers, fastest first). See the module docstring."""
    end = plan.matched
    start = max(0, end - max(0, external_tokens))
    order = {t.name: i for i, t in enumerate(tiers)}
    media = {t.name: t.medium for t in tiers}
    by_tier: dict[str, int] = {}
    if chunk_tokens <= 0 or start >= end:
        return HitSources({}, {})
    for i in range(start // chunk_tokens, -(-end // chunk_tokens)):
        lo, hi = max(start, i * chunk_tokens), min(end, (i + 1) * chunk_tokens)
        if i < plan.hit_chunks:
            found = [t for _, t in plan.tiers[i]] if i < len(plan.tiers) else []
        else:
            found = list(plan.tail.tiers) if plan.tail is not None else []
        # an unknown tier name sorts last: it is never reported as nearer than a known one
        tier = max(found, key=lambda t: order.get(t, len(order)), default=UNKNOWN_TIER)
        by_tier[tier] = by_tier.get(tier, 0) + hi - lo
    by_medium: dict[Medium | None, int] = {}
    for tier, n in by_tier.items():
        medium = media.get(tier)
        by_medium[medium] = by_medium.get(medium, 0) + n
    return HitSources(by_tier, by_medium)
