"""`StoreKey.batch`, `GroupKey.batch`, `ObjectHeader.batch`, `Expectation.batch`: the same objects as
their constructors, and the same validation as `StoreKey`'s."""

import pytest

from kvpack.identity.keys import GroupKey, StoreKey
from kvpack.identity.objects import Expectation, ObjectHeader, decode_header

CHUNKS = ["a" * 64, "b1", "c_d-e"]
FP = "0123456789abcdef" * 2


def test_store_key_batch_equals_constructor():
    got = StoreKey.batch("tenant-1", FP, CHUNKS, "kv@0of2")
    want = [StoreKey("tenant-1", FP, c, "kv@0of2") for c in CHUNKS]
    assert got == want
    assert [hash(k) for k in got] == [hash(k) for k in want]
    assert StoreKey.batch("t", FP, [], "kv") == []


@pytest.mark.parametrize(
    "tenant, fp, chunks, member",
    [
        ("../x", FP, CHUNKS, "kv"),
        ("t", "not/hex", CHUNKS, "kv"),
        ("t", FP, CHUNKS, "KV"),
        ("t", FP, ["ok", "bad/chunk"], "kv"),
        ("t", FP, ["ok", ""], "kv"),
        ("t", FP, ["ok", None], "kv"),
    ],
)
def test_store_key_batch_validates_like_the_constructor(tenant, fp, chunks, member):
    with pytest.raises(ValueError):
        [StoreKey(tenant, fp, c, member) for c in chunks]
    with pytest.raises(ValueError):
        StoreKey.batch(tenant, fp, chunks, member)


def test_batch_keys_stay_frozen():
    key = StoreKey.batch("t", FP, ["c"], "kv")[0]
    with pytest.raises(AttributeError):
        key.chunk = "other"  # type: ignore[misc]


def test_group_key_batch_equals_constructor_field_for_field():
    """A memory tier reports its evicted groups through `GroupKey.batch`: equal, hashed and
    shown as the constructor's keys, so a listener's dict finds either; still frozen."""
    rows = [("tenant-1", FP, c) for c in CHUNKS] + [("u", "f" * 32, "a" * 64)]
    got = GroupKey.batch(rows)
    want = [GroupKey(*row) for row in rows]
    assert got == want
    assert [hash(k) for k in got] == [hash(k) for k in want]
    assert [repr(k) for k in got] == [repr(k) for k in want]
    assert [(k.tenant, k.fingerprint, k.chunk) for k in got] == rows
    assert {k: i for i, k in enumerate(want)} == {k: i for i, k in enumerate(got)}
    assert GroupKey.batch([]) == []
    with pytest.raises(AttributeError):
        got[0].chunk = "other"  # type: ignore[misc]


def test_header_batch_equals_constructor_and_encodes():
    got = ObjectHeader.batch(FP, "t", CHUNKS, "kv", 64, 4096)
    want = [ObjectHeader(FP, "t", c, "kv", 64, 4096, None) for c in CHUNKS]
    assert got == want
    from dataclasses import replace

    header = replace(got[0], checksum=7)
    assert decode_header(header.encode()) == header


def test_expectation_batch_equals_constructor():
    assert Expectation.batch(FP, "t", CHUNKS, "kv", 64, None) == [
        Expectation(FP, "t", c, "kv", 64, None) for c in CHUNKS
    ]
