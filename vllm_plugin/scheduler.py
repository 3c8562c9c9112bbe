"""Scheduler side: what to load for a new request, what to save in each step.

Lookup (`get_num_new_matched_tokens`): vLLM's request translated into a
`kvpack.HitQuery` (tenant and seed, tokens, block size, members, the tokens vLLM
must compute: `scopes.min_prefill_tokens`) and planned by the core
(`Session.plan_hit`, a handoff included). The rules (whole chunks,
the stored tail's longest common prefix, n - 1 / n - 2, drafts, the hold while a
tier makes its first connect) are `kvpack.policy.hits`'; the plan's count may end inside
a block: the partial block is loaded whole and vLLM computes the rest into it.
A hit whose every object is in the workers' memory (the index says so, or the
host store holds it) and that is at most `sync_load_max_blocks` blocks is loaded inside the step that
computes the rest of the prompt (vLLM's synchronous load: a memcpy before that
step's forward; an async load would cost the request one more engine step,
often another request's prefill). Every other load is asynchronous (the
request waits in WAITING_FOR_REMOTE_KVS while a worker thread restores it).
Hybrid models and handoffs always load asynchronously. Each hit block's load names the tier the lookup
found each member in (`BlockRef.tiers`): this side cannot pin the workers'
memory, so a worker that lost an object since counts it
(``evicted_before_load``, `kvpack.store.lifecycle`) and reads it from another tier.

Save (`build_connector_meta`, every step; see `captures`): the chunks the
step computes, the prompt's partial tail in the step that finishes the
prompt, the tail of a request that may end by length; the workers copy them
right after that step's forward. The scheduler counts them as in the
workers' memory at once (`WorkersMemory.expect`), so the next request with the
same prefix hits while the first still decodes. `request_finished` saves
the last partial block of a request that ended otherwise (EOS, stop, abort:
`CaptureTracker.finish_tail`) and a Mamba state vLLM hands over: it returns
``delay_free_blocks`` (vLLM keeps that request's blocks), the workers queue the
save before the next step's loads (`KVPackConnector.start_load_kv`), copy it
on their save thread, off the forward, and report it through `get_finished`,
which frees the blocks; vLLM keeps stepping until then.

Prefill/decode disaggregation (`handoff`): a request with vLLM's
``do_remote_decode`` gets, at finish, the ``kv_transfer_params`` of a
`Handoff`; a request carrying one (``do_remote_prefill``) is loaded from
what the prefill instance saved, the worker waiting at most ``handoff_wait_ms``
for objects still landing. A handoff of another layout or tenant is refused
with an error and the request is served as any other.

Draft KV (speculative decoding): packed into the ``kv`` objects, or, as a
sidecar, a ``draft`` member (role DRAFT) of every chunk's group. Lookups
declare it, so the core's draft policy decides: ``recompute`` reports no hit
past the first chunk that lacks it, ``target_only`` loads the target member
only for those chunks (`BlockRef.with_draft`); both count
``partial_hits{missing_member="draft"}``.

Hybrid models (several KV cache groups, `SupportsHMA`): every group is a
member of each chunk's kvpack group, required where its attention type needs
it (`Scope.member_specs`): full attention in every chunk, a sliding window
in the chunks it still sees at the boundary, Mamba state at the boundary.
Loads copy each group's blocks that vLLM allocated (a freed sliding-window
block is skipped; Mamba state goes into the boundary block only). Because
vLLM frees sliding-window and Mamba blocks while a request runs, saving as
computed is what makes them storable at all, and Mamba's state at a partial block is saved when
vLLM hands it over (`register_finished_partial_tail`); the state of a tail
is usable only for a prompt that contains the whole tail.

The store seen here has the workers' memory tiers as an index (`workers_memory`,
fed by their reports and this side's saves) in front of the shared tiers (disk,
Mooncake); a host memory tier is read directly.

Every store call here runs on vLLM's scheduler thread, between two engine
steps. Besides each remote call's own bound, one `WaitBudget`
(`io_timeout_ms`) bounds all of a step's remote waits together: once spent,
the rest of the step's lookups see only local tiers (fewer hits, never a
longer step) and tail placement assumes the remote tiers hold nothing (at
worst a tail is written again).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpack import (
    AdapterEvent,
    ChunkHash,
    Coverage,
    HandoffClaim,
    HitPlan,
    HitSources,
    KVPackConfig,
    MetricsInterval,
    RequestScope,
    Session,
    WaitBudget,
)

from .captures import CaptureTracker
from .handoff import Handoff, HandoffError, handoff_claim, wants_remote_decode
from .metadata import (
    KVPackConnectorMetadata,
    KVPackWorkerMetadata,
    TransferJob,
    hit_refs,
)
from .request_scopes import RequestScopes
from .resets import PendingReset
from .scopes import Scope
from .state_tails import PartialTail, partial_tails, state_tail_ref
from .workers_memory import WorkersMemory

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


log = logging.getLogger("kvpack.vllm")


class SchedulerSide:
    def __init__(
        self, config: KVPackConfig, scope: Scope, can_load: bool, can_save: bool, sync_load_max_blocks: int = 0
    ) -> None:
        """`sync_load_max_blocks`: the largest hit loaded inside a step (0: none; see the
        module docstring)."""
        self.config = config
        self.sync_load_max_blocks = sync_load_max_blocks
        self.scope = scope
        self.can_load = can_load
        self.can_save = can_save
        self.memory = WorkersMemory(config, scope)
        # a lookup view: the workers write, this process only reads (no write-back threads)
        self.session = Session.reader(config, self.memory.tiers, scope.fingerprint)
        self._plans: dict[str, HitPlan] = {}
        self._load_issued: set[str] = set()
        """Requests whose load was handed to the workers: at most one load attempt each."""
        self._sync_loads: set[str] = set()
        """Requests whose hit, as last answered to vLLM, loads inside the step."""
        self._pending_loads: dict[str, TransferJob] = {}
        self._pending_saves: list[TransferJob] = []
        self._interval = MetricsInterval(self.session.report.metrics, series=True)
        """The connector's per-interval stats: what this side's store counted since the last take."""
        self._scopes = RequestScopes(config, self.session)
        self._scope_of = self._scopes.of
        """A request's tenant and seed, None when it does not use the cache (`request_scopes`)."""
        self._handoff_refusals = self.session.report.refusals(
            AdapterEvent.HANDOFF_REFUSED, "prefill/decode handoff", log
        )
        """Refused handoffs: counted by `HandoffRefusal`, logged once per reason, nothing kept."""
        self._failed: set[str] = set()
        self._state_groups = {g.index for g in scope.groups if g.coverage is Coverage.BOUNDARY}
        tails = self._place_tail if config.tail_reuse and not self._state_groups else None
        self._captures = CaptureTracker(scope.block_size, tails)
        """Every cacheable request, saved in the steps that compute it (`captures`)."""
        self._partial_tails: dict[str, list[PartialTail]] = {}
        self.resets = PendingReset(self.session, self._plans.clear)
        self._budget = WaitBudget(config.io_timeout_ms / 1000.0)
        """What this scheduler step's lookups and save planning may wait on remote tiers
        in all (renewed when `build_connector_meta` ends, once per step: vLLM asks for
        lookups in ``schedule`` before it, and for finished requests' saves after it)."""

    # -- lookup -----------------------------------------------------------------

    def plan(self, request: Request) -> HitPlan:
        """The request's hit, planned by the core (`Session.plan_hit`, with the claim of a
        prefill instance's handoff); memoised per token count: vLLM may ask more than once."""
        n = int(request.num_tokens)
        cached = self._plans.get(request.request_id)
        if cached is not None and cached.num_tokens == n:
            return cached
        rs = self._scope_of(request)
        if rs is None or request.request_id in self._failed or self.resets.scope is not None:  # no retry, no mid-reset
            plan = HitPlan.miss(n, rs)
        else:
            query = self.scope.hit_query(rs, request.all_token_ids[:n])
            claim = self._handoff_of(request, rs)
            plan = self.session.plan_hit(query, self._budget, claim=claim, pin=self._scopes.pins(request))
        self._plans[request.request_id] = plan
        return plan

    def _handoff_of(self, request: Request, rs: RequestScope) -> HandoffClaim | None:
        """The prefill instance's handoff in `request`'s params (`handoff.handoff_claim`); a
        mismatch is refused here, counted by reason and logged once per reason (the request
        is then served as any other)."""
        params = getattr(request, "kv_transfer_params", None)
        try:
            return handoff_claim(params, self.scope.fingerprint, rs.tenant, [len(s) for s in self.scope.head_splits])
        except HandoffError as exc:
            self._handoff_refusals.refuse(exc.reason, str(exc), request.request_id)
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.can_load:
            if self.can_save:
                rs = self._scope_of(request)
                if rs is not None:
                    self._captures.track(request, rs, 0)
            return 0, False
        if self.session.lookups_held(lambda: self._scope_of(request)):
            return None, False  # vLLM keeps the request queued and asks again next step
        if request.request_id in self._load_issued:
            # vLLM asks again only after the load failed (bad object, tier error, timeout: the
            # blocks were reported and num_computed_tokens went back to 0) or after a
            # preemption. The store would give the same answer, so offering the hit again
            # would loop forever on a refused object: recompute instead.
            return 0, False
        plan = self.plan(request)
        if self.can_save and plan.scope is not None:
            self._captures.track(request, plan.scope, plan.hit_chunks)
        if plan.matched <= num_computed_tokens:
            return 0, False
        if self._loads_in_step(plan):
            self._sync_loads.add(request.request_id)
            return plan.matched - num_computed_tokens, False
        self._sync_loads.discard(request.request_id)
        return plan.matched - num_computed_tokens, True

    def _loads_in_step(self, plan: HitPlan) -> bool:
        """Whether `plan` loads synchronously: one KV cache group (vLLM takes block-level
        failures), one worker, not a handoff, at most `sync_load_max_blocks` blocks, and every
        object in the workers' memory (`WorkersMemory.holds`). One worker: the step's forward runs
        whether or not the load succeeded, and a block that failed on one rank feeds every rank's
        next layers, so the other ranks' saves of that step would hold KV no prompt has (a rank
        drops its own: `TransferRunner.submit_save`); an async load fails before any forward."""
        blocks = plan.hit_chunks + (plan.tail is not None)
        if not (0 < blocks <= self.sync_load_max_blocks) or plan.handoff or self.scope.hybrid or self.scope.world > 1:
            return False
        tail_members = self.scope.split_members(plan.tail.source if plan.tail else 0)
        return self.memory.holds(plan, tail_members, self.session)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, external: int) -> HitSources | None:
        if external <= 0:
            return None
        plan = self._plans.get(request.request_id)
        if plan is None or plan.scope is None:
            return None
        block_ids = blocks.get_block_ids()
        refs = hit_refs(plan, block_ids, external, self.scope.block_size, self._state_groups)
        wait_s = self.config.handoff_wait_ms / 1000.0 if plan.handoff else 0.0
        sync = request.request_id in self._sync_loads
        self._sync_loads.discard(request.request_id)
        self._pending_loads[request.request_id] = TransferJob(
            request.request_id, plan.scope.tenant, refs, handoff_wait_s=wait_s, sync=sync, weights=plan.scope.weights
        )
        self._load_issued.add(request.request_id)
        if sync:
            self.session.report.record(AdapterEvent.SYNC_LOAD_REQUESTED)
        self.session.report.record(AdapterEvent.LOAD_REQUESTED)
        return self.session.accept_hit(plan, external, self.scope.block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None = None) -> KVPackConnectorMetadata:
        if scheduler_output is not None and self._captures:
            for job in self._captures.step(scheduler_output):  # tail placement: the step's budget
                self._pending_saves.append(job)
                self.memory.expect(job, self.session.key)
                self.session.report.record(AdapterEvent.SAVE_BLOCKS_PLANNED, len(job.blocks))
        meta = KVPackConnectorMetadata(list(self._pending_loads.values()), self._pending_saves, self.resets.take())
        self._pending_loads, self._pending_saves = {}, []
        self._budget.renew()  # the step ends here: its lookups and save planning shared one budget
        self.memory.step_ended()
        return meta

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], offloads: list[tuple[int, int, int]]
    ) -> bool:
        """Take Mamba state at a partial block (group, block, boundary tokens) for the save in
        `request_finished`. True: a save job is queued for this request, so vLLM keeps its
        blocks until the workers report it."""
        if not self.can_save or not self.config.tail_reuse or not offloads or self._scope_of(request) is None:
            return False
        tails = partial_tails(self.scope, len(request.all_token_ids), offloads)
        if not tails:
            return False  # nothing kvpack stores, or states of different lengths: not one tail
        self._partial_tails[request.request_id] = tails
        return True

    # -- save -------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Save what the request computed and kvpack lacks. `block_ids`: per KV cache group,
        the request's blocks (a model with one group passes one list). True: a save job
        is queued; vLLM keeps the blocks until the workers report it done."""
        req_id = request.request_id
        partial_tails = self._partial_tails.pop(req_id, None)
        delay, params = self._finish(request, block_ids, partial_tails)
        if partial_tails and not delay:
            # register_finished_partial_tail promised a report for this request: send an empty job
            self._pending_saves.append(TransferJob(req_id, self.config.tenant, ()))
            delay = True
        return delay, params

    def _finish(
        self, request: Request, block_ids: Sequence[Sequence[int]], partial_tails: list[PartialTail] | None
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Every chunk it computed was saved in the step that computed
        it (`captures`); saved here, with the blocks kept until the workers report it: the
        last partial block of a request that did not end by length (`finish_tail`), and a
        Mamba state handed over at finish."""
        req_id = request.request_id
        plan = self._plans.pop(req_id, None)
        run = self._captures.forget(req_id)
        self._pending_loads.pop(req_id, None)
        self._failed.discard(req_id)
        self._load_issued.discard(req_id)
        self._sync_loads.discard(req_id)
        if self.can_save and run is not None and wants_remote_decode(getattr(request, "kv_transfer_params", None)):
            # a prefill instance: tell the decode instance what it saved (blocks captured as computed)
            computed = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
            ranges = len(self.scope.head_splits[0]) if self.scope.head_splits else 0
            handoff = Handoff(self.scope.fingerprint, run.scope.tenant, computed, run.prompt_tail, ranges)
            self.session.report.record(AdapterEvent.HANDOFF_SENT)
            return False, handoff.to_params()
        if self.can_save and run is not None and not partial_tails:
            tail = self._captures.finish_tail(run, block_ids)
            if tail is None:
                return False, None
            job = TransferJob(req_id, run.scope.tenant, (tail,), weights=run.scope.weights)
            self._pending_saves.append(job)
            # a follow-up turn in the next step hits it (the load waits for it)
            self.memory.expect(job, self.session.key)
            self.session.report.record(AdapterEvent.SAVE_BLOCKS_PLANNED)
            return True, None
        if not self.can_save or not partial_tails:
            return False, None
        rs = plan.scope if plan is not None else self._scope_of(request)
        n = min(int(request.num_computed_tokens), len(request.all_token_ids))
        tokens = list(request.all_token_ids[:n])
        tail = state_tail_ref(self.scope, rs, tokens, block_ids, partial_tails, self._place_tail) if rs else None
        if tail is None or rs is None:
            return False, None
        self._pending_saves.append(TransferJob(req_id, rs.tenant, (tail,), weights=rs.weights))
        self.session.report.record(AdapterEvent.SAVE_BLOCKS_PLANNED)
        return True, None

    def _place_tail(self, rs: RequestScope, parent: ChunkHash | None, tail_ids: tuple[int, ...]) -> tuple[str, bool]:
        """Where the tail `tail_ids` after `parent` goes, and whether it is stored already."""
        return self.session.place_tail(rs.tenant, parent, self.scope.all_members, tail_ids, self._budget)

    # -- worker reports ---------------------------------------------------------

    def update_connector_output(self, finished_sending: set[str] | None, report: Any) -> None:
        """Apply the workers' report (`finished_sending` needs no bookkeeping here: vLLM
        itself frees a finished request's blocks once its save is reported)."""
        if isinstance(report, KVPackWorkerMetadata):
            if self._scopes.adopt(report.weights):  # the workers' weights changed in place: lookups
                # from here on under their fingerprint; requests scoped before keep their stamp
                self.scope = self.memory.scope = self.scope.with_weights(self._scopes.weights.identity)
                self.session.bind_group(self.scope.fingerprint, self.scope.spec.describe())
            self.memory.apply(report.stored, report.evicted)
            for req_id in report.failed_loads:
                self._failed.add(req_id)
                self._plans.pop(req_id, None)
                self._captures.restart(req_id)

    def take_stats(self) -> dict[str, float]:
        """What this side's store counted since the last call (`kvpack_*` metrics' increases)."""
        return self._interval.take()

    def close(self) -> None:
        self.session.close(flush_timeout_s=1.0)
