"""Mooncake tier: kvpack objects in a Mooncake distributed store, with bounded failure.

Several vLLM and SGLang instances share one prefix cache through a Mooncake
cluster: a ``mooncake_master`` (metadata only) and segments of memory that
clients contribute (a ``mooncake_client`` holder, or the engines themselves).

What this tier adds to ``MooncakeDistributedStore``:

- kvpack's object format. Each object is stored as header + payload
  (`kvpack.objects`) under ``StoreKey.as_str()``; every load decodes the
  header and checks it against the reader's `Expectation` (and the payload
  checksum when asked), and the byte count Mooncake reports must equal the
  header's. Mooncake's ``get`` (b'' for a miss and for any error alike) is
  never used.
- Named outcomes. Every Mooncake error code maps to one `TierStatus`
  (`MOONCAKE_CODES`): a miss, no space (or tenant quota), a transfer failure
  (ERROR), an RPC failure (UNAVAILABLE); the detail names the code.
- Safety. No data call is made before a successful ``setup`` or after
  ``close`` (Mooncake segfaults then): every call passes `_Gate`, which
  also makes `close` wait for calls in flight, and leaks rather than closes
  a store that a stuck call still uses.
- Bounded failure. Calls run on `LaneRunner` workers and the caller waits at
  most `timeout_ms` (see `kvpack.tiers.mooncake_runner`: one worker makes all
  Mooncake calls of a batch back to back from a two-slot ring, another stages
  the next step or checks and copies out the previous one meanwhile). A stall or a
  connection failure opens a circuit breaker: the tier answers UNAVAILABLE
  without calling Mooncake for `backoff_s`, a background probe closes the
  breaker when the master answers again (Mooncake's client reconnects by
  itself). Construction never blocks: ``setup`` runs in the background and
  the tier answers UNAVAILABLE until it has succeeded.
- Transfers go through a staging arena the tier owns and registers once:
  payloads are copied in (put) or out (get) with one memcpy per object, so
  a call abandoned at its deadline can never write into a caller's buffer
  afterwards, and RDMA never sees unregistered memory. Puts of
  content-addressed objects use ``batch_put_from`` (a put of an existing key
  is a cheap no-op); objects meant to be overwritten (partial-block tails,
  or a key whose stored object was refused) use ``batch_upsert_from``.
- Groups. With ``use_groups``, each object carries its kvpack group as its
  Mooncake group id (``ReplicateConfig.group_ids``), so members are leased
  and evicted together; members of one group that a batch could only partly
  store are removed again, so a group is present or absent as a whole.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import socket
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..config import MooncakeProtocol, MooncakeTierConfig
from ..errors import ConfigError
from ..keys import GroupKey, StoreKey
from ..objects import (
    FORMAT_VERSION,
    HEADER_PREFIX_BYTES,
    MAGIC,
    Expectation,
    ObjectHeader,
    ObjectRejected,
    Payload,
    RejectReason,
    check_header,
    copy_into_parts,
    decode_header,
    header_length,
    payload_checksum,
    payload_nbytes,
    payload_parts,
)
from .base import GetResult, PutItem, Tier, TierStatus, TierUsage
from .mooncake_runner import CircuitBreaker, Job, JobState, Lane, LaneRunner, Slot

log = logging.getLogger("kvpack")

# -- Mooncake error codes -----------------------------------------------------------


@dataclass(frozen=True)
class CodeInfo:
    name: str
    status: TierStatus
    trips_breaker: bool = False
    """A connection-level failure: stop calling for the back-off period."""


MOONCAKE_CODES: dict[int, CodeInfo] = {
    -1: CodeInfo("INTERNAL_ERROR", TierStatus.ERROR),
    -10: CodeInfo("BUFFER_OVERFLOW", TierStatus.ERROR),
    -100: CodeInfo("SHARD_INDEX_OUT_OF_RANGE", TierStatus.ERROR),
    -101: CodeInfo("SEGMENT_NOT_FOUND", TierStatus.ERROR),
    -102: CodeInfo("SEGMENT_ALREADY_EXISTS", TierStatus.ERROR),
    -103: CodeInfo("CLIENT_NOT_FOUND", TierStatus.UNAVAILABLE, True),
    -200: CodeInfo("NO_AVAILABLE_HANDLE", TierStatus.NO_SPACE),
    -300: CodeInfo("INVALID_VERSION", TierStatus.ERROR),
    -400: CodeInfo("INVALID_KEY", TierStatus.ERROR),
    -500: CodeInfo("WRITE_FAIL", TierStatus.ERROR),
    -600: CodeInfo("INVALID_PARAMS", TierStatus.ERROR),
    -601: CodeInfo("ILLEGAL_CLIENT", TierStatus.UNAVAILABLE, True),
    -700: CodeInfo("INVALID_WRITE", TierStatus.ERROR),
    -701: CodeInfo("INVALID_READ", TierStatus.ERROR),
    -702: CodeInfo("INVALID_REPLICA", TierStatus.ERROR),
    -703: CodeInfo("REPLICA_IS_NOT_READY", TierStatus.MISS),
    -704: CodeInfo("OBJECT_NOT_FOUND", TierStatus.MISS),
    -705: CodeInfo("OBJECT_ALREADY_EXISTS", TierStatus.OK),
    -706: CodeInfo("OBJECT_HAS_LEASE", TierStatus.ERROR),
    -707: CodeInfo("LEASE_EXPIRED", TierStatus.ERROR),
    -708: CodeInfo("OBJECT_HAS_REPLICATION_TASK", TierStatus.ERROR),
    -709: CodeInfo("OBJECT_NO_REPLICATION_TASK", TierStatus.ERROR),
    -710: CodeInfo("REPLICA_NOT_FOUND", TierStatus.MISS),
    -711: CodeInfo("REPLICA_ALREADY_EXISTS", TierStatus.ERROR),
    -712: CodeInfo("REPLICA_IS_GONE", TierStatus.MISS),
    -713: CodeInfo("REPLICA_NOT_IN_LOCAL_MEMORY", TierStatus.ERROR),
    -714: CodeInfo("OBJECT_REPLICA_BUSY", TierStatus.ERROR),
    -800: CodeInfo("TRANSFER_FAIL", TierStatus.ERROR),
    -801: CodeInfo("CHECKSUM_MISMATCH", TierStatus.REJECTED),
    -900: CodeInfo("RPC_FAIL", TierStatus.UNAVAILABLE, True),
    -901: CodeInfo("RPC_TIMEOUT", TierStatus.UNAVAILABLE, True),
    -1000: CodeInfo("ETCD_OPERATION_ERROR", TierStatus.UNAVAILABLE, True),
    -1010: CodeInfo("UNAVAILABLE_IN_CURRENT_STATUS", TierStatus.UNAVAILABLE, True),
    -1011: CodeInfo("UNAVAILABLE_IN_CURRENT_MODE", TierStatus.UNAVAILABLE, True),
    -1700: CodeInfo("TENANT_QUOTA_EXCEEDED", TierStatus.NO_SPACE),
    -1701: CodeInfo("TENANT_NOT_REGISTERED", TierStatus.UNAVAILABLE),
    -1702: CodeInfo("TENANT_NOT_EMPTY", TierStatus.ERROR),
}
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600
TENANT_NOT_REGISTERED = -1701


def code_info(code: int) -> CodeInfo:
    """The named outcome of a Mooncake return code (unknown negatives are ERROR)."""
    if code >= 0:
        return CodeInfo("OK", TierStatus.OK)
    return MOONCAKE_CODES.get(code, CodeInfo(f"UNKNOWN_{code}", TierStatus.ERROR))


def describe(code: int) -> str:
    return f"mooncake {code_info(code).name} ({code})"


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


def mooncake_binaries() -> tuple[str, str] | None:
    """Paths of (mooncake_master, mooncake_client) shipped in the installed
    Mooncake package, or None (used to start a local cluster: tests, soak, examples)."""
    try:
        import mooncake  # type: ignore[import-not-found]
    except ImportError:
        return None
    from pathlib import Path

    pkg = Path(mooncake.__file__).parent
    master, client = pkg / "mooncake_master", pkg / "mooncake_client"
    if not (master.is_file() and client.is_file()):
        return None
    return str(master), str(client)


def supports_tenants(store_cls: type) -> bool:
    """Whether ``setup`` of this Mooncake build accepts ``tenant_id``."""
    doc = getattr(getattr(store_cls, "setup", None), "__doc__", None) or ""
    return "tenant_id" in doc


def supports_groups(replicate_config_cls: type) -> bool:
    return hasattr(replicate_config_cls(), "group_ids")


# -- the gate: no data call before setup or after close ---------------------------------


class _Gate:
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
        with self._cv:
            if self._closed:
                return False
            self._store = store
            return True

    @property
    def is_open(self) -> bool:
        with self._cv:
            return self._store is not None and not self._closed

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


# -- the tier ------------------------------------------------------------------------------


class TierState:
    CONNECTING = "connecting"
    READY = "ready"
    TENANT_REJECTED = "tenant_rejected"
    CLOSED = "closed"


_ALIGN = 64
_PEEK_BYTES = 4096
_STEP_MAX_BYTES = 16 << 20
"""Target bytes a sub-batch (one Mooncake call) moves: a large healthy batch
shows progress well inside the deadline (not mistaken for a stall). Measured
on loopback (benchmarks/RESULTS.md): 4 and 8 MiB steps were slower than 16 MiB
(more calls), 64 MiB no faster."""
_SLOTS = 2
"""Ring slots per job: the leader transfers one while a helper prepares the next
(put) or checks and copies out the previous one (get)."""
_DIRECT_MIN_BYTES = 256 << 10
"""Payloads this large are put straight from the caller's regions (TCP):
Mooncake gathers [header in the lane, payload regions] itself, no staging
copy. Smaller ones are staged: Mooncake's per-buffer cost exceeds a memcpy."""
_PROBE_KEY = "kvpack/__probe__"
_INTEGRITY_REASONS = {
    # The key names tenant, layout, chunk and member: an object under it that
    # disagrees, or is damaged, is garbage, and the next put replaces it.
    RejectReason.FINGERPRINT,
    RejectReason.TENANT,
    RejectReason.GROUP,
    RejectReason.MEMBER,
    RejectReason.TRUNCATED,
    RejectReason.BAD_MAGIC,
    RejectReason.VERSION,
    RejectReason.HEADER_CHECKSUM,
    RejectReason.LENGTH,
    RejectReason.CHECKSUM,
}


