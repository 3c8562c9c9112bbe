"""SGLang's legacy (generic) HiCache interface: whole pages by value, `get`/`set`/`exists`.

SGLang calls it for host pools without a zero-copy layout. Each page is one object in
SGLang's ``get_data_page(flat=True)`` order, a member of its own (``kvflat``), beside the
zero-copy ``kv`` member in the same group. `KVPackStorage` (`kvpack.sglang_plugin.storage`)
mixes this in; the attributes below are its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from kvpack import AdapterEvent, MemberObject, MemberSpec, Session

from .pools import PoolBinding
from .registry import PoolRegistry


class LegacyPageInterface:
    """`get`, `batch_get`, `set`, `batch_set`, `exists` over flat pages (see the module docstring)."""

    pools: PoolRegistry
    tenant: str
    session: Session
    _flat: FlatMember | None = None

    def _valid_chunks(self, keys: Sequence[str]) -> bool:
        raise NotImplementedError

    def _data_path_error(self, op: str, exc: BaseException, fallback: Any) -> Any:
        raise NotImplementedError

    def _poll_weights(self, what: str, pages: int = 0) -> bool:
        raise NotImplementedError

    def _flat_binding(self) -> FlatMember | None:
        kv = self.pools.kv
        if kv is None or self.pools.mem_pool_host is None:
            return None
        flat = self._flat
        if flat is None or flat.source is not kv:  # a new binding after weights changed (`PoolRegistry.rescope`)
            flat = FlatMember(kv, self.pools.mem_pool_host)
            self._flat = flat
        return flat

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Legacy: one flat page (SGLang's ``get_data_page`` order) into `target_location`; None on a miss."""
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0] if out else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        try:
            self._poll_weights("batch_get")  # a weight change rescopes the keys first
            flat = self._flat_binding()
            if flat is None or not self._valid_chunks(keys):
                return [None] * len(keys)
            given = list(target_locations) if target_locations is not None else [None] * len(keys)
            targets = [t if t is not None else self.pools.mem_pool_host.get_dummy_flat_data_page() for t in given]
            dsts = []
            for t in targets:
                dst = memoryview(t.contiguous().view(torch.uint8).numpy()) if t.is_contiguous() else None
                if dst is None or dst.nbytes != flat.page_bytes:
                    raise ValueError(
                        f"legacy get target of {t.numel() * t.element_size()} bytes, page is {flat.page_bytes}"
                    )
                dsts.append(dst)
            reads = self.session.page_reads(self.tenant, flat.obj, keys, dsts)
            results = self.session.complete_load(self.session.prepare_load(reads)).results
            loaded = sum(1 for r in results if r.ok)
            self.session.report.record(AdapterEvent.LOADED_TOKENS, loaded * flat.page_size, tenant=self.tenant)
            return [t if r.ok else None for t, r in zip(targets, results)]
        except Exception as exc:
            return self._data_path_error("batch_get", exc, [None] * len(keys))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        try:
            if self._poll_weights("batch_set", len(keys)):
                return True
            flat = self._flat_binding()
            if flat is None or values is None or not self._valid_chunks(keys):
                return False
            if not flat.writes:
                return True
            pages = []
            for value in values:
                data = value.contiguous().view(torch.uint8).numpy()
                if data.nbytes != flat.page_bytes:
                    raise ValueError(f"legacy set value of {data.nbytes} bytes, page is {flat.page_bytes}")
                pages.append(memoryview(data))
            return all(self.session.save_pages(self.tenant, flat.obj, keys, lambda todo: [pages[i] for i in todo]))
        except Exception as exc:
            return self._data_path_error("batch_set", exc, False)

    def exists(self, key: str) -> bool:
        """Whether `get` would find `key`: its flat page is stored (a zero-copy ``kv`` object
        alone is not what `get` reads)."""
        try:
            self._poll_weights("exists")
            flat = self._flat_binding()
            if flat is None or not self._valid_chunks([key]):
                return False
            # one page's lookup: remembered for the get that follows, counted as a lookup
            return self.session.lookup(self.tenant, [key], [flat.spec], flat.page_size).hit_chunks == 1
        except Exception as exc:
            return self._data_path_error("exists", exc, False)


class FlatMember:
    """The legacy path's member: one page in SGLang's ``get_data_page(flat=True)`` order
    (`name`: SGLang's KV pool, whose pages these are)."""

    def __init__(self, kv: PoolBinding, host_pool: Any) -> None:
        page = host_pool.get_dummy_flat_data_page()
        self.page_bytes = int(page.numel() * page.element_size())
        self.source = kv
        self.page_size = kv.page_size
        self.writes = kv.writes
        self.member = kv.member.replace("kv", "kvflat", 1)
        spec = kv.layout
        self.fingerprint = replace(spec, layer_names=("kvflat",), layer_shape=(self.page_bytes,)).member_fingerprint
        self.obj = MemberObject(self.member, self.fingerprint, self.page_size, self.page_bytes)
        self.name = kv.name
        self.spec = MemberSpec(self.member, self.fingerprint)
