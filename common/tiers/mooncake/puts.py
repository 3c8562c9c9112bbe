"""Writes to Mooncake: staged or direct puts, upserts, group roll-back, and removal.

`Puts.put_from` plans a batch into steps (`staging.plan_steps`). A helper
worker prepares step k+1 (payload checksum, header encode, copy into the
slot) while the leader transfers step k:

- Content-addressed objects use ``batch_put_from`` (a put of an existing key
  is a cheap no-op); objects meant to be overwritten (partial-block tails,
  or a key whose stored object a get refused: `OverwriteKeys`) use
  ``batch_upsert_from``. Mooncake refuses an upsert that would change an
  object's group membership: such a key is removed and put again.
- Payloads of at least `DIRECT_MIN_BYTES` go over TCP straight from the
  caller's regions (``batch_put_from_multi_buffers``, header in the slot);
  smaller ones, and every payload under RDMA, are copied into the slot.
- With groups, each object carries its kvpack group as its Mooncake group
  id, and members of a group a step could only partly store are removed
  again: a group is present or absent as a whole.
- A step answered TIMEOUT to the caller is removed again once its transfer
  returns (`Job.on_abandoned`).
"""

from __future__ import annotations

import ctypes
import logging
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ...canonical.addressed import address_of
from ...identity.keys import GroupKey, StoreKey
from ...identity.objects import HeaderFastPath, ObjectHeader, payload_checksum, payload_parts
from ..base import PutItem, TierStatus
from .codes import INVALID_PARAMS, NOT_CALLED, code_info, describe
from .connection import Connection
from .runner import Job, Slot
from .staging import SLOTS, STEP_MAX_BYTES, Staging, plan_steps, round_up, slot_buffers

log = logging.getLogger("kvpack")

DIRECT_MIN_BYTES = 256 << 10
"""Payloads this large are put straight from the caller's regions (TCP):
Mooncake gathers [header in the lane, payload regions] itself, no staging
copy. Smaller ones are staged: Mooncake's per-buffer cost exceeds a memcpy."""
OVERWRITE_KEYS_MAX = 4096
"""Keys remembered for overwrite (oldest forgotten first)."""


class OverwriteKeys:
    """Keys whose stored object a get refused: their next put is an upsert. Thread-safe, bounded."""

    def __init__(self, limit: int = OVERWRITE_KEYS_MAX) -> None:
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def mark(self, key: str) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def snapshot(self) -> set[str] | None:
        """The marked keys now (None: none)."""
        with self._lock:
            return set(self._keys) if self._keys else None

    def done(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)


class _Prep:
    """One object of a put, ready for a step: encoded header, payload regions, route."""

    __slots__ = ("key", "name", "header", "hdr", "hdr_len", "parts", "nbytes", "upsert", "direct")

    def __init__(
        self,
        key: StoreKey,
        name: str,
        header: ObjectHeader,
        parts: tuple[memoryview, ...],
        nbytes: int,
        upsert: bool,
        direct: bool,
    ) -> None:
        self.key = key
        self.name = name
        self.header = header
        self.hdr = b""
        self.hdr_len = HeaderFastPath.encoded_len(header)
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
                h = ObjectHeader(
                    h.fingerprint,
                    h.tenant,
                    h.chunk,
                    h.member,
                    h.token_count,
                    h.payload_len,
                    csum,
                    h.token_ids,
                    h.version,
                )
            self.hdr = h.encode()
        except (ValueError, OverflowError, struct.error) as exc:
            log.warning("kvpack: Mooncake put of %s skipped: %s", self.name, exc)
            return False
        return len(self.hdr) == self.hdr_len


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


