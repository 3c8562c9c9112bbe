"""Whether the engine's KV cache may be touched now: the gate every copy into or out of it
passes (vLLM's sleep mode releases the cache's memory and maps it again on wake-up).

Invariants:

- While the gate is closed no `access` is granted: a copy that asks is not launched (a
  load fails and the engine recomputes it, a save is dropped: a future miss).
- `close` returns once every access granted before it has ended and every copy launched
  inside one has completed (its event waited for), or at its bound; from then on nothing
  reads or writes the cache until `open`.
- A copy whose event is waited for later (a save's gather, read by the save thread) is
  `launched` inside its access and `settled` once waited for; `close` waits for it too.

Thread-safe. Engine-neutral: the adapter says when its engine releases and restores the cache.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

from .staging import Staged


class CacheGate:
    """See the module docstring. Open when built."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._open = True
        self._active = 0
        self._unsettled: dict[int, Staged] = {}

    @contextlib.contextmanager
    def access(self) -> Iterator[bool]:
        """``with gate.access() as allowed:`` launch (and, for loads, wait for) copies of the
        cache only when `allowed`; `close` waits for the block to end."""
        with self._cv:
            allowed = self._open
            if allowed:
                self._active += 1
        try:
            yield allowed
        finally:
            if allowed:
                with self._cv:
                    self._active -= 1
                    self._cv.notify_all()

    def launched(self, staged: Iterable[Staged]) -> None:
        """Copies launched inside an access whose events someone waits for later."""
        with self._cv:
            for s in staged:
                self._unsettled[id(s)] = s

    def settled(self, staged: Iterable[Staged]) -> None:
        """Those copies' events were waited for (`Staged.wait`, `release`)."""
        with self._cv:
            for s in staged:
                self._unsettled.pop(id(s), None)
            self._cv.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Refuse new accesses, then wait (at most `timeout_s`) for the granted ones and for
        every launched copy. False when one was still running at the bound. Idempotent."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._open = False
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            pending = list(self._unsettled.values())
        for s in pending:  # device copies end by themselves: their events complete
            s.wait()
        self.settled(pending)
        return True

    def open(self) -> None:
        """The cache is mapped again: copies may run. Idempotent."""
        with self._cv:
            self._open = True
