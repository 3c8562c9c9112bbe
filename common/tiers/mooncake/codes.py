"""Mooncake's return codes, each mapped to one kvpack outcome (`TierStatus`).

Mooncake answers every data call with an int: >= 0 is success (for a get, the
bytes read), a negative value is one of the codes below. `code_info` names
it, says which `TierStatus` a caller reports for it, and whether it is a
connection-level failure that opens the tier's circuit breaker. A code this
table does not know is an ERROR, named ``UNKNOWN_<code>``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..base import TierStatus


class Code(enum.IntEnum):
    """Mooncake's error codes (``mooncake-store/include/types.h``), by name."""

    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SHARD_INDEX_OUT_OF_RANGE = -100
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    """Also a get into a buffer smaller than the object."""
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_HAS_REPLICATION_TASK = -708
    OBJECT_NO_REPLICATION_TASK = -709
    REPLICA_NOT_FOUND = -710
    REPLICA_ALREADY_EXISTS = -711
    REPLICA_IS_GONE = -712
    REPLICA_NOT_IN_LOCAL_MEMORY = -713
    OBJECT_REPLICA_BUSY = -714
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    ETCD_OPERATION_ERROR = -1000
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    TENANT_QUOTA_EXCEEDED = -1700
    TENANT_NOT_REGISTERED = -1701
    TENANT_NOT_EMPTY = -1702


@dataclass(frozen=True)
class CodeInfo:
    """What one return code means to kvpack."""

    name: str
    status: TierStatus
    trips_breaker: bool = False
    """A connection-level failure: stop calling for the back-off period."""


_OUTCOMES: dict[Code, tuple[TierStatus, bool]] = {
    Code.INTERNAL_ERROR: (TierStatus.ERROR, False),
    Code.BUFFER_OVERFLOW: (TierStatus.ERROR, False),
    Code.SHARD_INDEX_OUT_OF_RANGE: (TierStatus.ERROR, False),
    Code.SEGMENT_NOT_FOUND: (TierStatus.ERROR, False),
    Code.SEGMENT_ALREADY_EXISTS: (TierStatus.ERROR, False),
    Code.CLIENT_NOT_FOUND: (TierStatus.UNAVAILABLE, True),
    Code.NO_AVAILABLE_HANDLE: (TierStatus.NO_SPACE, False),
    Code.INVALID_VERSION: (TierStatus.ERROR, False),
    Code.INVALID_KEY: (TierStatus.ERROR, False),
    Code.WRITE_FAIL: (TierStatus.ERROR, False),
    Code.INVALID_PARAMS: (TierStatus.ERROR, False),
    Code.ILLEGAL_CLIENT: (TierStatus.UNAVAILABLE, True),
    Code.INVALID_WRITE: (TierStatus.ERROR, False),
    Code.INVALID_READ: (TierStatus.ERROR, False),
    Code.INVALID_REPLICA: (TierStatus.ERROR, False),
    Code.REPLICA_IS_NOT_READY: (TierStatus.MISS, False),
    Code.OBJECT_NOT_FOUND: (TierStatus.MISS, False),
    Code.OBJECT_ALREADY_EXISTS: (TierStatus.OK, False),
    Code.OBJECT_HAS_LEASE: (TierStatus.ERROR, False),
    Code.LEASE_EXPIRED: (TierStatus.ERROR, False),
    Code.OBJECT_HAS_REPLICATION_TASK: (TierStatus.ERROR, False),
    Code.OBJECT_NO_REPLICATION_TASK: (TierStatus.ERROR, False),
    Code.REPLICA_NOT_FOUND: (TierStatus.MISS, False),
    Code.REPLICA_ALREADY_EXISTS: (TierStatus.ERROR, False),
    Code.REPLICA_IS_GONE: (TierStatus.MISS, False),
    Code.REPLICA_NOT_IN_LOCAL_MEMORY: (TierStatus.ERROR, False),
    Code.OBJECT_REPLICA_BUSY: (TierStatus.ERROR, False),
    Code.TRANSFER_FAIL: (TierStatus.ERROR, False),
    Code.CHECKSUM_MISMATCH: (TierStatus.REJECTED, False),
    Code.RPC_FAIL: (TierStatus.UNAVAILABLE, True),
    Code.RPC_TIMEOUT: (TierStatus.UNAVAILABLE, True),
    Code.ETCD_OPERATION_ERROR: (TierStatus.UNAVAILABLE, True),
    Code.UNAVAILABLE_IN_CURRENT_STATUS: (TierStatus.UNAVAILABLE, True),
    Code.UNAVAILABLE_IN_CURRENT_MODE: (TierStatus.UNAVAILABLE, True),
    Code.TENANT_QUOTA_EXCEEDED: (TierStatus.NO_SPACE, False),
    Code.TENANT_NOT_REGISTERED: (TierStatus.UNAVAILABLE, False),
    Code.TENANT_NOT_EMPTY: (TierStatus.ERROR, False),
}

MOONCAKE_CODES: dict[int, CodeInfo] = {
    int(c): CodeInfo(c.name, status, trips) for c, (status, trips) in _OUTCOMES.items()
}
"""Every known code -> its outcome."""

OBJECT_NOT_FOUND = int(Code.OBJECT_NOT_FOUND)
INVALID_PARAMS = int(Code.INVALID_PARAMS)
TENANT_NOT_REGISTERED = int(Code.TENANT_NOT_REGISTERED)
NOT_CALLED = int(Code.RPC_FAIL)
"""What a call the tier could not make answers (its client is not open, or
closing): an RPC failure, which opens the breaker like a lost connection."""
_OK = CodeInfo("OK", TierStatus.OK)


def code_info(code: int) -> CodeInfo:
    """The named outcome of a Mooncake return code (unknown negatives are ERROR)."""
    if code >= 0:
        return _OK
    return MOONCAKE_CODES.get(code, CodeInfo(f"UNKNOWN_{code}", TierStatus.ERROR))


def describe(code: int) -> str:
    """``mooncake NAME (code)``: how logs and result details name a code."""
    return f"mooncake {code_info(code).name} ({code})"
