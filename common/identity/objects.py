"""The on-store object format: a fixed, self-checking header plus the payload.

Nothing read back from a store is ever unpickled or executed: the header is
decoded with `struct` from a fixed layout and every field is checked against
what the reader expects before a byte of payload is used.

Header layout (little-endian; `HEADER_PREFIX` then variable fields)::

    magic        4s   b"KVPK"
    version      u16  FORMAT_VERSION
    header_len   u16  total header bytes, including the trailing checksum
    flags        u32  bit 0: token ids follow (partial-block tail objects)
    token_count  u32  tokens covered by this object
    payload_len  u64  bytes of payload after the header
    checksum     u64  xxh3_64 of the payload
    fingerprint  16s  member layout fingerprint (binary of 32 hex chars)
    tenant       u8 length + bytes
    chunk        u8 length + bytes   (the group's chunk hash)
    member       u8 length + bytes
    [token ids   u32 count + count * u32]   if flags & FLAG_TOKENS
    header_xxh   u32  xxh32 of every header byte before it

A reader compares each field with an `Expectation`; any difference is a
`RejectReason`, which callers count and treat as a miss.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from ..ops.natives import checksummer
from .slots import build_many

MAGIC = b"KVPK"
FORMAT_VERSION = 1
FLAG_TOKENS = 1
_PREFIX = struct.Struct("<4sHHIIQQ16s")
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
MAX_HEADER_BYTES = 64 * 1024
"""Upper bound on a header (tails carry at most ~16k token ids)."""


class RejectReason(enum.Enum):
    """Why a stored object was refused. Every refusal is a miss plus a counter."""

    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    VERSION = "version"
    HEADER_CHECKSUM = "header_checksum"
    FINGERPRINT = "fingerprint"
    TENANT = "tenant"
    GROUP = "group"
    MEMBER = "member"
    TOKEN_COUNT = "token_count"
    TOKENS = "tokens"
    """A tail object's token ids differ from the ones the lookup matched."""
    LENGTH = "length"
    CHECKSUM = "checksum"
    INTEGRITY = "integrity"
    """With an integrity key: the keyed MAC over header and payload does not match (forged, or another key)."""
    UNSAFE_FILE = "unsafe_file"
    """A symlink, FIFO, device or folder where a store's own object file belongs: never opened, never followed."""


class ObjectRejected(Exception):
    """Raised inside kvpack's decoding only; tiers turn it into a RejectReason outcome."""

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)


Payload = memoryview | tuple[memoryview, ...]
"""A payload in the caller's memory: one contiguous byte buffer, or several
regions (e.g. the K and V halves of a page) that form the payload in order.
Every tier reads and writes the regions in place: no gather copy."""


def payload_parts(payload: Payload | bytes | np.ndarray) -> tuple[memoryview, ...]:
    """The payload as a tuple of byte memoryviews."""
    if isinstance(payload, tuple):
        return tuple(_as_bytes(p) for p in payload)
    return (_as_bytes(payload),)


def _as_bytes(buf: memoryview | bytes | np.ndarray) -> memoryview:
    view = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def payload_nbytes(payload: Payload | bytes | np.ndarray) -> int:
    if isinstance(payload, tuple):
        return sum(memoryview(p).nbytes for p in payload)
    return payload.nbytes if isinstance(payload, np.ndarray) else memoryview(payload).nbytes


def payload_checksum(payload: Payload | bytes | np.ndarray) -> int:
    """xxh3_64 of the payload bytes (of the regions in order, if several)."""
    if not isinstance(payload, tuple):
        return xxhash.xxh3_64_intdigest(payload.data if isinstance(payload, np.ndarray) else payload)
    hasher = xxhash.xxh3_64()
    for part in payload:
        hasher.update(part)
    return hasher.intdigest()


def payload_checksums(payloads: Sequence[Payload | np.ndarray]) -> list[int]:
    """`payload_checksum` of each payload; with the extension loaded, the whole batch in one
    native call that gives the GIL up once. Python's xxhash gives it up for every payload, and
    in a process where another thread runs Python (an engine's scheduler) each re-take can
    wait a switch interval (``sys.getswitchinterval()``), once per payload."""
    native = checksummer() if len(payloads) > 1 else None
    if native is None:
        return [payload_checksum(p) for p in payloads]
    return native([p if isinstance(p, tuple) else (p,) for p in payloads])


def copy_parts_into(dst: np.ndarray, payload: Payload) -> None:
    """Copy a payload's regions, in order, into the contiguous uint8 array `dst`."""
    offset = 0
    for part in payload_parts(payload):
        n = part.nbytes
        np.copyto(dst[offset : offset + n], np.frombuffer(part, dtype=np.uint8))
        offset += n


