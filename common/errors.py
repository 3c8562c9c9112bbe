"""Exception types that kvpack raises to its callers.

Only configuration and programming errors raise. Storage failures on the data
path never raise into an engine: they are returned as named outcomes
(`kvpack.tiers.base.TierStatus`, `kvpack.identity.objects.RejectReason`) and counted.
"""

from __future__ import annotations


class KVPackError(Exception):
    """Base class of every exception kvpack raises on purpose."""


MAX_FIELD_CHARS = 200
"""Longest field path a `ConfigError` shows (characters); a longer one is cut in the middle."""
MAX_PROBLEM_CHARS = 600
"""Longest problem text a `ConfigError` shows; a longer one is cut in the middle, so the
head (what was given) and the tail (what is allowed) both stay."""


def one_line(text: str, limit: int) -> str:
    """`text` as one line of at most `limit` printable characters.

    Line breaks and other unprintable characters are escaped (``\\n``, ``\\x00``,
    ``\\u2028``); a longer text keeps its head and tail around ``...``. The work is
    bounded by `limit`, whatever the length of `text`."""
    if len(text) > 2 * limit:
        text = text[:limit] + text[-limit:]
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    if len(out) <= limit:
        return out
    half = (limit - 3) // 2
    return f"{out[:half]}...{out[len(out) - half :]}"


def shown(value: object, limit: int = 60) -> str:
    """A short description of a value for an error message: never the whole of a long
    string or container, never the digits of a huge number (Python refuses to print an
    integer of more than 4300 digits), always one line."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() <= 200:
            return repr(value)
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    if isinstance(value, str):
        text = repr(value[:limit]) + ("..." if len(value) > limit else "")
        return one_line(text, limit + 20)
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} entries"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return f"a {type(value).__name__}"


class ConfigError(KVPackError, ValueError):
    """A configuration value is unknown or invalid.

    `field` is the dotted path of the offending key (for example
    ``"disk.capacity"``; empty when the problem is the whole input, e.g. a file
    that is not UTF-8), `problem` says what is wrong and what is allowed, and
    `source` names the file it came from (empty for an engine's JSON or code).
    The message is always one line (`one_line`), of bounded length:
    ``kvpack config: [source: ][field: ]problem``.
    """

    def __init__(self, field: str, message: str, source: str = "") -> None:
        self.field = one_line(field, MAX_FIELD_CHARS)
        self.problem = one_line(message, MAX_PROBLEM_CHARS)
        self.source = one_line(source, MAX_FIELD_CHARS)
        parts = [p for p in (self.source, self.field) if p]
        super().__init__(": ".join(["kvpack config", *parts, self.problem]))

    def in_file(self, source: str) -> ConfigError:
        """This error, naming `source` as the file it came from."""
        return ConfigError(self.field, self.problem, source)


class LayoutError(KVPackError, ValueError):
    """A tensor does not match any KV layout that kvpack knows how to copy."""
