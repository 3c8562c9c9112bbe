"""What an adapter hands the transfer runner: loads and saves with engine facts already
translated (block ids become opaque ints to report, copies become callables on a lane).

Lifecycle verbs in pairs, as in vLLM's offloading worker: a job is submitted
(`TransferRunner.submit_load` / `submit_save`) and its outcome polled (`finished`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..session import ChunkFacts, MemberObject, ObjectIO
from .staging import Lane, Staged, Staging


@dataclass(frozen=True)
class LoadChunk:
    """One chunk of a load: the engine blocks it writes (reported when it fails), the tokens
    it restores, and whether it is restored with its draft state (None: no draft model)."""

    blocks: frozenset[int]
    tokens: int
    draft: bool | None = None


@dataclass(frozen=True, eq=False)
class PlannedLoad:
    """A load's reads and its scatter, built on the load thread (`LoadJob.plan`).

    `reads[i]` lands in staging rows of `rows` and belongs to chunk `chunk_of[i]`; a chunk
    is restored only when every one of its reads loaded. `scatter(good, lent, lane)`
    launches the copies of the chunks marked good into the engine's blocks, on `lane`;
    ``lent[i]``, when not None, is read `i`'s payload where a tier holds it (read-only,
    valid until the scatter's event): the scatter reads it there instead of from its
    staging row, which was left unwritten. It returns the lent bytes it read in place
    (a lent payload it must first copy into its row does not count).

    `lends`: whether the scatter may be given lent payloads (`Session.complete_load` with ``lend``):
    the adapter says so only where a lent payload costs no copy more than a staged one (a
    cache in host memory, which the conversion reads a tier's slots into directly; a GPU
    whose staging device registered the host store's mapping, `StagingDevice.reads_host_in_place`).
    Else every ``lent[i]`` is None."""

    reads: list[ObjectIO]
    chunk_of: list[int]
    rows: list[torch.Tensor]
    scatter: Callable[[Sequence[bool], Sequence[memoryview | None], Lane], int]
    lends: bool = False


@dataclass(frozen=True, eq=False)
class LoadJob:
    """One request's load. `nbytes`: payload bytes it reads (the in-flight bound counts them).
    `hints`: (chunk, member, tier) where the scheduler's lookup found each object.
    `handoff_wait_s`: how long to wait for objects another instance is still storing."""

    job_id: str
    tenant: str
    chunks: tuple[LoadChunk, ...]
    nbytes: int
    plan: Callable[[Staging], PlannedLoad]
    hints: tuple[tuple[str, str, str], ...] = ()
    handoff_wait_s: float = 0.0

    @property
    def blocks(self) -> set[int]:
        """Every engine block the load writes (what a failed or cancelled load reports)."""
        return {b for c in self.chunks for b in c.blocks}


@dataclass(frozen=True, eq=False)
class Gathered:
    """One member's gathered rows of a save: row i is the object of chunk `facts[i]`."""

    obj: MemberObject
    facts: list[ChunkFacts]
    staged: Staged

    def objects(self) -> list[ObjectIO]:
        """The objects over the rows (waits for the gather's event first)."""
        rows = self.staged.host_rows()
        return [ObjectIO(f, self.obj, memoryview(rows[i])) for i, f in enumerate(self.facts)]


@dataclass(frozen=True, eq=False)
class SaveJob:
    """One request's save. `gather(staging)` launches the copies of its blocks (members in
    the order they must land) and returns them. A `capture` is gathered when submitted (the
    engine may reuse its blocks after this step) and never reported as finished; any other
    save is gathered on the save thread (the engine keeps its blocks until `finished`
    reports it). `blocks`: engine blocks saved; `nbytes`: payload bytes (the queue bound)."""

    job_id: str
    tenant: str
    blocks: int
    nbytes: int
    gather: Callable[[Staging], list[Gathered]]
    capture: bool = True


@dataclass(frozen=True)
class Finished:
    """What `TransferRunner.finished` reports: saves done, loads done (failed ones too), and
    the loads among them that failed (their blocks are in `take_failed_blocks`)."""

    saves: set[str]
    loads: set[str]
    failed: set[str]


@dataclass
class LoadTask:
    """A submitted load while it runs. `staged` is set, under the runner's lock, once its
    scatter is launched: from then on it is not cancelled but reported after its event."""

    job: LoadJob
    started: float
    after_saves: int
    """Saves queued before this load (it may read what they store: it waits for them)."""
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    staged: Staged | None = None
    failed_blocks: set[int] = field(default_factory=set)
    plan: PlannedLoad | None = None
    """Set once planned (a handoff's, while it waits for its objects: `kvpack.transfers.handoffs`)."""


class ByteBound:
    """Bytes held by admitted transfers, at most `limit`: `admit(n)` is False when the held
    bytes plus n would pass it, unless nothing is held (one transfer larger than the bound
    still runs). Every admitted n is given back once with `release`. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def admit(self, nbytes: int) -> bool:
        with self._lock:
            if self.held and self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
