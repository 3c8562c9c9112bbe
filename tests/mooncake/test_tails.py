"""Partial-block tails through Mooncake: stored by one store, found and loaded by another.

A tail's header carries all its token ids, so its object is longer than a full
block's of the same payload, while the reader only knows the prefix it reuses
(n - 1 of the stored ids for a repeated prompt, fewer when the prompt diverges).
Regression, issue 12 item 4 (``Buffer too small for key '...-tail/kv':
required=131417, available=131392``): the read buffer was sized from that prefix.
Over TCP the tier's retry at the exact size still found the object (three calls
and a Mooncake error line per tail); into RDMA-registered staging, never.
"""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.builders import GROUP_FP, MEMBER_FP, expect_key, item, key, payload
from kvpack import KVStore, LoadItem, MemberRole, MemberSpec
from kvpack.policy.tails import tail_chunk
from kvpack.tiers.base import TierStatus

pytestmark = pytest.mark.mooncake

BLOCK_TOKENS = 128
BLOCK_BYTES = 128 << 10
KV = MemberSpec("kv", MEMBER_FP, MemberRole.TARGET)


@pytest.mark.parametrize(
    ("stored", "used"),
    [(BLOCK_TOKENS - 1, BLOCK_TOKENS - 2), (52, 51), (52, 20), (BLOCK_TOKENS - 1, 1), (2, 1)],
    ids=["n-1-of-127", "n-1-of-52", "20-of-52", "1-of-127", "1-of-2"],
)
def test_regression_tail_from_mooncake_is_read_in_one_call(mooncake_cluster, capfd, stored: int, used: int) -> None:  # type: ignore[no-untyped-def]
    parent = f"{stored:032x}{used:032x}"
    chunk = tail_chunk(parent)
    ids = tuple(range(1000, 1000 + stored))
    data = payload(77 + stored + used, BLOCK_BYTES)
    k = key(chunk)
    writer = KVStore.from_config(mooncake_cluster.kvpack_config())
    try:
        assert writer.tiers[0].wait_ready(15)
        assert writer.store([item(k, data, token_ids=ids, checksum=True)]) == [TierStatus.OK]
        assert writer.flush(10)
    finally:
        writer.close()

    reader = KVStore.from_config(mooncake_cluster.kvpack_config())  # a second engine: nothing cached
    try:
        assert reader.tiers[0].wait_ready(15)
        prompt = list(ids[:used]) + [7] * (stored - used)  # shares `used` tokens with the stored tail
        match = reader.tails.find("default", GROUP_FP, parent, prompt, [KV], match_unit=1)
        assert match is not None and match.tokens == used and match.stored_tokens == stored
        capfd.readouterr()
        # What the vLLM worker asks for: any token count, the reused prefix of the tail's ids.
        exp = expect_key(k, None, payload_len=data.nbytes, token_ids_prefix=match.token_ids[:used])
        dst = np.zeros_like(data)
        res = reader.load([LoadItem(k, memoryview(dst), exp)])[0]
        assert res.ok, (res.status, res.reason, res.detail)
        assert np.array_equal(dst, data)
        assert reader.metrics.value("loaded_bytes", tier="mooncake") == data.nbytes
        assert "Buffer too small" not in capfd.readouterr().err, "the tail did not fit the buffer it was read into"
    finally:
        reader.close()
