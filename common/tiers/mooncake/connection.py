"""The Mooncake client's lifecycle: background connect, tenant check, call gate, circuit breaker.

Mooncake's client segfaults on a data call before a successful ``setup``,
after a failed one, or after ``close``; it blocks for seconds per call once
its master is gone. `Connection` owns the one client a tier uses and makes
both harmless:

- ``setup`` runs on a background thread (construction never blocks); the
  tier answers UNAVAILABLE until it succeeded and the master accepted the
  tenant (`TierState`).
- Every call passes the `Gate`: no store, no call; `close` waits (bounded)
  for calls in flight and leaks, rather than closes, a client a stuck call
  still uses.
- `run` waits for a `Job` at most ``timeout_ms``; a stall (no answer in time,
  or workers held by a call running over the bound) or a connection-level
  code (`codes.CodeInfo.trips_breaker`) opens the `CircuitBreaker`: no call
  for ``backoff_s``, then a background probe closes it once the master
  answers again (Mooncake's client reconnects by itself).
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...config.schema import MooncakeProtocol, MooncakeTierConfig
from ...errors import ConfigError
from ..base import TierStatus
from .codes import NOT_CALLED, OBJECT_NOT_FOUND, TENANT_NOT_REGISTERED, code_info, describe
from .runner import Job, JobState, LaneRunner, Slot

log = logging.getLogger("kvpack")

PROBE_KEY = "kvpack/__probe__"
"""Key prefix of the tiny objects the tenant check writes (and removes at once)."""


# -- capabilities of the installed Mooncake ------------------------------------------


def load_mooncake() -> tuple[type, type]:
    """(MooncakeDistributedStore, ReplicateConfig) from the installed package.

    Raises ConfigError (a start-up error naming the field) when it is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ConfigError(
            "mooncake.enabled",
            f"the Mooncake tier needs the Mooncake store package ({exc}); install "
            "'mooncake-transfer-engine' (or '-non-cuda' on machines without CUDA) and libibverbs1",
        ) from None
    return MooncakeDistributedStore, ReplicateConfig


def supports_tenants(store_cls: type) -> bool:
    """Whether ``setup`` of this Mooncake build accepts ``tenant_id``."""
    doc = getattr(getattr(store_cls, "setup", None), "__doc__", None) or ""
    return "tenant_id" in doc


def check_support(config: MooncakeTierConfig) -> tuple[type, type, bool]:
    """(MooncakeDistributedStore, ReplicateConfig, tenant support) when the installed Mooncake
    can serve `config` (a resolved config); ConfigError naming the field otherwise.

    Connects to nothing: the start-up check (`kvpack.tiers.checks`) and `MooncakeTier` both call it."""
    store_cls, replicate_cls = load_mooncake()
    tenant_kw = supports_tenants(store_cls)
    if config.tenant_id != "default" and not tenant_kw:
        raise ConfigError(
            "mooncake.tenant_id",
            f"tenant {config.tenant_id!r} configured, but the installed Mooncake has no tenant support "
            "(setup() takes no tenant_id); upgrade mooncake-transfer-engine or use tenant 'default'",
        )
    return store_cls, replicate_cls, tenant_kw


def supports_groups(replicate_config_cls: type) -> bool:
    """Whether this Mooncake build's ``ReplicateConfig`` has ``group_ids``."""
    return hasattr(replicate_config_cls(), "group_ids")


# -- the gate: no data call before setup or after close ---------------------------------


class Gate:
    """Admits Mooncake calls only while a successfully set-up store is open.

    `enter()` returns the store (or None: do not call); `leave()` must follow,
    on the same thread (a thread makes one call at a time). `close_store()`
    stops admission, waits (bounded) for calls in flight and closes the store
    only if none is left inside it. `oldest_call_s()` says how long the
    oldest call in flight has been running (a call stuck in Mooncake)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._store: Any = None
        self._closed = False
        self._inside = 0
        self._entered: dict[int, float] = {}
        """Thread ident -> monotonic time its call entered."""

    def open(self, store: Any) -> bool:
        """Admit calls into `store` (a client whose setup succeeded); False once closed."""
        with self._cv:
            if self._closed:
                return False
            self._store = store
            return True

    def enter(self) -> Any:
        with self._cv:
            if self._closed or self._store is None:
                return None
            self._inside += 1
            self._entered[threading.get_ident()] = time.monotonic()
            return self._store

    def leave(self) -> None:
        with self._cv:
            self._inside -= 1
            self._entered.pop(threading.get_ident(), None)
            self._cv.notify_all()

    def oldest_call_s(self) -> float:
        """Seconds the longest-running call in flight has run (0.0: none)."""
        with self._cv:
            if not self._entered:
                return 0.0
            return time.monotonic() - min(self._entered.values())

    def close_store(self, wait_s: float, before_close: Callable[[Any], None] | None = None) -> bool:
        """True if the store was closed (or never opened); False if leaked."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            self._closed = True
            store = self._store
            while self._inside > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            stuck = self._inside
            self._store = None
        if store is None:
            return True
        if stuck:
            log.warning(
                "kvpack: %d Mooncake call(s) still blocked at close; leaving the client open "
                "(closing it under a running call crashes the process)",
                stuck,
            )
            return False
        try:
            if before_close is not None:
                before_close(store)
            store.close()
        except Exception as exc:  # pragma: no cover - best effort at shutdown
            log.warning("kvpack: closing the Mooncake client failed: %r", exc)
        return True


