"""Save as computed: every chunk is stored in the step whose forward pass computed it.

This is kvpack's one save path on vLLM. The scheduler side tracks each
request's block table from the scheduler output and, in every step, turns
what that step computes into a capture job (`TransferJob.capture`): the
worker copies those blocks out in the same step's ``wait_for_save``, right
after the forward, and stores them in the background. So:

- a prefix computed by one request is a hit for the next request with that
  prefix while the first is still decoding (no wait for it to finish);
- nothing waits for a later engine step: an offline ``LLM.generate()`` that
  returns, a script that ends, has every computed block copied already (the
  store's exit flush then writes it to disk, `kvpack.exit_flush`);
- blocks vLLM frees early (sliding window, Mamba state) are copied before
  they can be reused.

What a step stores: the full chunks it completes; the prompt's partial last
block as a tail object with its token ids, in the step that computes the
prompt's last token; and, in a step that may end the request by length
(``max_tokens``), the computed part of the last block as a tail. A request
that ends otherwise (EOS, a stop token or string, an abort) has its last
partial block saved at finish (`finish_tail`): vLLM keeps that one block until
the workers report the save. Only
accepted tokens count: draft tokens scheduled for verification may be
rejected, so a chunk is complete when ``computed + scheduled - drafts``
covers it. Chunks this request did not compute (vLLM's own prefix-cache
hits, chunks kvpack loaded) are not stored again. Mamba hybrids store
partial tails only with the state vLLM hands over at finish
(`SchedulerSide.register_finished_partial_tail`), so no tail here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpack import ChunkChain, ChunkHash, RequestScope

from .metadata import NO_BLOCK, BlockRef, TransferJob, block_at

TailPlacer = Callable[[RequestScope, "ChunkHash | None", tuple[int, ...]], "tuple[str, bool]"]
"""(request scope, parent chunk, tail token ids) -> (tail chunk, already stored): `TailSlots.place`."""

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _Running:
    """One tracked request: its block table and how far it is captured."""

    request: Request
    scope: RequestScope
    chain: ChunkChain
    """The request's chunk hashes so far (from its scope's seed), extended as it is captured."""
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, the request's blocks as vLLM reported them (scheduler output)."""
    next_chunk: int = 0
    """Chunks before this one are stored (loaded from kvpack) or captured."""
    tail_end: int = 0
    """Token count of the last tail stored for this request (0: none yet)."""
    prompt_tail: str | None = None
    """Chunk id of the prompt's partial-block tail once placed (a prefill/decode handoff names it)."""


