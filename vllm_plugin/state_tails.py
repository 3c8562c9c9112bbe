"""Mamba state vLLM hands over at a request's finish, as what kvpack saves.

vLLM frees a Mamba group's blocks while a request runs; at finish it offers the state at
a partial block (`register_finished_partial_tail`: group, block, boundary tokens). A state
that ends at a block boundary is that chunk's member (its other members were captured as
computed); one that ends inside a block is the member of a tail, saved with the attention
groups' blocks of that tail, and usable only for a prompt that contains the whole tail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpack import ChunkChain, ChunkHash, Coverage, RequestScope

from .metadata import NO_BLOCK, NULL_BLOCK, BlockRef, block_at
from .scopes import Scope


@dataclass(frozen=True)
class PartialTail:
    """A Mamba state vLLM handed over at request finish (`register_finished_partial_tail`)."""

    group: int
    block_id: int
    boundary: int
    """Tokens the state covers."""


def partial_tails(scope: Scope, num_tokens: int, offloads: Sequence[tuple[int, int, int]]) -> list[PartialTail]:
    """The states of `offloads` (group, block, boundary tokens) kvpack stores: Mamba groups'
    states within the request's `num_tokens`, in a real block. Empty when there is none or
    when they are of different lengths (not one tail)."""
    tails = [
        PartialTail(int(group), int(block), int(boundary))
        for group, block, boundary in offloads
        if 0 <= group < len(scope.groups)
        and scope.groups[group].coverage is Coverage.BOUNDARY
        and 0 < boundary <= num_tokens
        and block != NULL_BLOCK
    ]
    return tails if len({t.boundary for t in tails}) == 1 else []


def state_tail_ref(
    scope: Scope,
    rs: RequestScope,
    tokens: Sequence[int],
    groups: Sequence[Sequence[int]],
    tails: Sequence[PartialTail],
    place_tail: Callable[[RequestScope, ChunkHash | None, tuple[int, ...]], tuple[str, bool]],
) -> BlockRef | None:
    """The handed-over state as the member of a boundary chunk or of a tail (with the
    attention groups' blocks of that tail, `groups`: per group the request's blocks); the
    tail ends where the state does and goes where `place_tail` says. `tokens`: those the
    request computed. None: the state's chunk is not among `tokens`' whole chunks."""
    bs = scope.block_size
    if not tokens:
        return None
    chain = ChunkChain(rs.seed, bs)
    hashes = chain.extend(tokens, len(tokens) // bs)
    state_groups = {g.index for g in scope.groups if g.coverage is Coverage.BOUNDARY}
    c, t = divmod(tails[0].boundary, bs)
    states = {pt.group: pt.block_id for pt in tails}
    if t == 0:  # a state at a block boundary is that chunk's member (its other members were captured)
        if c == 0 or c > len(hashes):
            return None
        return BlockRef(hashes[c - 1], tuple(states.get(g, NO_BLOCK) for g in range(len(groups))), bs)
    ids = tuple(states.get(g, NO_BLOCK if g in state_groups else block_at(b, c)) for g, b in enumerate(groups))
    tail_ids = tuple(int(x) for x in tokens[c * bs : c * bs + t])
    chunk, _ = place_tail(rs, chain.parent(c), tail_ids)
    return BlockRef(chunk, ids, t, tail_ids)
