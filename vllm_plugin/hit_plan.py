"""What the scheduler side decided for one request: its hit, and the Mamba states vLLM hands over."""

from __future__ import annotations

from dataclasses import dataclass

from kvpack import ChunkHash, RequestScope

from .metadata import BlockRef


@dataclass(frozen=True)
class HitPlan:
    """The outcome of one request's lookup on the scheduler side (memoised: vLLM may ask more
    than once). Not the core's `kvpack.lifecycle.LoadPlan` (a worker's pins and tiers)."""

    num_tokens: int
    scope: RequestScope | None
    hashes: tuple[ChunkHash, ...]
    hit_chunks: int
    matched: int
    """Tokens loadable from the store (capped at num_tokens - `Scope.min_prefill_tokens`)."""
    tail: BlockRef | None
    """The tail object to load into block `hit_chunks`, when the match reaches into it."""
    full_chunks: int = 0
    """Leading hit chunks with every member; chunks `full_chunks..hit_chunks` lack
    the sidecar draft (target_only) and load the target member only."""
    handoff: bool = False
    """A prefill instance's prompt (`handoff`): loaded with a bounded wait for objects
    still landing, not found by a lookup."""
    sources: tuple[int, ...] = ()
    """Canonical objects: per hit chunk, the head split that holds it (`BlockRef.source`)."""
    tiers: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Per hit chunk, (member, tier) where the lookup found each member (`BlockRef.tiers`)."""


@dataclass(frozen=True)
class PartialTail:
    """A Mamba state vLLM handed over at request finish (`register_finished_partial_tail`)."""

    group: int
    block_id: int
    boundary: int
    """Tokens the state covers."""
