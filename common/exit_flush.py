"""Durable before exit: what a store accepted reaches its tiers before the process ends.

A user's script calls ``generate()`` and simply ends; a server gets Ctrl-C
or SIGTERM. Stores queued for the write-back threads (daemon threads, which
the interpreter freezes at exit) must reach every tier first. Each store
with write-back work registers here; before the process exits, one bounded
flush (``shutdown_flush_s``, shared by every store of the process) runs:

- on a normal interpreter exit (``atexit``), and in a child process that
  ``multiprocessing`` started (fork or spawn: its exit runs the
  ``multiprocessing.util.Finalize`` hooks, which a forked child's ``os._exit``
  otherwise skips);
- on SIGTERM/SIGINT/SIGHUP whose handler is still the default (the process
  would die on the spot): kvpack flushes, then restores the default and
  re-raises the signal, so the process still ends the way it would have.
  A handler the engine installed (vLLM's raise ``SystemExit``, Python's
  SIGINT raises ``KeyboardInterrupt``) is left alone: it ends the process
  through the normal exit path above. kvpack never swallows a signal.

What the bound cuts off is counted (``store_dropped{reason="shutdown"}`` per
tier) and logged. Only stores made by this process are flushed: a forked
child inherits its parent's registry but not its threads.

The registry is process-wide by necessity (exit hooks and signal handlers
are per process); it holds weak references, so it never keeps a store alive.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import threading
import time
import weakref
from typing import Any, Protocol

log = logging.getLogger("kvpack")

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Flushable(Protocol):
    def flush_before_exit(self, timeout_s: float, reason: str) -> bool:
        """Flush within `timeout_s`; count and log what it could not. True when drained."""
        ...


class _Registry:
    """Stores of this process with write-back work (weakly held), and the hooks that flush them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a signal handler may run while this thread holds it
        self._stores: weakref.WeakKeyDictionary[Any, tuple[int, float]] = weakref.WeakKeyDictionary()
        """store -> (pid that made it, its flush bound in seconds)."""
        self._hooked_pid = 0

    def register(self, store: Flushable, timeout_s: float) -> None:
        with self._lock:
            self._stores[store] = (os.getpid(), float(timeout_s))
            if self._hooked_pid != os.getpid():
                self._hooked_pid = os.getpid()
                self._install()

    def unregister(self, store: Flushable) -> None:
        with self._lock:
            self._stores.pop(store, None)

    def flush_all(self, reason: str) -> bool:
        """Flush every store this process made, within the largest of their bounds."""
        pid = os.getpid()
        with self._lock:
            mine = [(s, bound) for s, (owner, bound) in list(self._stores.items()) if owner == pid]
        if not mine:
            return True
        deadline = time.monotonic() + max(bound for _, bound in mine)
        ok = True
        for store, _ in mine:
            try:
                ok &= store.flush_before_exit(max(0.0, deadline - time.monotonic()), reason)
            except Exception as exc:  # at exit: never raise into the interpreter's shutdown
                log.warning("kvpack: flush before exit (%s) failed: %s", reason, exc)
                ok = False
        return ok

    def _install(self) -> None:
        # one hook for both: multiprocessing runs its finalizers from its own atexit handler
        # in the main process and from its child-exit path (where atexit is skipped)
        multiprocessing.util.Finalize(None, self.flush_all, args=("exit",), exitpriority=100)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; the exit hooks remain
        for sig in HANDLED_SIGNALS:
            try:
                if signal.getsignal(sig) is signal.SIG_DFL:
                    signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # pragma: no cover - embedded interpreters
                pass

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        self.flush_all(name)
        signal.signal(signum, signal.SIG_DFL)  # end the process as the default would have
        os.kill(os.getpid(), signum)


_REGISTRY = _Registry()


def flush_on_exit(store: Flushable, timeout_s: float) -> None:
    """Flush `store` (bounded by `timeout_s`) before this process exits; see the module docstring."""
    _REGISTRY.register(store, timeout_s)


def forget(store: Flushable) -> None:
    """`store` was closed (and flushed) already: nothing to do at exit."""
    _REGISTRY.unregister(store)
