"""A saved block's vLLM facts, and their wire form in a shared tier's facts rows (`kvpack.observe.router_facts`).

A ``BlockStored`` needs facts only the scheduler that planned the save has: the request's block
hash(es), the parent hash, the token ids, the LoRA adapter (`BlockFacts`). The scheduler keeps them
for its own events (`kvpack.vllm_plugin.kv_events`) and, when the store has a tier other
processes share, hands them to the save (`encode`, as `kvpack.RouterFacts.blob`), so another
instance on that tier announces the block with the same hashes (`decode`).

Hashes agree across instances only with the same hash function and the same ``NONE_HASH`` seed
(vLLM's ``prefix_caching_hash_algo``; the seed is fixed for sha256 and random per process for the
non-crypto hashes unless ``PYTHONHASHSEED`` is shared, which KV-aware routers need anyway).
`hash_identity` names both (with the hash block size and `FACTS_RULE`) by a digest, never the seed
itself: a reader announces only rows of its own identity, so a misconfigured pair announces nothing,
never a wrong hash. A salted request's block has no facts row: only its writer announces it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import BlockHash

from kvpack import GroupKey


@dataclass
class BlockFacts:
    """A saved chunk's vLLM facts, and the tiers it was announced on."""

    hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    tiers: set[str] = field(default_factory=set)
    group: GroupKey | None = None
    """Its kvpack group, once a shared tier announced it (what that tier's sweep follows)."""
    shared: bool = True
    """Whether its facts may be recorded on a shared tier for other instances (False: a salted
    request's block, announced only by the instance that computed it)."""


class _Wire(msgspec.Struct, array_like=True, frozen=True):
    """`BlockFacts` as a facts row's blob (msgpack; decoding validates every field's type)."""

    hashes: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    hash_block_size: int
    lora_id: int | None
    lora_name: str | None


_DECODER = msgspec.msgpack.Decoder(_Wire)
FACTS_RULE = "unsalted-only"
"""Part of `hash_identity`: the rows of a writer that records only unsalted requests' blocks
(`kvpack.policy.tenancy.shares_facts`). Rows of a writer without this rule (which may hold a salted
tenant's token ids) are of another identity: a reader announces none of them."""


def encode(block: BlockFacts, hash_block_size: int) -> bytes:
    """`block`'s facts as a facts row's blob."""
    wire = _Wire(
        [bytes(h) for h in block.hashes],
        bytes(block.parent) if block.parent is not None else None,
        block.token_ids,
        hash_block_size,
        block.lora_id,
        block.lora_name,
    )
    return msgspec.msgpack.encode(wire)


def decode(blob: bytes, hash_block_size: int, per_chunk: int) -> BlockFacts | None:
    """The facts of a blob another instance wrote, or None when it is not one this instance can
    announce (malformed, another hash block size, not one chunk's worth of hashes and tokens)."""
    try:
        wire = _DECODER.decode(blob)
    except msgspec.MsgspecError:
        return None
    if (
        wire.hash_block_size != hash_block_size
        or len(wire.hashes) != per_chunk
        or len(wire.token_ids) != per_chunk * hash_block_size
    ):
        return None
    parent = BlockHash(wire.parent) if wire.parent is not None else None
    hashes = [BlockHash(h) for h in wire.hashes]
    return BlockFacts(hashes, parent, list(wire.token_ids), wire.lora_id, wire.lora_name)


def hash_identity(algo: str, hash_block_size: int) -> str | None:
    """What makes this process's block hashes comparable with another's: a digest of the hash
    function's name, the hash block size and ``NONE_HASH`` (None until vLLM set it: the engine
    initialises it after the connector, and without prefix caching never)."""
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        return None
    rule = f"vllm|{algo}|{hash_block_size}|{FACTS_RULE}|"
    return hashlib.sha256(rule.encode() + bytes(none_hash)).hexdigest()[:32]


def identity_source(algo: str, hash_block_size: int) -> Callable[[], str | None]:
    """`hash_identity`, computed at the first call that finds ``NONE_HASH`` set, then kept."""
    known: list[str] = []

    def identity() -> str | None:
        if not known:
            found = hash_identity(algo, hash_block_size)
            if found is None:
                return None
            known.append(found)
        return known[0]

    return identity