_HEAD = struct.Struct("<4sHHIIQQ16s")
_U32 = struct.Struct("<I")
assert _HEAD.size == HEADER_PREFIX_BYTES, "kvpack.objects header layout changed"


class _Prep:
    """One object of a put, ready for a step: encoded header, payload regions, route."""

    __slots__ = ("key", "name", "header", "hdr", "hdr_len", "parts", "nbytes", "upsert", "direct")

    def __init__(self, key: StoreKey, name: str, header: ObjectHeader, parts: tuple[memoryview, ...], nbytes: int, upsert: bool, direct: bool) -> None:
        self.key = key
        self.name = name
        self.header = header
        self.hdr = b""
        self.hdr_len = _encoded_len(header)
        self.parts = parts
        self.nbytes = nbytes
        self.upsert = upsert
        self.direct = direct

    def encode(self) -> bool:
        """Checksum the payload (unless the header has it: one pass at most) and
        encode the header; False if it cannot be encoded as planned."""
        h = self.header
        try:
            if h.checksum is None:
                parts = self.parts
                csum = xxhash.xxh3_64_intdigest(parts[0]) if len(parts) == 1 else payload_checksum(parts)
                h = ObjectHeader(h.fingerprint, h.tenant, h.chunk, h.member, h.token_count, h.payload_len, csum, h.token_ids, h.version)
            self.hdr = h.encode()
        except (ValueError, OverflowError, struct.error) as exc:
            log.warning("kvpack: Mooncake put of %s skipped: %s", self.name, exc)
            return False
        return len(self.hdr) == self.hdr_len


