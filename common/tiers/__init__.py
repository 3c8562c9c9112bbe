"""Storage tiers behind one batched, zero-copy interface (`kvpack.tiers.base.Tier`)."""

from .base import GetResult, PutItem, Tier, TierStatus, TierUsage

__all__ = ["GetResult", "PutItem", "Tier", "TierStatus", "TierUsage"]
