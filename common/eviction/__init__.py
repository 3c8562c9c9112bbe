"""Eviction over whole groups: policies choose the order, the manager enforces
capacity and per-tenant guaranteed shares."""

from .base import EvictionPolicy, make_policy
from .manager import Admission, CapacityManager

__all__ = ["EvictionPolicy", "make_policy", "CapacityManager", "Admission"]
