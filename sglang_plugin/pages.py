"""SGLang host-pool pages to and from the store: a batch's keys and host indices become
session calls on the pool's member objects.

A get is one `Session.load_pages` for the whole batch, straight into the pool's pages (or,
for a canonical KV pool, converted on the way in out of the memory tier's own slots), each
page from the tier the lookup found it in; a page is restored only when every object of it
loaded. A set stores only the pages the session's de-duplication says are still to store
(`Session.save_pages`, copied or filled in place), read in place from the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvpack import (
    AdapterRefusal,
    BatchLog,
    Direction,
    MemberObject,
    PagePart,
    Payload,
    Session,
    clip,
    validate_chunk_hashes,
)

from .pools import PoolBinding
from .registry import PoolRegistry

log = logging.getLogger("kvpack.sglang")

ENGINE = "sglang"
"""The `tier` label under which the adapter's own refusals are counted (`Session.report.refused`)."""


class PageCopies:
    """Page gets and sets of one storage backend's bound pools (see the module docstring)."""

    def __init__(self, session: Session, tenant: str, pools: PoolRegistry) -> None:
        self.session = session
        self.tenant = tenant
        self.pools = pools
        self._refusals = session.report.engine_refusals(ENGINE, "SGLang page call", log)
        """Refused calls: each counted, the first of each reason logged (`kvpack.Refusals`)."""
        self.batches = BatchLog()
        """Each get and set call's pages and bandwidth, for SGLang's `get_stats` (bounded)."""

    def valid(self, keys: Sequence[str]) -> bool:
        """Whether every page key is a valid chunk hash (a refusal is counted and logged)."""
        try:
            validate_chunk_hashes(keys)
        except (ValueError, TypeError) as exc:  # the key is quoted cut (`keys.validate_chunk_hash`)
            self._refusals.refuse(AdapterRefusal.BAD_KEY, f"page key: {exc}")
            return False
        return True

    def _usable(self, binding: PoolBinding | None, name: str, keys: list[str], op: str) -> bool:
        """Whether the pool is bound and every page key valid (a refusal is counted and logged)."""
        if binding is None:
            why = self.pools.errors.get(name, "not registered")
            self._refusals.refuse(AdapterRefusal.UNKNOWN_POOL, f"{op} on pool {clip(name)}: {clip(why)}")
            return False
        return self.valid(keys)

    def get(self, binding: PoolBinding | None, name: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Per page: restored into the pool's pages at `host_indices`. Tokens restored are
        counted for the KV pool only (once per page, not per pool of it)."""
        n = len(keys)
        if n == 0:
            return []
        if not self._usable(binding, name, keys, "get"):
            return [False] * n
        assert binding is not None
        began = time.perf_counter()
        ok = self.session.load_pages(
            self._parts(binding, keys, host_indices),
            n,
            # converted on the way in: read memory's and the host store's copies in place
            lent=binding.canonical is not None,
            tenant=self.tenant,
            page_tokens=binding.page_size if name == "kv" else 0,
        )
        self._note(Direction.LOAD, binding, sum(ok), began)
        if not all(ok):
            log.debug("kvpack: %s get: %d of %d pages", name, sum(ok), n)
        return ok

    def _note(self, direction: Direction, binding: PoolBinding, pages: int, began: float) -> None:
        """One call's figures: `pages` pages of `binding`'s pool, moved since `began`."""
        self.batches.note(direction, pages, pages * int(binding.obj.payload_len or 0), time.perf_counter() - began)

    def _parts(self, binding: PoolBinding, keys: list[str], host_indices: torch.Tensor) -> list[PagePart]:
        """Per object set of the pages: the pool's own member, or, for pages the lookup found
        as another TP size's head ranges (`PoolRegistry.other_splits`), one object per range.
        Pages of one batch may come from several splits (`kvpack.policy.split_lookup`)."""
        n = len(keys)
        if binding.canonical is not None:
            members = [binding.member] + [objects[0].member for objects in binding.sources[1:]]
            splits = self.session.located_splits(self.tenant, keys, members)
        else:
            splits = [0] * n
        out: list[PagePart] = []
        for split in sorted(set(splits)):
            pages = [i for i, s in enumerate(splits) if s == split]
            idx = host_indices if len(pages) == n else host_indices.reshape(n, -1)[pages].reshape(-1)
            names = [keys[i] for i in pages]
            if split == 0:
                payloads, finish = binding.load_buffers(idx, len(pages))
                out.append(PagePart(pages, self.session.page_reads(self.tenant, binding.obj, names, payloads), finish))
                continue
            for obj in binding.sources[split]:
                payloads, finish = binding.range_load_buffers(idx, len(pages), obj)
                member = MemberObject(obj.member, obj.fingerprint, binding.page_size)  # bytes: the range's buffers
                out.append(PagePart(pages, self.session.page_reads(self.tenant, member, names, payloads), finish))
        return out

    def set(self, binding: PoolBinding | None, name: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Per page: stored now or already stored (a replicated pool this shard does not
        write answers True: its storage writer stores it)."""
        n = len(keys)
        if n == 0:
            return []
        if not self._usable(binding, name, keys, "set"):
            return [False] * n
        assert binding is not None
        if not binding.writes:
            return [True] * n
        began = time.perf_counter()
        ok = self._set(binding, keys, host_indices)
        self._note(Direction.STORE, binding, sum(ok), began)
        return ok

    def _set(self, binding: PoolBinding, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """`set` of a bound, writing pool with valid keys."""
        n = len(keys)

        def pages(todo: Sequence[int]) -> torch.Tensor:
            return host_indices if len(todo) == n else host_indices.reshape(n, -1)[list(todo)].reshape(-1)

        if binding.canonical is not None and self.session.tiers.lends_slots:  # converted straight into the tier's slots

            def fill(todo: Sequence[int], dsts: list[np.ndarray]) -> None:
                binding.fill_objects(pages(todo), len(todo), dsts)

            return self.session.save_pages(self.tenant, binding.obj, keys, fill=fill)
        after: list[Callable[[], None]] = []

        def payloads_of(todo: Sequence[int]) -> list[Payload]:
            payloads, done = binding.store_payloads(pages(todo), len(todo))
            after.append(done)
            return payloads

        try:
            return self.session.save_pages(self.tenant, binding.obj, keys, payloads_of)
        finally:
            for done in after:
                done()
