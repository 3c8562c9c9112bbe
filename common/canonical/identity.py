"""What a canonical object is, for every engine: its group and member fingerprints.

Canonical objects (`kvpack.canonical.geometry` for the bytes, `kvpack.identity.heads` for the head
ranges) are what a vLLM engine at any TP size, on any CPU type, and an SGLang server
write and read alike. Their fingerprints therefore say what the bytes are and nothing
about the writer: the group covers the model's identity (`kvpack.identity.model_identity`: a
digest of the checkpoint, or the user's ``model_id``), the KV dtype, the tokens per
chunk and the format version; a member adds its head range, the layer count and the
head geometry. Engine, TP size, CPU attention ISA and attention backend are absent on
purpose: the copy converts them away.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..identity.heads import HeadRange, HeadSplit, sources
from ..identity.layout_spec import KVLayoutSpec
from .geometry import CANONICAL_FORMAT

ENGINE = f"canonical{CANONICAL_FORMAT}"
"""`KVLayoutSpec.engine` of every canonical group: the same whoever writes it."""


def group_spec(model: str, dtype: str, chunk_tokens: int) -> KVLayoutSpec:
    """The canonical group of a model identity, KV dtype (``float32``, ``bfloat16``...) and chunk size."""
    return KVLayoutSpec(engine=ENGINE, model=model, dtype=dtype.removeprefix("torch."), chunk_tokens=chunk_tokens)


def head_range_fingerprint(group: KVLayoutSpec, split: HeadSplit, heads: HeadRange, num_layers: int) -> str:
    """The header fingerprint of the object holding `heads` of `num_layers` layers (a reader
    computes it for any writer's range)."""
    spec = KVLayoutSpec(
        engine=group.engine,
        model=group.model,
        dtype=group.dtype,
        chunk_tokens=group.chunk_tokens,
        layer_shape=(heads.size, group.chunk_tokens, split.head_dim),
        extra=(("heads", f"{heads.start}-{heads.stop}of{split.num_heads}"), ("layers", str(num_layers))),
    )
    return spec.member_fingerprint


@dataclass(frozen=True)
class StoredRange:
    """One object a writer of some head split stores, as a reader of its own heads uses it."""

    heads: HeadRange
    """The heads the object holds."""
    part: HeadRange
    """Of those, the heads the reader keeps (inside its own range)."""
    member: str
    fingerprint: str


def split_sources(
    group: KVLayoutSpec, split: HeadSplit, own: HeadRange, num_layers: int
) -> tuple[tuple[StoredRange, ...], ...]:
    """Per head split a writer at some TP size stores (`HeadSplit.partitions` order, the
    reader's own first), the objects overlapping `own`, with their member names and
    fingerprints: fixed for an engine's lifetime, so computed once at registration."""
    return tuple(
        tuple(
            StoredRange(stored, part, split.member(stored), head_range_fingerprint(group, split, stored, num_layers))
            for stored, part in sources(own, partition)
        )
        for partition in split.partitions()
    )
