"""Issue 34: a batch's payload checksums in one native call, the GIL given up once.

Python's xxhash gives the GIL up for every payload; with another thread running Python
in the process (an engine's scheduler), each re-take can wait a 5 ms switch interval.
`kvpack.identity.objects.payload_checksums` hashes a whole batch natively: its digests must be
Python xxhash's for every kind of payload, and a batch must make no Python-level
xxhash call once the extension is loaded.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from helpers import chunk_id, make_item

import kvpack.identity.objects as objects
from kvpack.identity.objects import RejectReason, check_payloads, payload_checksum, payload_checksums
from kvpack.ops import load_extension
from kvpack.tiers.base import checksummed


@pytest.fixture(autouse=True)
def _extension() -> None:
    status = load_extension()
    if not status.available:
        pytest.skip(f"extension unavailable: {status.reason}")


def _payloads() -> list[object]:
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    view = memoryview(data)
    return [
        view[:0],
        view[:1],
        view[:240],  # xxh3's short-input paths
        view[:241],
        view[: (64 << 10) + 3],
        data[: 384 << 10],  # a numpy array
        bytes(view[:5000]),
        (view[:100], view[100:100], view[200:4096], view[5000:300_000]),  # regions in order
        (view[7:],),
    ]


def _python(payload: object) -> int:
    if isinstance(payload, tuple):
        h = xxhash.xxh3_64()
        for part in payload:
            h.update(part)
        return h.intdigest()
    return xxhash.xxh3_64_intdigest(payload)  # type: ignore[arg-type]


def test_native_digests_are_python_xxhashs() -> None:
    payloads = _payloads()
    assert payload_checksums(payloads) == [_python(p) for p in payloads]  # type: ignore[arg-type]
    assert payload_checksums(payloads) == [payload_checksum(p) for p in payloads]  # type: ignore[arg-type]


def test_a_batch_makes_no_python_xxhash_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> object:
            calls.append(name)
            return getattr(xxhash, name)

    monkeypatch.setattr(objects, "xxhash", Counting())
    items = [make_item("t", chunk_id(i), nbytes=4096 + i, seed=i, checksum=False)[0] for i in range(12)]
    sealed = checksummed(items)
    assert calls == []
    assert [it.header.checksum for it in sealed] == [_python(it.payload) for it in items]
    assert check_payloads([it.header for it in sealed], [it.payload for it in items]) == [None] * 12
    assert calls == []
    payload_checksum(items[0].payload)  # the control: the single-payload function is Python's
    assert calls


def test_check_payloads_names_each_bad_one() -> None:
    items = checksummed([make_item("t", chunk_id(i), nbytes=2048, seed=i, checksum=False)[0] for i in range(4)])
    datas = [np.frombuffer(it.payload, np.uint8).copy() for it in items]
    datas[1][-1] ^= 1
    short = datas[3][:-1]
    got = check_payloads([it.header for it in items], [memoryview(d) for d in (*datas[:3], short)])
    assert got == [None, RejectReason.CHECKSUM, None, RejectReason.LENGTH]
