"""The policy named in the config, built (`make_policy`): the one place that knows every policy.

Kept apart from `base` so the interface imports no implementation (no import circle).
"""

from __future__ import annotations

from ...config.schema import EvictionPolicyName
from .arc import ARCPolicy
from .base import EvictionPolicy
from .lru import LRUPolicy


def make_policy(name: EvictionPolicyName) -> EvictionPolicy:
    """A new, empty policy of kind `name`; ValueError for a name this build does not know."""
    if name is EvictionPolicyName.LRU:
        return LRUPolicy()
    if name is EvictionPolicyName.ARC:
        return ARCPolicy()
    raise ValueError(f"unknown eviction policy {name!r}")  # pragma: no cover
