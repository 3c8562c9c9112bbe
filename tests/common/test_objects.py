"""Object format: round trips, and every corruption is a named reason."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fixtures import builders
from kvpack.identity.objects import (
    MAX_HEADER_BYTES,
    Expectation,
    HeaderFastPath,
    ObjectHeader,
    ObjectRejected,
    RejectReason,
    check_header,
    check_payload,
    decode_header,
    payload_checksum,
)

FP = "ab" * 16

headers = st.builds(
    ObjectHeader,
    fingerprint=st.binary(min_size=16, max_size=16).map(bytes.hex),
    tenant=st.from_regex(r"[a-z][a-z0-9_-]{0,20}", fullmatch=True),
    chunk=st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
    member=st.sampled_from(["kv", "draft", "kv@0of2", "mamba"]),
    token_count=st.integers(0, 2**32 - 1),
    payload_len=st.integers(0, 2**40),
    checksum=st.integers(0, 2**64 - 1),
    token_ids=st.none() | st.lists(st.integers(0, 2**32 - 1), max_size=300).map(tuple),
)


@given(headers)
def test_header_round_trip(header: ObjectHeader) -> None:
    assert decode_header(header.encode()) == header
    assert HeaderFastPath.encoded_len(header) == len(header.encode())


@given(headers)
def test_read_budget_holds_every_header_that_can_match(header: ObjectHeader) -> None:
    """Regression (issue 12 item 4): a tail is read knowing only a prefix of its token ids."""
    h = header
    if h.token_ids is None:
        exp = Expectation(h.fingerprint, h.tenant, h.chunk, h.member, h.token_count, h.payload_len)
    else:
        exp = Expectation(
            h.fingerprint, h.tenant, h.chunk, h.member, None, h.payload_len, token_ids_prefix=h.token_ids[:1]
        )
    assert len(h.encode()) <= HeaderFastPath.read_budget(exp)


def test_read_budget_of_a_tail_is_the_largest_header() -> None:
    longest = ObjectHeader(FP, "t", "c" * 64, "kv", 16000, 1, 0, tuple(range(16000)))
    exp = Expectation(FP, "t", "c" * 64, "kv", None, 1, token_ids_prefix=(0,))
    assert len(longest.encode()) <= HeaderFastPath.read_budget(exp) == MAX_HEADER_BYTES


def _header(**kw: object) -> ObjectHeader:
    base = dict(fingerprint=FP, token_count=16, payload_len=4, checksum=payload_checksum(b"abcd"))
    base.update(kw)
    return builders.header("t", "c" * 64, "kv", **base)  # type: ignore[arg-type]


@given(st.data())
def test_any_flipped_header_byte_is_rejected(data: st.DataObject) -> None:
    raw = bytearray(_header(token_ids=(1, 2, 3)).encode())
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ObjectRejected):
        decode_header(bytes(raw))


def test_truncated_header_is_rejected() -> None:
    raw = _header().encode()
    for n in (0, 5, len(raw) - 1):
        with pytest.raises(ObjectRejected) as info:
            decode_header(raw[:n])
        assert info.value.reason is RejectReason.TRUNCATED


def test_bad_magic_and_version() -> None:
    raw = bytearray(_header().encode())
    raw[0:4] = b"XXXX"
    with pytest.raises(ObjectRejected) as info:
        decode_header(bytes(raw))
    assert info.value.reason is RejectReason.BAD_MAGIC


def test_unencodable_without_checksum() -> None:
    with pytest.raises(ValueError):
        _header(checksum=None).encode()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"fingerprint": "cd" * 16}, RejectReason.FINGERPRINT),
        ({"tenant": "other"}, RejectReason.TENANT),
        ({"chunk": "d" * 64}, RejectReason.GROUP),
        ({"member": "draft"}, RejectReason.MEMBER),
        ({"token_count": 15}, RejectReason.TOKEN_COUNT),
        ({"payload_len": 5}, RejectReason.LENGTH),
        ({"token_ids_prefix": (9,)}, RejectReason.TOKENS),
    ],
)
def test_expectation_mismatch_has_a_reason(change: dict, reason: RejectReason) -> None:
    header = _header(token_ids=(1, 2, 3))
    expected = dict(fingerprint=FP, tenant="t", chunk="c" * 64, member="kv", token_count=16, payload_len=4)
    assert check_header(header, Expectation(**expected)) is None  # type: ignore[arg-type]
    expected.update(change)
    assert check_header(header, Expectation(**expected)) is reason  # type: ignore[arg-type]


def test_payload_checks() -> None:
    header = _header()
    assert check_payload(header, memoryview(b"abcd")) is None
    assert check_payload(header, memoryview(b"abce")) is RejectReason.CHECKSUM
    assert check_payload(header, memoryview(b"abc")) is RejectReason.LENGTH