def _encoded_len(h: ObjectHeader) -> int:
    """Bytes of `h.encode()` (see the layout in kvpack.objects)."""
    n = HEADER_PREFIX_BYTES + 3 + len(h.tenant.encode()) + len(h.chunk.encode()) + len(h.member.encode()) + _U32.size
    if h.token_ids is not None:
        n += _U32.size + 4 * len(h.token_ids)
    return n


class _FastHeaders:
    """The common case of a load, checked without a full decode.

    Accepts a staged object only when every header byte is the one `exp`
    predicts (magic, version, no token ids, token count, payload length,
    fingerprint, tenant, chunk, member), the byte count is header + payload,
    and the header's own xxh32 matches; the payload checksum is read from it.
    Anything else returns None and goes through `decode_header` +
    `check_header`, which name the exact reason. Never accepts what the full
    decode would refuse."""

    __slots__ = ("_fp", "_strs")

    def __init__(self) -> None:
        self._fp: dict[str, bytes | None] = {}
        self._strs: dict[str, bytes] = {}

    def _short(self, s: str) -> bytes:
        enc = self._strs.get(s)
        if enc is None:
            raw = s.encode()
            enc = bytes((len(raw),)) + raw if len(raw) <= 255 else b"\xff" * 300  # never matches
            self._strs[s] = enc
        return enc

    def check(self, raw: memoryview, n: int, exp: Expectation) -> tuple[ObjectHeader, int] | None:
        if exp.token_ids_prefix is not None or exp.token_count is None or exp.payload_len is None or n < HEADER_PREFIX_BYTES:
            return None
        magic, version, hl, flags, tc, plen, csum, fp = _HEAD.unpack_from(raw, 0)
        if magic != MAGIC or version != FORMAT_VERSION or flags or tc != exp.token_count or plen != exp.payload_len or n != hl + plen:
            return None
        want_fp = self._fp.get(exp.fingerprint, b"")
        if want_fp == b"":
            try:
                want_fp = bytes.fromhex(exp.fingerprint)
            except ValueError:
                want_fp = None
            if want_fp is not None and want_fp.hex() != exp.fingerprint:
                want_fp = None  # decode_header would compare the lower-case hex
            self._fp[exp.fingerprint] = want_fp
        if fp != want_fp:
            return None
        tail = self._short(exp.tenant) + self._short(exp.chunk) + self._short(exp.member)
        body_end = hl - _U32.size
        if body_end != HEADER_PREFIX_BYTES + len(tail) or raw[HEADER_PREFIX_BYTES:body_end].tobytes() != tail:
            return None
        if xxhash.xxh32_intdigest(raw[:body_end]) != _U32.unpack_from(raw, body_end)[0]:
            return None
        return ObjectHeader(exp.fingerprint, exp.tenant, exp.chunk, exp.member, tc, plen, csum), hl


