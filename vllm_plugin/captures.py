"""Captures: saving chunks in the step that completes them, for engines that free blocks early.

vLLM's hybrid allocator releases a sliding-window block once the window has
moved past it, and Mamba state blocks between boundaries, while the request
is still running; by `request_finished` they are gone. For such engines the
scheduler side tracks each request's block table from the scheduler output
and, in every step, turns the chunks that step completes into a capture job
(`TransferJob.capture`): the worker copies those blocks in the same step's
``wait_for_save``, before vLLM can hand them to another request.

Only accepted tokens count: draft tokens scheduled for verification may be
rejected, so a chunk is complete when ``computed + scheduled - drafts``
covers it. Chunks that were never computed by this request (vLLM's own
prefix-cache hits) or that kvpack loaded are not captured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpack.keys import ChunkHash, chunk_hashes

from .metadata import NO_BLOCK, BlockRef, TransferJob, block_at
from .settings import RequestScope

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

@dataclass
class _Running:
    """One tracked request: its block table and how far it is captured."""

    request: Request
    scope: RequestScope
    block_ids: list[list[int]] = field(default_factory=list)
    """Per KV cache group, the request's blocks as vLLM reported them (scheduler output)."""
    hashes: list[ChunkHash] = field(default_factory=list)
    next_chunk: int = 0
    """Chunks before this one are stored (loaded from kvpack) or captured."""


class CaptureTracker:
    """Per-request capture state; `step` turns one scheduler output into capture jobs."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._running: dict[str, _Running] = {}

    def __bool__(self) -> bool:
        return bool(self._running)

    def track(self, request: Request, scope: RequestScope, stored_chunks: int) -> None:
        """Start tracking `request` (idempotent); its first `stored_chunks` are in kvpack already."""
        if request.request_id not in self._running:
            self._running[request.request_id] = _Running(request, scope, next_chunk=stored_chunks)

    def restart(self, req_id: str) -> None:
        """vLLM recomputes the request (its load failed): capture (overwrite) every chunk again."""
        run = self._running.get(req_id)
        if run is not None:
            run.next_chunk = 0

    def forget(self, req_id: str) -> int | None:
        """Stop tracking `req_id` (finished): the chunks it had stored or captured, None
        when it was not tracked."""
        run = self._running.pop(req_id, None)
        return run.next_chunk if run is not None else None

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
        scheduled = int(out.num_scheduled_tokens.get(req_id, 0))
        drafts = len((getattr(out, "scheduled_spec_decode_tokens", None) or {}).get(req_id, ()))
        done = min(computed + scheduled - drafts, len(run.request.all_token_ids))
        end = done // bs
        start = max(run.next_chunk, computed // bs)  # earlier chunks were never computed here
        if end <= start or not run.block_ids:
            run.next_chunk = max(run.next_chunk, end)
            return []
        if len(run.hashes) < end:
            parent = run.hashes[-1] if run.hashes else run.scope.seed
            tokens = list(run.request.all_token_ids[len(run.hashes) * bs : end * bs])
            run.hashes.extend(chunk_hashes(tokens, bs, parent=parent))
        refs = []
        for i in range(start, end):
            ids = tuple(block_at(group_blocks, i) for group_blocks in run.block_ids)
            if any(b != NO_BLOCK for b in ids):
                refs.append(BlockRef(run.hashes[i], ids, bs))
        run.next_chunk = end
        return [TransferJob(req_id, run.scope.tenant, tuple(refs), capture=True)] if refs else []