# -- the circuit breaker -------------------------------------------------------------------


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"


class CircuitBreaker:
    """Stops calls for `backoff_s` after a failure; `record_success` closes it.

    While open, `allow()` is False: callers answer UNAVAILABLE without
    touching Mooncake. `due_for_probe()` tells the tier's prober when the
    back-off has elapsed, so recovery is detected off the engine's path."""

    def __init__(self, backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self.trips = 0
        self.last_reason = ""

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        with self._lock:
            return self._state is BreakerState.CLOSED

    def record_failure(self, reason: str) -> None:
        with self._lock:
            was_open = self._state is BreakerState.OPEN
            self._state = BreakerState.OPEN
            self._opened_at = time.monotonic()
            self.last_reason = reason
            if not was_open:
                self.trips += 1
        if not was_open:
            log.warning(
                "kvpack: Mooncake tier unavailable (%s); not calling it for %.1fs, engines recompute meanwhile",
                reason,
                self.backoff_s,
            )

    def record_success(self) -> None:
        with self._lock:
            was_open = self._state is BreakerState.OPEN
            self._state = BreakerState.CLOSED
        if was_open:
            log.warning("kvpack: Mooncake tier is available again")

    def due_for_probe(self) -> bool:
        with self._lock:
            return self._state is BreakerState.OPEN and time.monotonic() - self._opened_at >= self.backoff_s

    def rearm(self) -> None:
        """A probe failed: stay open for another back-off period."""
        with self._lock:
            self._opened_at = time.monotonic()


# -- the connection ------------------------------------------------------------------------


class TierState(enum.Enum):
    """Where a Mooncake tier's client is in its life; only READY makes calls."""

    CONNECTING = "connecting"
    READY = "ready"
    TENANT_REJECTED = "tenant_rejected"
    CLOSED = "closed"


@dataclass
class TierEvents:
    """What happened to this tier's calls, for logs and tests (counts since start;
    plain ints, updated without a lock: exact once the calls in question returned).
    Per-item outcomes reach the store's Prometheus metrics as `TierStatus`es."""

    timeouts: int = 0
    """Jobs whose caller gave up at `timeout_ms`."""
    stalls: int = 0
    """Timeouts that opened the breaker (a call with no answer, or workers held by one)."""
    abandoned_puts_removed: int = 0
    """Objects removed again because their put was answered TIMEOUT."""
    setup_attempts: int = 0


class Connection:
    """One Mooncake client, connected in the background and called through the gate.

    `runner` runs every call; `arena_addr`/`arena_nbytes` is the staging arena,
    registered with the client once it is set up and unregistered before it is
    closed. Call `start()` once; `close()` is idempotent."""

    def __init__(
        self,
        config: MooncakeTierConfig,
        store_cls: type,
        tenant_kw: bool,
        runner: LaneRunner,
        arena_addr: int,
        arena_nbytes: int,
    ) -> None:
        self.config = config
        self.timeout_s = config.timeout_ms / 1000.0
        self._store_cls = store_cls
        self._tenant_kw = tenant_kw
        self._runner = runner
        self._arena_addr = arena_addr
        self._arena_nbytes = arena_nbytes
        self._lock = threading.Lock()
        self._state = TierState.CONNECTING
        self._state_cv = threading.Condition(self._lock)
        self.gate = Gate()
        self.breaker = CircuitBreaker(config.backoff_s)
        self.events = TierEvents()
        self._failed_setups: list[Any] = []
        """Clients whose setup failed: never touched again, never destroyed mid-run."""
        self._connect_deadline = 0.0
        """Monotonic time until which a first connect still in progress is waited for."""
        self._first_connect_failed = False
        self._stop = threading.Event()
        self._bg = threading.Thread(target=self._background, name="kvpack-mooncake-setup", daemon=True)

    def start(self) -> None:
        log.warning(
            "kvpack: Mooncake tier connecting to master %s (tenant %s) in the background; "
            "lookups and puts wait up to %d ms for it (connect_wait_ms), then it answers UNAVAILABLE until connected",
            self.config.master_server_address,
            self.config.tenant_id,
            self.config.connect_wait_ms,
        )
        self._connect_deadline = time.monotonic() + self.config.connect_wait_ms / 1000.0
        self._bg.start()

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> TierState:
        with self._lock:
            return self._state

    def wait_ready(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` until connected (for tests and tools, never the engine)."""
        deadline = time.monotonic() + timeout_s
        with self._state_cv:
            while self._state is TierState.CONNECTING:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._state_cv.wait(left)
            return self._state is TierState.READY

    def warming_up(self) -> bool:
        """The first connect is in progress and within ``connect_wait_ms`` of start-up:
        calls answer UNAVAILABLE now but should work soon. False once connected, once a
        connect attempt failed (an unreachable master is down, not warming up), and
        after the bound."""
        with self._lock:
            return (
                self._state is TierState.CONNECTING
                and not self._first_connect_failed
                and time.monotonic() < self._connect_deadline
            )

    def wait_warm(self) -> bool:
        """Block while `warming_up` (at most until ``connect_wait_ms`` after start-up;
        background threads only, never the engine's step). True when connected."""
        with self._state_cv:
            while self._state is TierState.CONNECTING and not self._first_connect_failed:
                left = self._connect_deadline - time.monotonic()
                if left <= 0:
                    break
                self._state_cv.wait(left)
            return self._state is TierState.READY

    def _first_attempt_failed(self) -> None:
        with self._state_cv:
            self._first_connect_failed = True
            self._state_cv.notify_all()

    def _set_state(self, state: TierState) -> None:
        with self._state_cv:
            if self._state is not TierState.CLOSED:
                self._state = state
            self._state_cv.notify_all()

    def refusal(self) -> TierStatus | None:
        """UNAVAILABLE when the tier must not be called now, else None."""
        if self.state is not TierState.READY or not self.breaker.allow():
            return TierStatus.UNAVAILABLE
        return None

    # -- connecting ------------------------------------------------------------------------

    def _background(self) -> None:
        """Connect (retrying every back-off period), then probe while the breaker is open."""
        cfg = self.config
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(cfg.setup_retries))
        warned = False
        while not self._stop.is_set():
            if not self._master_reachable():
                # Mooncake's setup holds the GIL while it retries a dead master
                # (seconds per attempt), which would freeze every engine thread.
                self._first_attempt_failed()
                if not warned:
                    log.warning(
                        "kvpack: Mooncake master %s is not reachable; retrying every %.1fs, "
                        "the tier stays UNAVAILABLE meanwhile",
                        cfg.master_server_address,
                        cfg.backoff_s,
                    )
                    warned = True
                self._stop.wait(max(cfg.backoff_s, 0.1))
                continue
            self.events.setup_attempts += 1
            store = self._store_cls()
            rc = self._setup(store)
            if self._stop.is_set():
                if rc == 0:  # closed while connecting: no other thread ever saw this client
                    store.close()
                return
            if rc == 0 and self.gate.open(store):
                self._register_arena(store)
                break
            self._failed_setups.append(store)
            self._first_attempt_failed()
            if not warned:
                log.warning(
                    "kvpack: Mooncake setup with master %s failed (code %s); retrying every %.1fs, "
                    "the tier stays UNAVAILABLE meanwhile",
                    cfg.master_server_address,
                    rc,
                    cfg.backoff_s,
                )
                warned = True
            self._stop.wait(max(cfg.backoff_s, 0.1))
        if self._stop.is_set():
            return
        self._check_tenant_loop()
        while not self._stop.wait(min(0.05 + cfg.backoff_s / 4, 0.5)):
            if self.breaker.due_for_probe():
                self._probe()

    def _master_reachable(self) -> bool:
        host, _, port = self.config.master_server_address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=0.5).close()
            return True
        except (OSError, ValueError):
            return False

    def _setup(self, store: Any) -> int:
        cfg = self.config
        args: dict[str, Any] = dict(
            local_hostname=cfg.local_hostname,
            metadata_server=cfg.metadata_server,
            global_segment_size=cfg.global_segment_size,
            local_buffer_size=cfg.local_buffer_size,
            protocol=cfg.protocol.value,
            rdma_devices=cfg.device_name if cfg.protocol is MooncakeProtocol.RDMA else "",
            master_server_addr=cfg.master_server_address,
        )
        if self._tenant_kw:
            args["tenant_id"] = cfg.tenant_id
        try:
            return int(store.setup(**args))
        except Exception as exc:
            log.warning("kvpack: Mooncake setup raised %r", exc)
            return -1

    def _register_arena(self, store: Any) -> None:
        rc = store.register_buffer(self._arena_addr, self._arena_nbytes)
        if rc != 0:
            log.warning("kvpack: registering kvpack's Mooncake staging arena failed (%s)", describe(rc))

    def _check_tenant_loop(self) -> None:
        """Probe that the master accepts our tenant (a tiny put, then removed)."""
        warned = False
        while not self._stop.is_set():
            rc = self._probe_put()
            if rc != TENANT_NOT_REGISTERED:
                self._set_state(TierState.READY)
                log.warning(
                    "kvpack: Mooncake tier connected to %s (tenant %s)",
                    self.config.master_server_address,
                    self.config.tenant_id,
                )
                return
            if not warned:
                log.error(
                    "kvpack: the Mooncake master rejects tenant %r (TENANT_NOT_REGISTERED): add it to the "
                    "master's tenant quota file; the Mooncake tier stays UNAVAILABLE until then",
                    self.config.tenant_id,
                )
                warned = True
            self._set_state(TierState.TENANT_REJECTED)
            self._stop.wait(max(self.config.backoff_s, 1.0))

    def _probe_put(self) -> int:
        store = self.gate.enter()
        if store is None:
            return -1
        try:
            key = f"{PROBE_KEY}/{uuid.uuid4().hex}"
            rc = int(store.batch_put_from([key], [self._arena_addr], [1])[0])
            if rc == 0:
                store.batch_remove([key])
            return rc
        finally:
            self.gate.leave()

    def _probe(self) -> None:
        """Off the engine's path: one cheap call; close the breaker if it answers."""
        job: Job[int] = Job(1, 1, self._probe_step)
        state, _, results = self._runner.run(job, max(self.timeout_s, 1.0))
        rc = results[0]
        if state is JobState.DONE and rc is not None and rc >= 0:
            self.breaker.record_success()
        else:
            self.breaker.rearm()

    def _probe_step(self, job: Job[int], slot: Slot, step: int) -> None:
        rc = self.call(lambda s: s.batch_is_exist([PROBE_KEY])[0], default=NOT_CALLED)
        job.publish(step, [0], [int(rc)])

    def close(self) -> bool:
        """Stop admitting calls, wait (bounded) for calls in flight, close the client.

        False when a call is still stuck in the client: it stays open (and the
        staging arena mapped, the caller must keep it), closing it would crash."""
        with self._state_cv:
            if self._state is TierState.CLOSED:
                return True
            self._state = TierState.CLOSED
            self._state_cv.notify_all()
        self._stop.set()
        self._runner.close(timeout_s=0.5)
        return self.gate.close_store(wait_s=5.0, before_close=lambda s: s.unregister_buffer(self._arena_addr))

    # -- calling ---------------------------------------------------------------------------

    def call(self, fn: Callable[[Any], Any], default: Any) -> Any:
        """`fn(client)` through the gate; `default` when the client is not open."""
        store = self.gate.enter()
        if store is None:
            return default
        try:
            return fn(store)
        finally:
            self.gate.leave()

    def run(self, job: Job[Any]) -> tuple[JobState, list[Any]]:
        """Run `job` on the workers, waiting at most `timeout_ms`; a stall opens the breaker."""
        state, started, results = self._runner.run(job, self.timeout_s)
        if state is JobState.ABANDONED:
            self.events.timeouts += 1
            if started > 0 and all(r is None for r in results):
                # A Mooncake call did not return within the bound: a stall.
                self.events.stalls += 1
                self.breaker.record_failure(f"no answer within {self.config.timeout_ms} ms")
            elif started == 0 and self.gate.oldest_call_s() >= self.timeout_s:
                # Never started: every worker is held by calls, one of them stuck past the
                # bound (a stopped segment holder blocks puts for as long as it is stopped).
                # Every later call would wait its full bound in the queue too: stop calling.
                self.events.stalls += 1
                self.breaker.record_failure(f"workers held by a call running over {self.config.timeout_ms} ms")
        return state, results

    def note_codes(self, codes: Sequence[int]) -> None:
        """Feed a call's return codes to the breaker: a connection-level failure opens it,
        any answer from the cluster (a success or a plain miss) closes it."""
        bad = next((c for c in codes if c < 0 and code_info(c).trips_breaker), None)
        if bad is not None:
            self.breaker.record_failure(describe(bad))
        elif any(c >= 0 for c in codes) or any(c == OBJECT_NOT_FOUND for c in codes):
            self.breaker.record_success()
