"""Small builders shared by the Mooncake tests: objects, expectations, raw clients."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kvpack.keys import StoreKey
from kvpack.objects import Expectation, ObjectHeader, payload_checksum
from kvpack.tiers.base import PutItem

FP = "ab" * 16
TOKENS = 16


def payload(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes (the same in every process)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def key(chunk: str, member: str = "kv", tenant: str = "default") -> StoreKey:
    return StoreKey(tenant, FP, chunk, member)


def item(k: StoreKey, data: np.ndarray, token_ids: Sequence[int] | None = None, checksum: bool = False) -> PutItem:
    header = ObjectHeader(
        FP,
        k.tenant,
        k.chunk,
        k.member,
        len(token_ids) if token_ids is not None else TOKENS,
        data.nbytes,
        payload_checksum(data) if checksum else None,
        tuple(token_ids) if token_ids is not None else None,
    )
    return PutItem(k, header, memoryview(data))


def expect(k: StoreKey, token_count: int | None = TOKENS, **kw) -> Expectation:  # type: ignore[no-untyped-def]
    return Expectation(FP, k.tenant, k.chunk, k.member, token_count, **kw)


def raw_client(master_address: str, tenant: str = "default"):  # type: ignore[no-untyped-def]
    """A plain MooncakeDistributedStore (the test's 'other writer'); setup checked."""
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_address, tenant_id=tenant)
    assert rc == 0, f"raw Mooncake setup failed: {rc}"
    return store


def raw_put(store, name: str, data: bytes) -> int:  # type: ignore[no-untyped-def]
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    return int(store.batch_upsert_from([name], [buf.ctypes.data], [buf.nbytes])[0])
