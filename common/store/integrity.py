"""Opt-in keyed integrity for objects that leave the process (disk, Mooncake).

xxh3 payload checksums catch damage, not forgery: whoever can write the store
folder or the Mooncake cluster can recompute them. With
`KVPackConfig.integrity_key` set, the header's u64 checksum field holds a
keyed MAC instead: HMAC-SHA256 under the key, truncated to 8 bytes, over
`CONTEXT`, the encoded header with its checksum field zeroed, then the
payload regions in order. (HMAC-SHA256 rather than keyed BLAKE2b: OpenSSL's
SHA-256 runs on the CPUs' SHA extensions where they have them, and BLAKE2b has
no such unit; `kvpack bench tiers` measures the keyed path's cost.) Every field a reader relies on (fingerprint,
tenant, chunk, member, token count and ids, payload length) and every payload
byte is covered, so an object forged or altered without the key, or written
under another key, fails `IntegrityKey.verify` (a forgery succeeds with
probability 2**-64 per try) and is refused as `RejectReason.INTEGRITY`.

`KVStore` seals every object on its way to a lower tier (`seal_items`) and
checks every load from one (`check_loaded`), for every tier that leaves the
process whatever `checksum` says (the tiers' own xxh3 check is then off: the
MAC subsumes it). Host-memory objects stored by this process carry no
checksum and are not checked (they never left it); ones promoted from a lower
tier carry the MAC and are checked under ``checksum: always``. The layout is
unchanged, so mixing keyed and unkeyed processes on one store makes each
refuse the other's objects, counted, never loads them.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import replace

from ..identity.objects import ObjectHeader, Payload, RejectReason, payload_parts
from ..tiers.base import GetResult, PutItem, TierStatus

CONTEXT = b"kvpack-object-mac-1\x00"
DIGEST_BYTES = 8


class IntegrityKey:
    """A 16-64 byte key and the MAC it computes (see the module docstring). Thread-safe."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not 16 <= len(key) <= 64:
            raise ValueError("an integrity key is 16-64 bytes")
        self._key = bytes(key)

    def mac(self, header: ObjectHeader, payload: Payload) -> int:
        """The keyed digest of `header` (checksum field ignored) and `payload`, as a u64."""
        h = hmac.new(self._key, CONTEXT, "sha256")
        h.update(replace(header, checksum=0).encode())
        for part in payload_parts(payload):
            h.update(part)
        return int.from_bytes(h.digest()[:DIGEST_BYTES], "little")

    def seal(self, header: ObjectHeader, payload: Payload) -> ObjectHeader:
        """`header` with its checksum field set to the MAC."""
        return replace(header, checksum=self.mac(header, payload))

    def verify(self, header: ObjectHeader, payload: Payload) -> bool:
        return header.checksum is not None and header.checksum == self.mac(header, payload)


def seal_items(key: IntegrityKey, items: Sequence[PutItem]) -> list[PutItem]:
    """Each item with its header sealed (any checksum it carried is replaced)."""
    return [replace(item, header=key.seal(item.header, item.payload)) for item in items]


def check_loaded(
    key: IntegrityKey, dsts: Sequence[Payload], results: Sequence[GetResult], leaves_process: bool, verify: bool
) -> list[GetResult]:
    """`results` with every OK load whose MAC does not match turned into REJECTED(INTEGRITY).

    A tier that leaves the process is always checked; the memory tier only under
    `verify` and only for objects that carry a checksum (promoted from a lower tier)."""
    out = list(results)
    for i, (dst, res) in enumerate(zip(dsts, results)):
        header = res.header
        if not res.ok or header is None:
            continue
        if not leaves_process and (not verify or header.checksum is None):
            continue
        if not key.verify(header, dst):
            out[i] = GetResult(TierStatus.REJECTED, header, RejectReason.INTEGRITY, "keyed MAC does not match")
    return out
