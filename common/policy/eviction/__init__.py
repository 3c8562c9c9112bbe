"""Eviction over whole groups: policies choose the order, the manager enforces
capacity and per-tenant guaranteed shares."""

from .base import EvictionPolicy
from .manager import Admission, CapacityManager
from .policies import make_policy

__all__ = ["EvictionPolicy", "make_policy", "CapacityManager", "Admission"]