class CaptureTracker:
    """Per-request capture state; `step` turns one scheduler output into capture jobs."""

    def __init__(self, block_size: int, place_tail: TailPlacer | None = None) -> None:
        """`place_tail`: where a tail goes (None: tails are not stored here)."""
        self.block_size = block_size
        self.place_tail = place_tail
        self._running: dict[str, _Running] = {}

    def __bool__(self) -> bool:
        return bool(self._running)

    def track(self, request: Request, scope: RequestScope, stored_chunks: int) -> None:
        """Start tracking `request` (idempotent); its first `stored_chunks` are in kvpack already."""
        if request.request_id not in self._running:
            self._running[request.request_id] = _Running(
                request, scope, ChunkChain(scope.seed, self.block_size), next_chunk=stored_chunks
            )

    def restart(self, req_id: str) -> None:
        """vLLM recomputes the request (its load failed): capture (overwrite) every chunk again."""
        run = self._running.get(req_id)
        if run is not None:
            run.next_chunk = 0
            run.tail_end = 0

    def forget(self, req_id: str) -> _Running | None:
        """Stop tracking `req_id` (finished); its state, None when it was not tracked."""
        return self._running.pop(req_id, None)

    def step(self, out: SchedulerOutput) -> list[TransferJob]:
        """Capture jobs for every chunk this step completes (one job per request at most)."""
        jobs: list[TransferJob] = []
        for new in out.scheduled_new_reqs:
            run = self._running.get(new.req_id)
            if run is not None:
                run.block_ids = [list(ids) for ids in new.block_ids]
                jobs += self._capture(new.req_id, run, int(new.num_computed_tokens), out)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            run = self._running.get(req_id)
            if run is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                run.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not run.block_ids:
                    run.block_ids = [[] for _ in new_ids]
                for g, ids in enumerate(new_ids):
                    run.block_ids[g].extend(ids)
            jobs += self._capture(req_id, run, int(cached.num_computed_tokens[i]), out)
        return jobs

    def _capture(self, req_id: str, run: _Running, computed: int, out: SchedulerOutput) -> list[TransferJob]:
        bs = self.block_size
        request = run.request
        scheduled = int(out.num_scheduled_tokens.get(req_id, 0))
        drafts = len((getattr(out, "scheduled_spec_decode_tokens", None) or {}).get(req_id, ()))
        done = min(computed + scheduled - drafts, len(request.all_token_ids))
        end = done // bs
        start = max(run.next_chunk, computed // bs)  # earlier chunks were never computed here
        tail_at = self._tail_end(request, done, drafts)
        if not run.block_ids or (end <= start and not tail_at):
            run.next_chunk = max(run.next_chunk, end)
            return []
        self._hash_to(run, max(end, tail_at // bs))  # full chunks: a tail's parent is chunk tail_at // bs - 1
        refs = []
        for i in range(start, end):
            ids = tuple(block_at(group_blocks, i) for group_blocks in run.block_ids)
            if any(b != NO_BLOCK for b in ids):
                refs.append(BlockRef(run.chain.hashes[i], ids, bs))
        run.next_chunk = max(run.next_chunk, end)
        if tail_at:
            tail = self._tail_ref(run, tail_at)
            if tail is not None:
                refs.append(tail)
        return (
            [TransferJob(req_id, run.scope.tenant, tuple(refs), capture=True, weights=run.scope.weights)]
            if refs
            else []
        )

    def finish_tail(self, run: _Running, block_ids: Sequence[Sequence[int]]) -> BlockRef | None:
        """The tail a finished request leaves (EOS, stop, abort): the computed tokens of its
        last, partial block, ``c * bs .. n`` with n = the tokens whose KV it computed (the
        last sampled token has none). None: tails are off, n ends on a block boundary (that
        chunk was captured), the tail is stored already (a length finish captured it), or a
        chunk before it was never stored (the tail could not be reached)."""
        if self.place_tail is None:
            return None
        request = run.request
        n = min(int(request.num_computed_tokens), len(request.all_token_ids) - 1)
        c = n // self.block_size
        if n <= run.tail_end or n % self.block_size == 0 or run.next_chunk < c:
            return None
        if any(block_ids):
            run.block_ids = [list(ids) for ids in block_ids]
        self._hash_to(run, c)
        return self._tail_ref(run, n)

    def _hash_to(self, run: _Running, chunks: int) -> None:
        """Extend `run.chain` to the first `chunks` chunks of the request."""
        run.chain.extend(run.request.all_token_ids, chunks)

    def _tail_end(self, request: Request, done: int, drafts: int) -> int:
        """Tokens covered by a tail this step should store (0: none): the prompt's, in the
        step that computes its last token, or everything computed, in a step that may
        end the request by length."""
        if self.place_tail is None or done % self.block_size == 0:
            return 0
        prompt = int(request.num_prompt_tokens)
        if done == prompt:
            return done
        max_tokens = getattr(request, "max_tokens", None)
        if done > prompt and max_tokens is not None and int(request.num_output_tokens) + 1 + drafts >= int(max_tokens):
            return done
        return 0

    def _tail_ref(self, run: _Running, end: int) -> BlockRef | None:
        """The tail object of tokens ``c * bs .. end`` (c = end // bs), unless stored already."""
        assert self.place_tail is not None
        if end <= run.tail_end:
            return None
        c = end // self.block_size
        ids = tuple(block_at(group_blocks, c) for group_blocks in run.block_ids)
        if all(b == NO_BLOCK for b in ids):
            return None
        tail_ids = tuple(int(t) for t in run.request.all_token_ids[c * self.block_size : end])
        chunk, stored = self.place_tail(run.scope, run.chain.parent(c), tail_ids)
        run.tail_end = end
        if end == int(run.request.num_prompt_tokens):
            run.prompt_tail = chunk
        return None if stored else BlockRef(chunk, ids, len(tail_ids), tail_ids)