def _address(buf: memoryview) -> int:
    """Address of a contiguous buffer (cheap for writable ones)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError, BufferError):
        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _copy_from(dst_addr: int, part: memoryview) -> None:
    if part.nbytes:
        ctypes.memmove(dst_addr, _address(part), part.nbytes)


def _copy_out(dst: Payload, staged: Any, src_addr: int, header_len: int, n: int) -> None:
    """Copy a staged payload (at `src_addr`) into the caller's regions, in order."""
    parts = (dst,) if isinstance(dst, memoryview) else dst
    try:
        addrs = [ctypes.addressof(ctypes.c_char.from_buffer(p)) if p.nbytes else 0 for p in parts]
    except (TypeError, ValueError, BufferError):  # not a plain writable buffer: the general copy
        copy_into_parts(dst, np.asarray(staged)[header_len:n])
        return
    for p, a in zip(parts, addrs):
        nb = p.nbytes
        if nb:
            ctypes.memmove(a, src_addr, nb)
        src_addr += nb


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_steps(slot_budgets: Sequence[int], xfer_bytes: Sequence[int], slot_cap: int, step_bytes: int) -> list[list[int]]:
    """Split items (in order) into steps whose staging fits one slot of `slot_cap`
    bytes and whose transfers are about `step_bytes` each (even steps, up to a
    quarter over the target: 64 MiB of 64 KiB objects plus headers in 8 MiB
    steps is 8 calls, not 8 full ones and a tiny ninth). An item larger than a
    slot is a step of its own (it gets a private buffer)."""
    total = sum(xfer_bytes)
    parts = max(round(total / step_bytes), 1)
    if total > parts * step_bytes * 5 // 4:
        parts += 1
    step_cap = -(-total // parts) + max(xfer_bytes, default=0)
    steps: list[list[int]] = []
    cur: list[int] = []
    used = moved = 0
    for i, (b, x) in enumerate(zip(slot_budgets, xfer_bytes)):
        if cur and (used + b > slot_cap or moved + x > step_cap):
            steps.append(cur)
            cur, used, moved = [], 0, 0
        cur.append(i)
        used += b
        moved += x
    if cur:
        steps.append(cur)
    return steps


@dataclass
class _PutStep:
    """One put step, staged by `prepare` and consumed by `transfer`.

    `kept` (item indices) line up with `preps`, `buffers` and `sizes` (the
    address and byte count lists Mooncake gets) and `groups` (Mooncake group
    ids, None without groups); `dropped` items could not be encoded (ERROR)."""

    kept: list[int]
    dropped: list[int]
    preps: list[_Prep]
    buffers: list[list[int]]
    sizes: list[list[int]]
    groups: list[str] | None


def _expected_header_len(exp: Expectation) -> int:
    """Header bytes of an object matching `exp` (an estimate when token ids are stored)."""
    n = HEADER_PREFIX_BYTES + 3 + len(exp.tenant.encode()) + len(exp.chunk.encode()) + len(exp.member.encode()) + 4
    tokens = max(exp.token_count or 0, len(exp.token_ids_prefix or ()))
    if exp.token_ids_prefix is not None or tokens:
        n += 4 + 4 * tokens
    return n


class MooncakeTier(Tier):
    """See the module docstring."""

    name = "mooncake"
    remote = True

    def __init__(self, config: MooncakeTierConfig, *, wait_ready_s: float = 0.0) -> None:
        self.config = config.resolved()
        cfg = self.config
        self._store_cls, self._replicate_cls = load_mooncake()
        self._tenant_kw = supports_tenants(self._store_cls)
        if cfg.tenant_id != "default" and not self._tenant_kw:
            raise ConfigError(
                "mooncake.tenant_id",
                f"tenant {cfg.tenant_id!r} configured, but the installed Mooncake has no tenant support "
                "(setup() takes no tenant_id); upgrade mooncake-transfer-engine or use tenant 'default'",
            )
        self._groups = cfg.use_groups and supports_groups(self._replicate_cls)
        if cfg.use_groups and not self._groups:
            log.warning("kvpack: the installed Mooncake has no ReplicateConfig.group_ids; groups are not leased together")
        self._timeout_s = cfg.timeout_ms / 1000.0
        self._lock = threading.Lock()
        self._state = TierState.CONNECTING
        self._state_cv = threading.Condition(self._lock)
        self._gate = _Gate()
        self.breaker = CircuitBreaker(cfg.backoff_s)
        self._overwrite: OrderedDict[str, None] = OrderedDict()
        """Keys whose stored object was refused: their next put overwrites."""
        self._failed_setups: list[Any] = []
        self._stop = threading.Event()
        self.counters: dict[str, int] = {"timeouts": 0, "stalls": 0, "abandoned_puts_removed": 0, "setup_attempts": 0}

        # Staging arena (page-aligned, registered with Mooncake after setup), one lane per worker.
        lane_bytes = cfg.staging_size // cfg.workers // _ALIGN * _ALIGN
        self._arena_map = mmap.mmap(-1, lane_bytes * cfg.workers)
        self._arena = np.frombuffer(self._arena_map, dtype=np.uint8)
        self._arena_addr = self._arena.ctypes.data
        lanes = [
            Lane(i, self._arena[i * lane_bytes : (i + 1) * lane_bytes], self._arena_addr + i * lane_bytes)
            for i in range(cfg.workers)
        ]
        self._lane_bytes = lane_bytes
        self._direct_put = cfg.protocol is MooncakeProtocol.TCP and hasattr(self._store_cls, "batch_put_from_multi_buffers")
        """RDMA needs registered memory: there every payload goes through the arena."""
        self._runner = LaneRunner(cfg.workers, lanes, max_queued=max(16, 8 * cfg.workers))

        log.warning(
            "kvpack: Mooncake tier connecting to master %s (tenant %s) in the background; "
            "it answers UNAVAILABLE until connected",
            cfg.master_server_address,
            cfg.tenant_id,
        )
        self._bg = threading.Thread(target=self._background, name="kvpack-mooncake-setup", daemon=True)
        self._bg.start()
        if wait_ready_s > 0:
            self.wait_ready(wait_ready_s)

    # -- lifecycle -------------------------------------------------------------------

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    @property
    def available(self) -> bool:
        """Connected, tenant accepted, and the circuit breaker closed."""
        return self.state == TierState.READY and self.breaker.allow()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` until connected (for tests and tools, never the engine)."""
        deadline = time.monotonic() + timeout_s
        with self._state_cv:
            while self._state == TierState.CONNECTING:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._state_cv.wait(left)
            return self._state == TierState.READY

    def _set_state(self, state: str) -> None:
        with self._state_cv:
            if self._state != TierState.CLOSED:
                self._state = state
            self._state_cv.notify_all()

    def _background(self) -> None:
        """Connect (retrying every back-off period), then probe while the breaker is open."""
        cfg = self.config
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(cfg.setup_retries))
        warned = False
        while not self._stop.is_set():
            if not self._master_reachable():
                # Mooncake's setup holds the GIL while it retries a dead master
                # (~4 s per attempt), which would freeze every engine thread.
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
            self.counters["setup_attempts"] += 1
            store = self._store_cls()
            rc = self._setup(store)
            if self._stop.is_set():
                if rc == 0:  # closed while connecting: no other thread ever saw this client
                    store.close()
                return
            if rc == 0 and self._gate.open(store):
                self._register_arena(store)
                break
            self._failed_setups.append(store)  # never touched again, never destroyed mid-run
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
        while not self._stop.wait(min(0.05 + self.config.backoff_s / 4, 0.5)):
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
        rc = store.register_buffer(self._arena_addr, self._arena.nbytes)
        if rc != 0:
            log.warning("kvpack: registering kvpack's Mooncake staging arena failed (%s)", describe(rc))

    def _check_tenant_loop(self) -> None:
        """Probe that the master accepts our tenant (a tiny put, then removed)."""
        warned = False
        while not self._stop.is_set():
            rc = self._probe_put()
            if rc != TENANT_NOT_REGISTERED:
                self._set_state(TierState.READY)
                log.warning("kvpack: Mooncake tier connected to %s (tenant %s)", self.config.master_server_address, self.config.tenant_id)
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
        store = self._gate.enter()
        if store is None:
            return -1
        try:
            key = f"{_PROBE_KEY}/{uuid.uuid4().hex}"
            rc = int(store.batch_put_from([key], [self._arena_addr], [1])[0])
            if rc == 0:
                store.batch_remove([key])
            return rc
        finally:
            self._gate.leave()

    def _probe(self) -> None:
        """Off the engine's path: one cheap call; close the breaker if it answers."""
        job: Job[int] = Job(1, 1, self._probe_step)
        state, _, results = self._runner.run(job, max(self._timeout_s, 1.0))
        rc = results[0]
        if state is JobState.DONE and rc is not None and rc >= 0:
            self.breaker.record_success()
        else:
            self.breaker.rearm()

    def _probe_step(self, job: Job[int], slot: Slot, step: int) -> None:
        rc = self._call(lambda s: s.batch_is_exist([_PROBE_KEY])[0], default=-900)
        job.publish(step, [0], [int(rc)])

    def close(self) -> None:
        """Stop admitting calls, wait (bounded) for calls in flight, close the client."""
        with self._state_cv:
            if self._state == TierState.CLOSED:
                return
            self._state = TierState.CLOSED
            self._state_cv.notify_all()
        self._stop.set()
        self._runner.close(timeout_s=0.5)
        closed = self._gate.close_store(wait_s=5.0, before_close=lambda s: s.unregister_buffer(self._arena_addr))
        if not closed:
            return  # the arena stays mapped: a stuck call may still use it

    # -- calling Mooncake ------------------------------------------------------------------

    def _call(self, fn: Callable[[Any], Any], default: Any) -> Any:
        store = self._gate.enter()
        if store is None:
            return default
        try:
            return fn(store)
        finally:
            self._gate.leave()

    def _refusal(self) -> TierStatus | None:
        """UNAVAILABLE when the tier must not be called now, else None."""
        if self.state != TierState.READY or not self.breaker.allow():
            return TierStatus.UNAVAILABLE
        return None

    def _run(self, job: Job[Any]) -> tuple[JobState, list[Any]]:
        state, started, results = self._runner.run(job, self._timeout_s)
        if state is JobState.ABANDONED:
            self.counters["timeouts"] += 1
            if started > 0 and all(r is None for r in results):
                # A Mooncake call did not return within the bound: a stall.
                self.counters["stalls"] += 1
                self.breaker.record_failure(f"no answer within {self.config.timeout_ms} ms")
            elif started == 0 and self._gate.oldest_call_s() >= self._timeout_s:
                # Never started: every worker is held by calls, one of them stuck past the
                # bound (a stopped segment holder blocks puts for as long as it is stopped).
                # Every later call would wait its full bound in the queue too: stop calling.
                self.counters["stalls"] += 1
                self.breaker.record_failure(f"workers held by a call running over {self.config.timeout_ms} ms")
        return state, results

    def _note_codes(self, codes: Sequence[int]) -> None:
        bad = next((c for c in codes if c < 0 and code_info(c).trips_breaker), None)
        if bad is not None:
            self.breaker.record_failure(describe(bad))
        elif any(c >= 0 for c in codes) or any(c == OBJECT_NOT_FOUND for c in codes):
            self.breaker.record_success()

    # -- reads -------------------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        if not keys or self._refusal() is not None:
            return [False] * len(keys)
        names = [k.as_str() for k in keys]

        def step(job: Job[list[int]], slot: Slot, i: int) -> None:
            codes = self._call(lambda s: list(s.batch_is_exist(names)), default=[-900] * len(names))
            job.publish(i, [0], [codes])

        state, results = self._run(Job(1, 1, step))
        codes = results[0]
        if codes is None or len(codes) != len(keys):
            return [False] * len(keys)
        self._note_codes(codes)
        return [c == 1 for c in codes]

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        if not keys or self._refusal() is not None:
            return [None] * len(keys)
        names = [k.as_str() for k in keys]
        n = len(names)

        def step(job: Job[ObjectHeader | None], slot: Slot, i: int) -> None:
            job.publish(i, list(range(n)), self._peek_on_worker(names, slot))

        state, results = self._run(Job(n, 1, step))
        return [r for r in results]

    def _peek_on_worker(self, names: list[str], lane: Slot) -> list[ObjectHeader | None]:
        out: list[ObjectHeader | None] = [None] * len(names)
        sizes = [int(self._call(lambda s, k=k: s.get_size(k), default=-900)) for k in names]
        self._note_codes(sizes)
        todo = [i for i, sz in enumerate(sizes) if sz >= HEADER_PREFIX_BYTES]
        slot = _PEEK_BYTES
        todo = todo[: max(1, self._lane_bytes // slot)]
        for _ in range(2):  # second round for headers longer than the first read
            if not todo:
                break
            want = [min(sizes[i], slot) for i in todo]
            rc = self._call(
                lambda s: s.get_into_ranges(
                    [lane.address],
                    [[names[i] for i in todo]],
                    [[[j * slot] for j in range(len(todo))]],
                    [[[0] for _ in todo]],
                    [[[w] for w in want]],
                ),
                default=None,
            )
            if rc is None:
                return out
            retry: list[int] = []
            for j, i in enumerate(todo):
                got = rc[0][j][0]
                if got < 0:
                    continue
                raw = lane.view[j * slot : j * slot + got]
                try:
                    out[i] = decode_header(bytes(raw))
                except ObjectRejected as exc:
                    if exc.reason is RejectReason.TRUNCATED and got < sizes[i]:
                        retry.append(i)
            todo = retry
            slot = min(self._lane_bytes // max(1, len(todo)) // _ALIGN * _ALIGN, 64 << 10) if todo else slot
        return out

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        if not keys:
            return []
        refused = self._refusal()
        if refused is not None:
            return [GetResult(refused, detail="mooncake tier not available") for _ in keys]
        names = [k.as_str() for k in keys]
        budgets = [_round_up(payload_nbytes(d) + _expected_header_len(e)) for d, e in zip(dsts, expected)]
        slot_bytes = self._slot_bytes(budgets)
        steps = plan_steps(budgets, budgets, slot_bytes, _STEP_MAX_BYTES)
        staged: dict[int, tuple[list[Any], list[int], list[int]]] = {}
        """Per step, from its transfer to its finish: staging views, addresses, byte counts."""

        def transfer(job: Job[GetResult], slot: Slot, s: int) -> None:
            staged[s] = self._get_transfer(slot, steps[s], names, budgets)

        def finish(job: Job[GetResult], slot: Slot, s: int) -> None:
            views, addrs, got = staged.pop(s)
            self._get_finish(job, s, steps[s], views, addrs, got, dsts, expected, verify_checksum)

        job: Job[GetResult] = Job(len(keys), len(steps), transfer, finish=finish, slots=_SLOTS, slot_bytes=slot_bytes)
        state, results = self._run(job)
        out = [r if r is not None else GetResult(TierStatus.TIMEOUT, detail=f"no answer within {self.config.timeout_ms} ms") for r in results]
        for key, res in zip(names, out):
            if res.status is TierStatus.REJECTED and res.reason in _INTEGRITY_REASONS:
                self._mark_overwrite(key)
        return out

    def _slot_bytes(self, budgets: Sequence[int]) -> int:
        """Bytes of each ring slot for a call: a step's worth, or the largest object, within a lane."""
        want = max(_STEP_MAX_BYTES + _STEP_MAX_BYTES // 4, max(budgets, default=0))
        return min(want, self._lane_bytes // _SLOTS) // _ALIGN * _ALIGN

    @staticmethod
    def _buffers(slot: Slot, idx: list[int], budgets: Sequence[int]) -> tuple[list[Any], list[int]]:
        """Per item of a step: a staging view and its address (own buffer if larger than the slot)."""
        views: list[Any] = []
        addrs: list[int] = []
        off = 0
        cap = slot.view.nbytes
        view, base = slot.view, slot.address
        for i in idx:
            b = budgets[i]
            if off + b <= cap:
                views.append(view[off : off + b])
                addrs.append(base + off)
                off += b
            else:  # larger than a whole slot: a private buffer (TCP only; RDMA would need registration)
                own = np.empty(b, dtype=np.uint8)
                views.append(own)
                addrs.append(own.ctypes.data)
        return views, addrs

    def _get_transfer(self, slot: Slot, idx: list[int], names: list[str], budgets: Sequence[int]) -> tuple[list[Any], list[int], list[int]]:
        """The Mooncake calls of one get step, into its slot: (views, addresses, codes or byte counts)."""
        views, addrs = self._buffers(slot, idx, budgets)
        step_names = [names[i] for i in idx]
        got = self._call(
            lambda s: list(s.batch_get_into(step_names, addrs, [budgets[i] for i in idx])),
            default=[-900] * len(idx),
        )
        # Objects larger than the budget (tails with more token ids): once more at their exact size.
        small = [j for j, g in enumerate(got) if g == INVALID_PARAMS]
        for j in small:
            size = int(self._call(lambda s: s.get_size(step_names[j]), default=-900))
            if 0 < size <= budgets[idx[j]] + (64 << 10):
                own = np.empty(size, dtype=np.uint8)
                views[j] = own
                addrs[j] = own.ctypes.data
                got[j] = int(self._call(lambda s: s.batch_get_into([step_names[j]], [own.ctypes.data], [size])[0], default=-900))
        self._note_codes(got)
        return views, addrs, got

    def _get_finish(
        self,
        job: Job[GetResult],
        step: int,
        idx: list[int],
        views: list[Any],
        addrs: list[int],
        got: list[int],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify: bool,
    ) -> None:
        """Check every staged object of a step, copy the accepted ones out, publish."""
        # Every check runs on the staged bytes, before any caller memory is touched.
        fast = _FastHeaders()
        results: list[GetResult] = []
        copies: list[tuple[int, int]] = []  # (position in step, payload offset in its staging view)
        for j, i in enumerate(idx):
            res, header_len = self._check_staged(got[j], views[j], dsts[i], expected[i], verify, fast)
            results.append(res)
            if res.status is TierStatus.OK:
                copies.append((j, header_len))
        if copies:
            if not job.begin_copy():
                return  # the caller gave up: caller buffers are not ours any more
            try:
                for j, header_len in copies:
                    _copy_out(dsts[idx[j]], views[j], addrs[j] + header_len, header_len, got[j])
            finally:
                job.end_copy()
        job.publish(step, idx, results)

    @staticmethod
    def _check_staged(n: int, staged: Any, dst: Payload, exp: Expectation, verify: bool, fast: _FastHeaders) -> tuple[GetResult, int]:
        """The outcome of one staged object (OK: its payload may be copied out) and its header length."""
        if n < 0:
            info = code_info(n)
            if n == INVALID_PARAMS:
                return GetResult(TierStatus.REJECTED, None, RejectReason.LENGTH, "object larger than its destination"), 0
            if info.status is TierStatus.REJECTED:
                return GetResult(TierStatus.REJECTED, None, RejectReason.CHECKSUM, describe(n)), 0
            return GetResult(info.status, detail=describe(n)), 0
        raw = memoryview(staged)[:n]
        hit = fast.check(raw, n, exp)
        if hit is not None:
            header, header_len = hit
        else:  # the full decode: names the exact reason when something differs
            try:
                header = decode_header(raw)
            except ObjectRejected as exc:
                return GetResult(TierStatus.REJECTED, None, exc.reason, str(exc)), 0
            reason = check_header(header, exp)
            if reason is not None:
                return GetResult(TierStatus.REJECTED, header, reason), 0
            header_len = header_length(raw)
            if n != header_len + header.payload_len:
                return GetResult(TierStatus.REJECTED, header, RejectReason.TRUNCATED, f"{n} bytes for a {header.payload_len}-byte payload"), 0
        if payload_nbytes(dst) != header.payload_len:
            return (
                GetResult(TierStatus.REJECTED, header, RejectReason.LENGTH, f"payload {header.payload_len} bytes, destination {payload_nbytes(dst)}"),
                0,
            )
        if verify and header.checksum is not None and xxhash.xxh3_64_intdigest(raw[header_len:]) != header.checksum:
            return GetResult(TierStatus.REJECTED, header, RejectReason.CHECKSUM), 0
        return GetResult(TierStatus.OK, header), header_len

    # -- writes ------------------------------------------------------------------------

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        if not items:
            return []
        refused = self._refusal()
        if refused is not None:
            return [refused] * len(items)
        direct_ok = self._direct_put
        with self._lock:
            overwrite = set(self._overwrite) if self._overwrite else None
        prepared: list[_Prep | None] = []
        for item in items:
            h = item.header
            parts = payload_parts(item.payload)
            nbytes = parts[0].nbytes if len(parts) == 1 else sum(p.nbytes for p in parts)
            if nbytes != h.payload_len:
                prepared.append(None)
                continue
            name = item.key.as_str()
            upsert = h.token_ids is not None or (overwrite is not None and name in overwrite)
            direct = direct_ok and not upsert and nbytes >= _DIRECT_MIN_BYTES
            prepared.append(_Prep(item.key, name, h, parts, nbytes, upsert, direct))
        todo = [i for i, p in enumerate(prepared) if p is not None]
        # Checksums and headers are made step by step, while the previous step
        # transfers; the plan only needs the header lengths.
        lane_budgets = [_round_up(p.hdr_len + (0 if p.direct else p.nbytes)) if p else 0 for p in prepared]
        xfer = [p.hdr_len + p.nbytes if p else 0 for p in prepared]
        slot_bytes = self._slot_bytes([lane_budgets[i] for i in todo])
        plan = plan_steps([lane_budgets[i] for i in todo], [xfer[i] for i in todo], slot_bytes, _STEP_MAX_BYTES)
        steps = [[todo[k] for k in step] for step in plan]
        staged: dict[int, _PutStep] = {}
        statuses: list[TierStatus] = [TierStatus.ERROR] * len(items)

        def prepare(job: Job[TierStatus], slot: Slot, s: int) -> None:
            staged[s] = self._put_prepare(slot, steps[s], prepared, lane_budgets)

        def transfer(job: Job[TierStatus], slot: Slot, s: int) -> None:
            self._put_transfer(job, s, staged.pop(s))

        def undo(job: Job[TierStatus], s: int) -> None:
            # The caller answered TIMEOUT for this step: whatever Mooncake stored must go again.
            keys = [p.name for p in (prepared[i] for i in steps[s]) if p is not None]
            self._call(lambda st: st.batch_remove(keys), default=None)
            self.counters["abandoned_puts_removed"] += len(keys)

        job: Job[TierStatus] = Job(len(items), len(steps), transfer, prepare=prepare, on_abandoned=undo, slots=_SLOTS, slot_bytes=slot_bytes)
        state, results = self._run(job)
        for i in todo:
            r = results[i]
            statuses[i] = r if r is not None else TierStatus.TIMEOUT
        return statuses

    def _put_prepare(self, slot: Slot, idx: list[int], prepared: list[_Prep | None], lane_budgets: Sequence[int]) -> _PutStep:
        """Stage one put step in its slot: checksums, headers, payload copies (no Mooncake call)."""
        preps: list[_Prep] = []
        dropped: list[int] = []
        kept: list[int] = []
        for i in idx:
            p = prepared[i]
            if p is not None and p.encode():
                preps.append(p)
                kept.append(i)
            else:
                dropped.append(i)  # a header that cannot be encoded: ERROR, never stored
        views, addrs = self._buffers(slot, kept, lane_budgets)
        # Staged objects: header + payload copied into the slot (one buffer each).
        # Direct objects: header in the slot, payload read in place from the caller's regions.
        buffers: list[list[int]] = []
        sizes: list[list[int]] = []
        memmove = ctypes.memmove
        for p, a in zip(preps, addrs):
            hl = p.hdr_len
            memmove(a, p.hdr, hl)
            if p.direct:
                buffers.append([a, *(_address(part) for part in p.parts)])
                sizes.append([hl, *(part.nbytes for part in p.parts)])
            else:
                off = a + hl
                for part in p.parts:
                    nb = part.nbytes
                    if nb:
                        memmove(off, _address(part), nb)
                    off += nb
                buffers.append([a])
                sizes.append([hl + p.nbytes])
        groups = [p.name[: p.name.rfind("/")] for p in preps] if self._groups else None
        return _PutStep(kept, dropped, preps, buffers, sizes, groups)

    def _put_transfer(self, job: Job[TierStatus], step: int, st: _PutStep) -> None:
        """The Mooncake calls of one staged put step; publishes its statuses."""
        preps, buffers, sizes = st.preps, st.buffers, st.sizes
        names = [p.name for p in preps]
        codes = [0] * len(preps)
        # One call for all plain puts of the step (with any direct object among them,
        # the multi-buffer call carries the staged ones too): a group's members are
        # stored, or refused for space, together. Upserts (staged) go in a second call.
        gather = any(p.direct for p in preps)
        any_upsert = any(p.upsert for p in preps)
        for mode in ("put", "upsert"):
            if not any_upsert:
                sel = list(range(len(preps))) if mode == "put" else []
            else:
                sel = [j for j, p in enumerate(preps) if p.upsert is (mode == "upsert")]
            if not sel:
                continue
            cfg = self._replicate_config(st.groups, sel)
            sel_names = names if len(sel) == len(names) else [names[j] for j in sel]
            if mode == "put" and gather:
                call: Callable[[Any], Any] = lambda s: s.batch_put_from_multi_buffers(sel_names, [buffers[j] for j in sel], [sizes[j] for j in sel], cfg)
            else:
                fn = "batch_upsert_from" if mode == "upsert" else "batch_put_from"
                call = lambda s: getattr(s, fn)(sel_names, [buffers[j][0] for j in sel], [sizes[j][0] for j in sel], cfg)
            got = self._call(lambda s: list(call(s)), default=[-900] * len(sel))
            for j, c in zip(sel, got):
                codes[j] = int(c)
        # Mooncake refuses an upsert that would change an object's group membership
        # (e.g. a foreign or pre-groups object under our key): replace it instead.
        stuck = [j for j in range(len(preps)) if preps[j].upsert and codes[j] == INVALID_PARAMS] if any_upsert else []
        if stuck:
            cfg = self._replicate_config(st.groups, stuck)
            self._call(lambda s: s.batch_remove([names[j] for j in stuck], True), default=None)
            got = self._call(
                lambda s: list(s.batch_put_from([names[j] for j in stuck], [buffers[j][0] for j in stuck], [sizes[j][0] for j in stuck], cfg)),
                default=[-900] * len(stuck),
            )
            for j, c in zip(stuck, got):
                codes[j] = int(c)
        self._note_codes(codes)
        if all(c == 0 for c in codes):
            statuses = [TierStatus.OK] * len(codes)
        else:
            statuses = [code_info(c).status for c in codes]
            if self._groups:
                self._roll_back_partial_groups([p.key for p in preps], statuses)
        if any_upsert:
            for j, n in enumerate(names):
                if statuses[j] is TierStatus.OK and preps[j].upsert:
                    self._overwrite_done(n)
        job.publish(step, st.kept + st.dropped, statuses + [TierStatus.ERROR] * len(st.dropped))

    def _replicate_config(self, groups: list[str] | None, sel: Sequence[int]) -> Any:
        cfg = self._replicate_cls()
        cfg.replica_num = self.config.replica_num
        if groups is not None:
            cfg.group_ids = groups if len(sel) == len(groups) else [groups[j] for j in sel]
        return cfg

    def _roll_back_partial_groups(self, keys: list[StoreKey], statuses: list[TierStatus]) -> None:
        """Members of a group this batch stored only in part are removed again."""
        by_group: dict[GroupKey, list[int]] = {}
        for j, k in enumerate(keys):
            by_group.setdefault(k.group, []).append(j)
        undo: list[int] = []
        for members in by_group.values():
            failed = [j for j in members if statuses[j] is not TierStatus.OK]
            if failed and len(failed) < len(members):
                undo.extend(j for j in members if statuses[j] is TierStatus.OK)
                worst = statuses[failed[0]]
                for j in members:
                    statuses[j] = worst
        if undo:
            names = [keys[j].as_str() for j in undo]
            self._call(lambda s: s.batch_remove(names), default=None)

    def _mark_overwrite(self, key: str) -> None:
        with self._lock:
            self._overwrite[key] = None
            self._overwrite.move_to_end(key)
            while len(self._overwrite) > 4096:
                self._overwrite.popitem(last=False)

    def _wants_overwrite(self, key: str) -> bool:
        with self._lock:
            return key in self._overwrite

    def _overwrite_done(self, key: str) -> None:
        with self._lock:
            self._overwrite.pop(key, None)

    # -- removal and usage -------------------------------------------------------------------

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        """Remove every member of each group (one regex call per 64 groups).

        Forced: Mooncake leases an object to every reader for seconds, and an
        unforced remove of a leased object is refused. A reader racing with
        the removal can at worst receive bytes that fail kvpack's header and
        checksum checks (REJECTED), never wrong data accepted as right."""
        if not groups or self._refusal() is not None:
            return 0
        batches = [groups[i : i + 64] for i in range(0, len(groups), 64)]

        def step(job: Job[int], slot: Slot, s: int) -> None:
            pattern = "^(" + "|".join(re.escape(g.as_str() + "/") for g in batches[s]) + ")"
            n = self._call(lambda st: int(st.remove_by_regex(pattern, True)), default=-900)
            self._note_codes([n])
            job.publish(s, [s], [max(0, n)])

        state, results = self._run(Job(len(batches), len(batches), step))
        return sum(r for r in results if r)

    def usage(self) -> TierUsage:
        """Mooncake's capacity is cluster-wide and owned by the master: this
        reports the segment this process contributes, and no per-object count."""
        return TierUsage(used_bytes=0, capacity_bytes=self.config.global_segment_size, objects=0, groups=0)