def copy_into_parts(payload: Payload, src: np.ndarray | memoryview) -> None:
    """Copy the contiguous bytes `src` into a payload's regions, in order."""
    source = np.frombuffer(src, dtype=np.uint8) if not isinstance(src, np.ndarray) else src
    offset = 0
    for part in payload_parts(payload):
        n = part.nbytes
        np.copyto(np.frombuffer(part, dtype=np.uint8), source[offset : offset + n])
        offset += n


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    """Decoded header of one stored object. See the module docstring for the wire layout."""

    fingerprint: str
    tenant: str
    chunk: str
    member: str
    token_count: int
    payload_len: int
    checksum: int | None
    """xxh3_64 of the payload; None only in memory before the object leaves the process."""
    token_ids: tuple[int, ...] | None = None
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        if self.checksum is None:
            raise ValueError("cannot encode a header without a payload checksum")
        flags = FLAG_TOKENS if self.token_ids is not None else 0
        variable = b"".join(_short_str(s) for s in (self.tenant, self.chunk, self.member))
        if self.token_ids is not None:
            ids = np.asarray(self.token_ids, dtype="<u4").tobytes()
            variable += _U32.pack(len(self.token_ids)) + ids
        header_len = _PREFIX.size + len(variable) + _U32.size
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(f"header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
        prefix = _PREFIX.pack(
            MAGIC,
            self.version,
            header_len,
            flags,
            self.token_count,
            self.payload_len,
            self.checksum,
            bytes.fromhex(self.fingerprint),
        )
        body = prefix + variable
        return body + _U32.pack(xxhash.xxh32_intdigest(body))

    @property
    def encoded_len(self) -> int:
        return len(self.encode())

    @classmethod
    def batch(
        cls, fingerprint: str, tenant: str, chunks: Sequence[str], member: str, token_count: int, payload_len: int
    ) -> list[ObjectHeader]:
        """``[ObjectHeader(fingerprint, tenant, c, member, token_count, payload_len, None) for c in chunks]``,
        built with slot stores (no frozen-init ``__setattr__`` per field): headers of a batch of
        pages that differ only by chunk, before their checksum is known. The
        result is equal, field for field, to the constructor's."""
        fixed = {
            "fingerprint": fingerprint,
            "tenant": tenant,
            "member": member,
            "token_count": token_count,
            "payload_len": payload_len,
            "checksum": None,
            "token_ids": None,
            "version": FORMAT_VERSION,
        }
        return build_many(cls, fixed, "chunk", chunks)


def _short_str(s: str) -> bytes:
    raw = s.encode()
    if len(raw) > 255:
        raise ValueError(f"header string too long: {s[:40]!r}...")
    return _U8.pack(len(raw)) + raw


def header_length(prefix: bytes | memoryview) -> int:
    """Total header length from the first `HEADER_PREFIX_BYTES` bytes; raises ObjectRejected."""
    if len(prefix) < _PREFIX.size:
        raise ObjectRejected(RejectReason.TRUNCATED, f"{len(prefix)} header bytes")
    magic, version, header_len, *_ = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise ObjectRejected(RejectReason.BAD_MAGIC)
    if version != FORMAT_VERSION:
        raise ObjectRejected(RejectReason.VERSION, f"version {version}, reader {FORMAT_VERSION}")
    if not (_PREFIX.size + 3 + _U32.size <= header_len <= MAX_HEADER_BYTES):
        raise ObjectRejected(RejectReason.TRUNCATED, f"header_len {header_len}")
    return int(header_len)


HEADER_PREFIX_BYTES = _PREFIX.size


def decode_header(buf: bytes | bytearray | memoryview) -> ObjectHeader:
    """Decode and self-check a header from the start of `buf`. Raises ObjectRejected."""
    view = memoryview(buf)
    header_len = header_length(view[: _PREFIX.size])
    if len(view) < header_len:
        raise ObjectRejected(RejectReason.TRUNCATED, f"have {len(view)} of {header_len} header bytes")
    body = view[: header_len - _U32.size]
    (stored_xxh,) = _U32.unpack_from(view, header_len - _U32.size)
    if xxhash.xxh32_intdigest(body) != stored_xxh:
        raise ObjectRejected(RejectReason.HEADER_CHECKSUM)
    _, version, _, flags, token_count, payload_len, checksum, fp = _PREFIX.unpack_from(view, 0)
    offset = _PREFIX.size
    strings: list[str] = []
    try:
        for _ in range(3):
            (n,) = _U8.unpack_from(view, offset)
            offset += 1
            strings.append(bytes(view[offset : offset + n]).decode())
            offset += n
        token_ids: tuple[int, ...] | None = None
        if flags & FLAG_TOKENS:
            (count,) = _U32.unpack_from(view, offset)
            offset += _U32.size
            if offset + 4 * count > len(body):
                raise ObjectRejected(RejectReason.TRUNCATED, "token ids")
            token_ids = tuple(int(t) for t in np.frombuffer(view[offset : offset + 4 * count], dtype="<u4"))
            offset += 4 * count
    except (struct.error, UnicodeDecodeError) as exc:
        raise ObjectRejected(RejectReason.TRUNCATED, str(exc)) from None
    if offset != len(body):
        raise ObjectRejected(RejectReason.TRUNCATED, "header length does not match its fields")
    return ObjectHeader(
        fingerprint=fp.hex(),
        tenant=strings[0],
        chunk=strings[1],
        member=strings[2],
        token_count=int(token_count),
        payload_len=int(payload_len),
        checksum=int(checksum),
        token_ids=token_ids,
        version=int(version),
    )


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a reader requires of an object before it may be loaded.

    `token_count` None accepts any count; `payload_len` None accepts any
    length that fits the destination.
    """

    fingerprint: str
    tenant: str
    chunk: str
    member: str
    token_count: int | None = None
    payload_len: int | None = None
    token_ids_prefix: tuple[int, ...] | None = None
    """For tails: the object's token ids must start with these."""

    @classmethod
    def batch(
        cls,
        fingerprint: str,
        tenant: str,
        chunks: Sequence[str],
        member: str,
        token_count: int | None,
        payload_len: int | None,
    ) -> list[Expectation]:
        """``[Expectation(fingerprint, tenant, c, member, token_count, payload_len) for c in chunks]``,
        built with slot stores; equal, field for field, to the constructor's."""
        fixed = {
            "fingerprint": fingerprint,
            "tenant": tenant,
            "member": member,
            "token_count": token_count,
            "payload_len": payload_len,
            "token_ids_prefix": None,
        }
        return build_many(cls, fixed, "chunk", chunks)


@dataclass(frozen=True, slots=True)
class PageExpectation:
    """What every whole-page object of one member must match: an `Expectation` whose chunk
    is each key's own (one per batch, not one per page; no token ids: whole pages)."""

    fingerprint: str
    tenant: str
    member: str
    token_count: int | None
    payload_len: int | None

    def of(self, chunks: Sequence[str]) -> list[Expectation]:
        """The `Expectation` of each chunk (`Expectation.batch`): what `check_header` checks."""
        return Expectation.batch(self.fingerprint, self.tenant, chunks, self.member, self.token_count, self.payload_len)

    def matches(self, header: ObjectHeader, chunk: str) -> bool:
        """``check_header(header, <the Expectation of chunk>) is None``, without building it
        (a mismatch says no reason: the caller reads such an object the ordinary way, which
        counts why)."""
        return (
            header.fingerprint == self.fingerprint
            and header.tenant == self.tenant
            and header.chunk == chunk
            and header.member == self.member
            and (self.token_count is None or header.token_count == self.token_count)
            and (self.payload_len is None or header.payload_len == self.payload_len)
        )


def check_header(header: ObjectHeader, expected: Expectation) -> RejectReason | None:
    """Compare every identifying field; return the first mismatch or None."""
    if header.fingerprint != expected.fingerprint:
        return RejectReason.FINGERPRINT
    if header.tenant != expected.tenant:
        return RejectReason.TENANT
    if header.chunk != expected.chunk:
        return RejectReason.GROUP
    if header.member != expected.member:
        return RejectReason.MEMBER
    if expected.token_count is not None and header.token_count != expected.token_count:
        return RejectReason.TOKEN_COUNT
    if expected.payload_len is not None and header.payload_len != expected.payload_len:
        return RejectReason.LENGTH
    if expected.token_ids_prefix is not None:
        n = len(expected.token_ids_prefix)
        if header.token_ids is None or header.token_ids[:n] != expected.token_ids_prefix:
            return RejectReason.TOKENS
    return None


def check_payload(header: ObjectHeader, payload: Payload | np.ndarray) -> RejectReason | None:
    """Length and checksum of a payload already copied out; None when it is intact."""
    if payload_nbytes(payload) != header.payload_len:
        return RejectReason.LENGTH
    if header.checksum is not None and payload_checksum(payload) != header.checksum:
        return RejectReason.CHECKSUM
    return None


def check_payloads(
    headers: Sequence[ObjectHeader], payloads: Sequence[Payload | np.ndarray]
) -> list[RejectReason | None]:
    """`check_payload` of each (header, payload), the checksums in one `payload_checksums` batch."""
    out: list[RejectReason | None] = [
        RejectReason.LENGTH if payload_nbytes(p) != h.payload_len else None for h, p in zip(headers, payloads)
    ]
    todo = [i for i, h in enumerate(headers) if out[i] is None and h.checksum is not None]
    for i, csum in zip(todo, payload_checksums([payloads[i] for i in todo])):
        if csum != headers[i].checksum:
            out[i] = RejectReason.CHECKSUM
    return out


# -- the fast path of a load: header bytes predicted from the Expectation -------------


class HeaderFastPath:
    """Header sizes and checks a remote tier needs before it can decode anything.

    - `encoded_len(header)`: bytes of ``header.encode()``, without encoding.
    - `read_budget(exp)`: bytes to reserve for the header of an object that can
      match `exp`. Exact for a block (no token ids; room for ``token_count`` ids
      too, as before). A tail (``exp.token_ids_prefix`` set) stores all its token
      ids while the reader knows only the prefix it matched, so its header may
      be up to `MAX_HEADER_BYTES` (the most `ObjectHeader.encode` writes).
    - `check(raw, n, exp)`: the common case of a load, checked without a full
      decode. Accepts a staged object only when every header byte is the one
      `exp` predicts (magic, version, no token ids, token count, payload
      length, fingerprint, tenant, chunk, member), the byte count `n` is header
      + payload, and the header's own xxh32 matches; the payload checksum is
      read from it. Anything else returns None and goes through
      `decode_header` + `check_header`, which name the exact reason. Never
      accepts what the full decode would refuse.

    An instance caches encoded strings and fingerprints: make one per batch."""

    __slots__ = ("_fp", "_strs")

    def __init__(self) -> None:
        self._fp: dict[str, bytes | None] = {}
        self._strs: dict[str, bytes] = {}

    @staticmethod
    def encoded_len(header: ObjectHeader) -> int:
        """Bytes of `header.encode()` (see the layout in the module docstring)."""
        n = (
            _PREFIX.size
            + 3
            + len(header.tenant.encode())
            + len(header.chunk.encode())
            + len(header.member.encode())
            + _U32.size
        )
        if header.token_ids is not None:
            n += _U32.size + 4 * len(header.token_ids)
        return n

    @staticmethod
    def read_budget(exp: Expectation) -> int:
        """Header bytes to reserve when reading an object that can match `exp` (see above)."""
        n = _PREFIX.size + 3 + len(exp.tenant.encode()) + len(exp.chunk.encode()) + len(exp.member.encode()) + _U32.size
        if exp.token_ids_prefix is not None:
            return max(n + _U32.size + 4 * len(exp.token_ids_prefix), MAX_HEADER_BYTES)
        if exp.token_count:
            n += _U32.size + 4 * exp.token_count
        return n

    def _short(self, s: str) -> bytes:
        enc = self._strs.get(s)
        if enc is None:
            raw = s.encode()
            enc = bytes((len(raw),)) + raw if len(raw) <= 255 else b"\xff" * 300  # never matches
            self._strs[s] = enc
        return enc

    def check(self, raw: memoryview, n: int, exp: Expectation) -> tuple[ObjectHeader, int] | None:
        """(header, header length) when `raw[:n]` is exactly the object `exp` predicts, else None."""
        if exp.token_ids_prefix is not None or exp.token_count is None or exp.payload_len is None or n < _PREFIX.size:
            return None
        magic, version, hl, flags, tc, plen, csum, fp = _PREFIX.unpack_from(raw, 0)
        if (
            magic != MAGIC
            or version != FORMAT_VERSION
            or flags
            or tc != exp.token_count
            or plen != exp.payload_len
            or n != hl + plen
        ):
            return None
        want_fp = self._fp.get(exp.fingerprint, b"")
        if want_fp == b"":
            try:
                want_fp = bytes.fromhex(exp.fingerprint)
            except ValueError:
                want_fp = None
            if want_fp is not None and want_fp.hex() != exp.fingerprint:
                want_fp = None  # decode_header would compare the lower-case hex
            self._fp[exp.fingerprint] = want_fp
        if fp != want_fp:
            return None
        tail = self._short(exp.tenant) + self._short(exp.chunk) + self._short(exp.member)
        body_end = hl - _U32.size
        if body_end != _PREFIX.size + len(tail) or raw[_PREFIX.size : body_end].tobytes() != tail:
            return None
        if xxhash.xxh32_intdigest(raw[:body_end]) != _U32.unpack_from(raw, body_end)[0]:
            return None
        return ObjectHeader(exp.fingerprint, exp.tenant, exp.chunk, exp.member, tc, plen, csum), hl
