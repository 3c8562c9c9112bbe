"""Exception types that kvpack raises to its callers.

Only configuration and programming errors raise. Storage failures on the data
path never raise into an engine: they are returned as named outcomes
(`kvpack.tiers.base.TierStatus`, `kvpack.objects.RejectReason`) and counted.
"""

from __future__ import annotations


class KVPackError(Exception):
    """Base class of every exception kvpack raises on purpose."""


class ConfigError(KVPackError, ValueError):
    """A configuration value is unknown or invalid.

    `field` is the dotted path of the offending key (for example
    ``"disk.capacity"``), so the message tells a user exactly what to fix.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"kvpack config: {field}: {message}")


class LayoutError(KVPackError, ValueError):
    """A tensor does not match any KV layout that kvpack knows how to copy."""
