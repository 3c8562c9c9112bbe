"""SGLang's host pools as kvpack members: which pool is bound to which member, fixed at
registration.

``register_mem_pool_host`` gives the KV (anchor) pool, which fixes the group fingerprint of
every page (`Session.bind_group`): a canonical group shared with vLLM where kvpack stores
the KV canonically (`kvpack.canonical`), else SGLang's own layout, model identity, dtype,
page size and TP/PP sizes. ``register_mem_host_pool_v2`` adds the other pools (draft, swa,
mamba, indexer...). A pool kvpack cannot describe is remembered with its reason: its pages
always miss, and each call on it is refused with that reason logged.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from kvpack import KVLayoutSpec, MemberRole, MemberSpec, Session, conversion_threads

from .pools import ParallelInfo, PoolBinding, canonical_group, computes_on_host_cpu, pool_name

log = logging.getLogger("kvpack.sglang")


class PoolRegistry:
    """The bound pools of one SGLang storage backend (see the module docstring)."""

    def __init__(self, session: Session, par: ParallelInfo, io_threads: int = 1) -> None:
        self.session = session
        self.par = par
        self.io_threads = io_threads
        """The config's ``io_threads``: a canonical pool's conversion threads on a GPU server (`conversion_threads`)."""
        self.mem_pool_host: Any = None
        """The anchor pool given to ``register_mem_pool_host`` (None before)."""
        self.registered_pools: dict[str, Any] = {}
        """Every pool SGLang registered through the v2 call, by plain name."""
        self.bindings: dict[str, PoolBinding] = {}
        self.errors: dict[str, str] = {}
        """Why a pool could not be bound, by name (its pages always miss)."""
        self.page_size = 1
        self._layout_name = "unknown"
        self._lock = threading.Lock()

    def register_anchor(self, mem_pool_host: Any) -> None:
        """The KV (anchor) host pool; fixes the group fingerprint of every page."""
        self.mem_pool_host = mem_pool_host
        self._layout_name = str(getattr(mem_pool_host, "layout", "unknown"))
        self.page_size = int(getattr(mem_pool_host, "page_size", 1) or 1)
        self._bind_group()
        if getattr(mem_pool_host, "kv_buffer", None) is not None:
            self._bind("kv", mem_pool_host)

    def _bind_group(self) -> None:
        """Scope every key by the anchor pool's group, named in the store's index (`kvpack usage`):
        canonical (shared with vLLM) where kvpack stores the KV
        canonically, else SGLang's own layout, model identity, dtype, page size, TP/PP sizes."""
        pool = self.mem_pool_host
        has_kv = getattr(pool, "kv_buffer", None) is not None
        shared = canonical_group(pool, self.par, self._layout_name) if has_kv else None
        group = shared or KVLayoutSpec(
            engine=f"sglang:{self._layout_name}",
            model=self.par.model,
            dtype=str(getattr(pool, "dtype", "unknown")).removeprefix("torch."),
            chunk_tokens=self.page_size,
            tp_size=self.par.tp_size,
            pp_size=self.par.pp_size,
        )
        self.session.bind_group(group.group_fingerprint, group.describe(self.par.model_name))

    def rescope(self, model: str) -> None:
        """Bind every registered pool again for the model identity `model` (the engine's weights
        changed in place: `kvpack.with_weights`): the group fingerprint, every member's
        fingerprint and the canonical sources all derive from it, so no page of other weights
        is found or accepted. The new bindings replace the old ones in one assignment."""
        self.par = replace(self.par, model=model)
        if self.mem_pool_host is None:
            return
        pools = dict(self.registered_pools)
        if getattr(self.mem_pool_host, "kv_buffer", None) is not None:
            pools["kv"] = self.mem_pool_host  # the anchor's KV, as `register` keeps it
        bindings: dict[str, PoolBinding] = {}
        errors: dict[str, str] = {}
        for name, pool in pools.items():
            binding = self._make_binding(name, pool, errors)
            if binding is not None:
                bindings[name] = binding
        with self._lock:
            self.bindings, self.errors = bindings, errors
        self._bind_group()

    def register(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of SGLang's v2 registration (the KV pool here, when no anchor came first)."""
        name = pool_name(host_pool_name)
        self.registered_pools[name] = host_pool
        if name == "kv" and self.mem_pool_host is None:
            self.register_anchor(host_pool)
            return
        if name != "kv" or "kv" not in self.bindings:
            self._bind(name, host_pool)

    def _bind(self, name: str, host_pool: Any) -> None:
        if not self.session.group_fingerprint:
            raise RuntimeError("kvpack: register_mem_pool_host must come before other host pools")
        binding = self._make_binding(name, host_pool, self.errors)
        if binding is None:
            return
        with self._lock:
            self.bindings[name] = binding
        log.info(
            "kvpack: pool %s -> member %s (%d B/page in %d regions, %s%s)",
            name,
            binding.member,
            binding.page_bytes,
            binding.parts,
            "replicated" if binding.replicated else "sharded",
            f", conversion threads {binding.copy_threads}" if binding.canonical is not None else "",
        )

    def _make_binding(self, name: str, host_pool: Any, errors: dict[str, str]) -> PoolBinding | None:
        """`host_pool` as a member for the current `par`; None (the reason in `errors`, logged)
        for a pool kvpack cannot describe: its pages always miss."""
        try:
            threads = conversion_threads(self.io_threads, computes_on_host_cpu(host_pool))
            return PoolBinding(name, host_pool, self.par, self._layout_name, copy_threads=threads)
        except Exception as exc:
            errors[name] = str(exc)
            log.warning("kvpack: SGLang pool %s (%s) cannot be stored: %s", name, type(host_pool).__name__, exc)
            return None

    def binding(self, name: Any) -> PoolBinding | None:
        return self.bindings.get(pool_name(name))

    @property
    def kv(self) -> PoolBinding | None:
        """The KV pool's binding (None: not registered, or refused)."""
        return self.bindings.get("kv")

    @property
    def kv_refused(self) -> bool:
        """The anchor pool holds KV that could not be bound: nothing is restorable."""
        return self.kv is None and getattr(self.mem_pool_host, "kv_buffer", None) is not None

    @property
    def anchor_only(self) -> bool:
        """The anchor pool is logical (no KV buffer): the v2 pools carry the data."""
        return self.mem_pool_host is not None and getattr(self.mem_pool_host, "kv_buffer", None) is None

    def drafts(self) -> list[PoolBinding]:
        """Bound draft pools every page needs beside its KV (a draft sliding window excepted)."""
        return [b for n, b in self.bindings.items() if b.spec.role is MemberRole.DRAFT and n != "draft_swa"]

    def other_splits(self, specs: list[MemberSpec]) -> tuple[list[list[MemberSpec]], dict[str, str]]:
        """Canonical KV pool: `specs` with the KV member replaced by each other head split's
        members (objects a writer at another TP size stored: `kvpack.identity.heads`), and the pool
        each of those members restores."""
        kv = self.kv
        if kv is None or kv.canonical is None:
            return [], {}
        out, names = [], {}
        for objects in kv.sources[1:]:
            members = [MemberSpec(obj.member, obj.fingerprint, MemberRole.TARGET) for obj in objects]
            names.update({m.name: kv.name for m in members})
            out.append([m for spec in specs for m in (members if spec.name == kv.member else [spec])])
        return out, names
