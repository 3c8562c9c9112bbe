"""Data passed between the two halves of the connector (plain, picklable dataclasses).

Scheduler -> workers, once per step (`KVPackConnectorMetadata`): the blocks to
load into and the blocks to save, each with the chunk key it maps to. Workers
-> scheduler (`KVPackWorkerMetadata`, aggregated over ranks by vLLM): what each
worker put into or evicted from its host-memory tier, so the scheduler side
can answer lookups for memory it cannot see (vLLM's default multi-process mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class BlockRef:
    """One vLLM block <-> one stored chunk.

    `token_count` is the tokens the object covers (the block size, or a tail's
    length). `token_ids` is set for tail objects: on save, the tail's ids; on
    load, the ids the object's stored ids must start with. `with_draft` is
    False for a load of a chunk whose sidecar draft member is missing
    (``draft_policy: target_only``): only the target member is restored.
    """

    chunk: str
    block_id: int
    token_count: int
    token_ids: tuple[int, ...] | None = None
    with_draft: bool = True


@dataclass(frozen=True)
class TransferJob:
    """All blocks of one request to load or to save this step."""

    req_id: str
    tenant: str
    blocks: tuple[BlockRef, ...]


@dataclass
class KVPackConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferJob] = field(default_factory=list)
    saves: list[TransferJob] = field(default_factory=list)


@dataclass(frozen=True)
class StoredObject:
    """An object a worker put into its memory tier (a tail carries its token ids)."""

    key: str
    token_count: int
    payload_len: int
    token_ids: tuple[int, ...] | None = None


@dataclass
class KVPackWorkerMetadata(KVConnectorWorkerMetadata):
    stored: list[StoredObject] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    """Group keys (``GroupKey.as_str()``) evicted from memory."""
    failed_loads: list[str] = field(default_factory=list)
    """Requests with a block that could not be loaded: never offered again (vLLM recomputes)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVPackWorkerMetadata):
            return KVPackWorkerMetadata(
                self.stored + other.stored, self.evicted + other.evicted, self.failed_loads + other.failed_loads
            )
        return self
