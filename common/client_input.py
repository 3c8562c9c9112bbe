"""Values a client sent, bounded before kvpack logs, counts or keeps them.

A client of an engine (an OpenAI request's ``kv_transfer_params``, its ``cache_salt``,
its request id) can send fields of any size. Whatever kvpack refuses of them costs a
bounded amount and nothing beyond the request's life:

- counted under a reason from a fixed enum (`Refusals`): a bounded label set, never a
  label made of the client's text;
- logged once per reason per process, each client value cut to `CLIP_CHARS`
  characters (`clip`) and the whole line to `MAX_DETAIL_CHARS`;
- kept nowhere: a `Refusals` holds only the set of reasons it has logged (at most the
  size of the enum), whatever the number or the size of the refusals.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Mapping
from typing import Protocol

CLIP_CHARS = 48
"""The most characters of one client value a log line or an error message quotes."""
MAX_DETAIL_CHARS = 400
"""The most characters of a refusal's detail a log line carries."""


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """A short, bounded rendering of a client's value for an error message or a log line.

    A string is quoted up to `limit` characters, then ``...`` and its length; a number
    is written out unless it is longer than `limit` digits; any other value is named by
    its type only (so a huge or deeply nested value is never rendered whole)."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value)} characters)"
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() <= 3 * limit:  # about `limit` decimal digits
            text = str(value)
            if len(text) <= limit:
                return text
        return f"an integer of {value.bit_length()} bits"
    return f"a {type(value).__name__}"


class Counts(Protocol):
    """Where a refusal is counted: `kvpack.observe.metrics.Metrics` (its ``inc``)."""

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None: ...


class Refusals:
    """Refused input of one kind: counted by reason, logged once per reason. The one
    log-once rule for what a client or an engine hands kvpack that it refuses.

    `metric` is a counter of `kvpack.observe.metrics.SPECS`; each refusal is counted with its
    reason's value under the label `label` (``reason`` unless the metric names it otherwise),
    beside the fixed `labels`. A reason is a member of an enum whose values are label values.
    The first refusal of each reason is logged at `level`; the set of reasons logged is all
    that is kept (bounded by the enum). Thread-safe."""

    def __init__(
        self,
        metrics: Counts,
        metric: str,
        what: str,
        logger: logging.Logger,
        *,
        label: str = "reason",
        labels: Mapping[str, str] | None = None,
        level: int = logging.ERROR,
    ) -> None:
        self._metrics = metrics
        self._metric = metric
        self._what = what
        self._log = logger
        self._label = label
        self._labels = dict(labels or {})
        self._level = level
        self._logged: set[enum.Enum] = set()
        self._lock = threading.Lock()

    def refuse(self, reason: enum.Enum, detail: str, request_id: object = None) -> bool:
        """Count one refusal of `reason`; log it when it is the first of its reason in this
        process. `detail` must quote client values through `clip` only; it is cut to
        `MAX_DETAIL_CHARS` here as well. `request_id`: the request it came with (None: not
        a request's). Returns whether it was logged."""
        value = str(reason.value)
        self._metrics.inc(self._metric, 1.0, **self._labels, **{self._label: value})
        with self._lock:
            if reason in self._logged:
                return False
            self._logged.add(reason)
        if len(detail) > MAX_DETAIL_CHARS:
            detail = detail[:MAX_DETAIL_CHARS] + "..."
        where = f"request {clip(request_id)}, reason {value}" if request_id is not None else f"reason {value}"
        series = ",".join(f"{k}={v!r}" for k, v in (*self._labels.items(), (self._label, value)))
        self._log.log(
            self._level,
            "kvpack: %s refused (%s): %s; later refusals of this reason are only counted (kvpack_%s_total{%s})",
            self._what,
            where,
            detail,
            self._metric,
            series,
        )
        return True

    def logged(self) -> frozenset[enum.Enum]:
        """The reasons logged so far (at most every member of their enum)."""
        with self._lock:
            return frozenset(self._logged)
