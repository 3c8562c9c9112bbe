"""Small builders shared by the core tests."""

from __future__ import annotations

import numpy as np

from kvpack import Expectation, KVLayoutSpec, ObjectHeader, PutItem, StoreKey
from kvpack.objects import payload_checksum

SPEC = KVLayoutSpec(engine="test", model="tiny", dtype="bfloat16", chunk_tokens=16)
GROUP_FP = SPEC.group_fingerprint
MEMBER_FP = SPEC.member_fingerprint


def chunk_id(i: int) -> str:
    return f"{i:064x}"


def make_item(
    tenant: str, chunk: str, member: str = "kv", nbytes: int = 1024, seed: int = 0, checksum: bool = True,
    token_ids: tuple[int, ...] | None = None, token_count: int = 16,
) -> tuple[PutItem, np.ndarray]:
    payload = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    header = ObjectHeader(
        fingerprint=MEMBER_FP, tenant=tenant, chunk=chunk, member=member, token_count=token_count,
        payload_len=nbytes, checksum=payload_checksum(payload) if checksum else None, token_ids=token_ids,
    )
    return PutItem(StoreKey(tenant, GROUP_FP, chunk, member), header, memoryview(payload)), payload


def expect(item: PutItem) -> Expectation:
    h = item.header
    return Expectation(h.fingerprint, h.tenant, h.chunk, h.member, h.token_count, h.payload_len)
