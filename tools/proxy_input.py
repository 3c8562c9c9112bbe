"""What `kvpack proxy` accepts from a client, checked before anything is forwarded or read.

The proxy forwards paths, never targets (as nginx's ``proxy_pass`` to a fixed host does):

- `upstream_url` accepts only an origin-form request target (``/path?query``: no scheme, no
  authority, no ``//host`` and no ``:PORT/...`` form) and builds the URL from the upstream's own
  configured scheme, host, port and base path (`Upstream`); anything else is a `Refusal` (400).
- `body_length` bounds a body before a byte of it is read: one ``Content-Length`` of decimal
  digits, at most the proxy's ``--max-body-bytes``. Missing on a request that has a body (or a
  ``Transfer-Encoding`` body, which the proxy does not read) is 411, not digits (a negative
  length included) or repeated is 400, over the bound is 413.
- `client_params` drops kvpack's own fields of ``kv_transfer_params`` (``kvpack`` and any
  ``kvpack_*``: a tenant, its signature, a handoff) that a client sent, unless the proxy was
  told it stands behind a front end that sets them (``--trust-kvpack-params``). The fields the
  proxy sets itself for a prefill/decode handoff (``do_remote_decode`` to the prefill instance,
  the prefill instance's own answer to the decode instance) are added after this.

Every refusal is one line for the client; the client's values appear in it only clipped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import Message
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MAX_BODY_BYTES = 8 << 20
"""Default bound of a request body (``--max-body-bytes``): a prompt of a million tokens fits."""
BODY_BYTES_CAP = 1 << 30
"""The largest ``--max-body-bytes`` the proxy accepts (a whole body is held in memory)."""
_DIGITS = re.compile(r"[0-9]+")
_CLIP = 64


def _clip(value: str) -> str:
    return repr(value[:_CLIP] + ("..." if len(value) > _CLIP else ""))


class Refusal(ValueError):
    """A request the proxy answers at once with `status` (and closes): nothing forwarded, no body read."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Upstream:
    """An upstream's configured base URL, split once: where every forwarded path goes.

    Invariant: `scheme` is http or https and `netloc` names a host; requests only add a path
    (below `path`) and a query."""

    scheme: str
    netloc: str
    path: str

    @classmethod
    def parse(cls, url: str) -> Upstream:
        """The upstream of base URL `url` (``http://host[:port][/base]``); ValueError (one line) otherwise."""
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises for a port that is not a number in range
        except ValueError as exc:
            raise ValueError(f"upstream {_clip(url)} is not a URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream {_clip(url)} must be http://HOST[:PORT][/PATH] or https://...")
        if parts.query or parts.fragment or parts.username is not None:
            raise ValueError(f"upstream {_clip(url)} must have no query, fragment or user")
        return cls(parts.scheme, parts.netloc, parts.path.rstrip("/"))

    def __str__(self) -> str:
        return urlunsplit((self.scheme, self.netloc, self.path, "", ""))


def origin_path(target: str) -> tuple[str, str]:
    """(path, query) of an origin-form request target; `Refusal` (400) for any other form."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        raise Refusal(400, f"request target {_clip(target)} is not a path: the proxy forwards only /PATH[?QUERY]")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in target):
        raise Refusal(400, "request target has a control character")
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        raise Refusal(400, f"request target {_clip(target)} is not a path: the proxy forwards only /PATH[?QUERY]")
    return parts.path, parts.query


def upstream_url(up: Upstream, target: str) -> str:
    """The URL `target` (a client's request target) reaches on `up`: `up`'s scheme, host and port,
    its base path plus the target's path, and the target's query. `Refusal` (400) unless origin-form."""
    path, query = origin_path(target)
    return urlunsplit((up.scheme, up.netloc, up.path + path, query, ""))


def body_length(headers: Message, max_bytes: int, required: bool) -> int:
    """The body's length in bytes by `headers`, checked before it is read (module docstring);
    `required`: the method has a body (POST, PUT), else a body is refused. `Refusal` otherwise."""
    if headers.get("Transfer-Encoding") is not None:
        raise Refusal(411, "the proxy reads only bodies with a Content-Length (no Transfer-Encoding)")
    values = headers.get_all("Content-Length") or []
    if not values:
        if required:
            raise Refusal(411, "a Content-Length is required")
        return 0
    if len(values) > 1:
        raise Refusal(400, "more than one Content-Length")
    raw = values[0].strip()
    if not _DIGITS.fullmatch(raw):
        raise Refusal(400, f"Content-Length must be a number of bytes, got {_clip(raw)}")
    n = int(raw) if len(raw) <= 19 else max_bytes + 1  # a length past 2**63: over any bound
    if n > max_bytes:
        raise Refusal(413, f"a body of {_clip(raw)} bytes is over the proxy's bound of {max_bytes} (--max-body-bytes)")
    if n and not required:
        raise Refusal(400, "this method takes no body")
    return n


def is_kvpack_field(name: str) -> bool:
    """A field of ``kv_transfer_params`` that is kvpack's own (``kvpack``, ``kvpack_*``)."""
    return name == "kvpack" or name.startswith("kvpack_")


def client_params(body: Mapping[str, Any], trusted: bool) -> dict[str, Any] | None:
    """The client's ``kv_transfer_params`` as the proxy forwards them (None: the client sent none):
    kvpack's own fields dropped unless `trusted`. `Refusal` (400) for params that are not an object."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise Refusal(400, f"kv_transfer_params must be an object, got {type(params).__name__}")
    return dict(params) if trusted else {k: v for k, v in params.items() if not is_kvpack_field(str(k))}