class Puts:
    """The write side of a `MooncakeTier` (see the module docstring).

    `groups`: pass kvpack groups as Mooncake group ids; `direct_put`: TCP with
    ``batch_put_from_multi_buffers`` (RDMA needs every payload in the arena)."""

    def __init__(
        self,
        conn: Connection,
        staging: Staging,
        overwrite: OverwriteKeys,
        replicate_cls: type,
        groups: bool,
        direct_put: bool,
    ) -> None:
        self._conn = conn
        self._staging = staging
        self._overwrite = overwrite
        self._replicate_cls = replicate_cls
        self._groups = groups
        self._direct_put = direct_put

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        if not items:
            return []
        refused = self._conn.refusal()
        if refused is not None:
            return [refused] * len(items)
        direct_ok = self._direct_put
        overwrite = self._overwrite.snapshot()
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
            direct = direct_ok and not upsert and nbytes >= DIRECT_MIN_BYTES
            prepared.append(_Prep(item.key, name, h, parts, nbytes, upsert, direct))
        todo = [i for i, p in enumerate(prepared) if p is not None]
        # Checksums and headers are made step by step, while the previous step
        # transfers; the plan only needs the header lengths.
        lane_budgets = [round_up(p.hdr_len + (0 if p.direct else p.nbytes)) if p else 0 for p in prepared]
        xfer = [p.hdr_len + p.nbytes if p else 0 for p in prepared]
        slot_bytes = self._staging.slot_bytes([lane_budgets[i] for i in todo])
        plan = plan_steps([lane_budgets[i] for i in todo], [xfer[i] for i in todo], slot_bytes, STEP_MAX_BYTES)
        steps = [[todo[k] for k in step] for step in plan]
        staged: dict[int, _PutStep] = {}
        statuses: list[TierStatus] = [TierStatus.ERROR] * len(items)

        def prepare(job: Job[TierStatus], slot: Slot, s: int) -> None:
            staged[s] = self._prepare(slot, steps[s], prepared, lane_budgets)

        def transfer(job: Job[TierStatus], slot: Slot, s: int) -> None:
            self._transfer(job, s, staged.pop(s))

        def undo(job: Job[TierStatus], s: int) -> None:
            # The caller answered TIMEOUT for this step: whatever Mooncake stored must go again.
            keys = [p.name for p in (prepared[i] for i in steps[s]) if p is not None]
            self._conn.call(lambda st: st.batch_remove(keys), default=None)
            self._conn.events.abandoned_puts_removed += len(keys)

        job: Job[TierStatus] = Job(
            len(items), len(steps), transfer, prepare=prepare, on_abandoned=undo, slots=SLOTS, slot_bytes=slot_bytes
        )
        state, results = self._conn.run(job)
        for i in todo:
            r = results[i]
            statuses[i] = r if r is not None else TierStatus.TIMEOUT
        return statuses

    def _prepare(
        self, slot: Slot, idx: list[int], prepared: list[_Prep | None], lane_budgets: Sequence[int]
    ) -> _PutStep:
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
        views, addrs = slot_buffers(slot, kept, lane_budgets)
        # Staged objects: header + payload copied into the slot (one buffer each).
        # Direct objects: header in the slot, payload read in place from the caller's regions.
        buffers: list[list[int]] = []
        sizes: list[list[int]] = []
        memmove = ctypes.memmove
        for p, a in zip(preps, addrs):
            hl = p.hdr_len
            memmove(a, p.hdr, hl)
            if p.direct:
                buffers.append([a, *(address_of(part) for part in p.parts)])
                sizes.append([hl, *(part.nbytes for part in p.parts)])
            else:
                off = a + hl
                for part in p.parts:
                    nb = part.nbytes
                    if nb:
                        memmove(off, address_of(part), nb)
                    off += nb
                buffers.append([a])
                sizes.append([hl + p.nbytes])
        groups = [p.name[: p.name.rfind("/")] for p in preps] if self._groups else None
        return _PutStep(kept, dropped, preps, buffers, sizes, groups)

    def _transfer(self, job: Job[TierStatus], step: int, st: _PutStep) -> None:
        """The Mooncake calls of one staged put step; publishes its statuses."""
        conn = self._conn
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
                fn = "batch_put_from_multi_buffers"
                args: tuple[Any, ...] = (sel_names, [buffers[j] for j in sel], [sizes[j] for j in sel], cfg)
            else:
                fn = "batch_upsert_from" if mode == "upsert" else "batch_put_from"
                args = (sel_names, [buffers[j][0] for j in sel], [sizes[j][0] for j in sel], cfg)
            got = conn.call(lambda s: list(getattr(s, fn)(*args)), default=[NOT_CALLED] * len(sel))
            for j, c in zip(sel, got):
                codes[j] = int(c)
        # Mooncake refuses an upsert that would change an object's group membership
        # (e.g. a foreign or pre-groups object under our key): replace it instead.
        stuck = [j for j in range(len(preps)) if preps[j].upsert and codes[j] == INVALID_PARAMS] if any_upsert else []
        if stuck:
            cfg = self._replicate_config(st.groups, stuck)
            conn.call(lambda s: s.batch_remove([names[j] for j in stuck], True), default=None)
            got = conn.call(
                lambda s: list(
                    s.batch_put_from(
                        [names[j] for j in stuck], [buffers[j][0] for j in stuck], [sizes[j][0] for j in stuck], cfg
                    )
                ),
                default=[NOT_CALLED] * len(stuck),
            )
            for j, c in zip(stuck, got):
                codes[j] = int(c)
        conn.note_codes(codes)
        if all(c == 0 for c in codes):
            statuses = [TierStatus.OK] * len(codes)
        else:
            statuses = [code_info(c).status for c in codes]
            if self._groups:
                self._roll_back_partial_groups([p.key for p in preps], statuses)
        if any_upsert:
            for j, n in enumerate(names):
                if statuses[j] is TierStatus.OK and preps[j].upsert:
                    self._overwrite.done(n)
        job.publish(step, st.kept + st.dropped, statuses + [TierStatus.ERROR] * len(st.dropped))

    def _replicate_config(self, groups: list[str] | None, sel: Sequence[int]) -> Any:
        cfg = self._replicate_cls()
        cfg.replica_num = self._conn.config.replica_num
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
            self._conn.call(lambda s: s.batch_remove(names), default=None)

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        """Remove every member of each group (one regex call per 64 groups).

        Forced: Mooncake leases an object to every reader for seconds, and an
        unforced remove of a leased object is refused. A reader racing with
        the removal can at worst receive bytes that fail kvpack's header and
        checksum checks (REJECTED), never wrong data accepted as right."""
        conn = self._conn
        if not groups or conn.refusal() is not None:
            return 0
        batches = [groups[i : i + 64] for i in range(0, len(groups), 64)]

        def step(job: Job[int], slot: Slot, s: int) -> None:
            pattern = "^(" + "|".join(re.escape(g.as_str() + "/") for g in batches[s]) + ")"
            n = conn.call(lambda st: int(st.remove_by_regex(pattern, True)), default=NOT_CALLED)
            conn.note_codes([n])
            job.publish(s, [s], [max(0, n)])

        state, results = conn.run(Job(len(batches), len(batches), step))
        return sum(r for r in results if r)

    def remove_matching(self, pattern: str) -> int:
        """Remove every object whose key matches the regular expression `pattern` (forced, as
        `remove_groups`), within the tier's call bound; the count Mooncake removed. Raises
        RuntimeError (one line) when the tier is down, the call timed out or Mooncake refused."""
        conn = self._conn
        refusal = conn.refusal()
        if refusal is not None:
            raise RuntimeError(f"Mooncake is {refusal.value}")

        def step(job: Job[int], slot: Slot, s: int) -> None:
            n = conn.call(lambda st: int(st.remove_by_regex(pattern, True)), default=NOT_CALLED)
            conn.note_codes([n])
            job.publish(s, [s], [n])

        state, results = conn.run(Job(1, 1, step))
        n = results[0] if results else None
        if not isinstance(n, int):
            raise RuntimeError(f"Mooncake's remove_by_regex did not answer in time ({state.name.lower()})")
        if n < 0:
            raise RuntimeError(f"Mooncake's remove_by_regex failed: {describe(n)}")
        return n
