"""The vLLM scheduler side waits on remote tiers for at most one budget per engine step.

Each remote call is bounded on its own; a step makes one lookup per new request,
so a tier that answers every call just inside its bound would still stall the
step by the sum. `SchedulerSide` gives every store call of a step one
`WaitBudget` (`io_timeout_ms`): the step's lookups (``schedule``) and its save
planning (tail placement in ``build_connector_meta``) alike, renewed when
``build_connector_meta`` ends. Here the remote tier is a real disk tier that
answers lookups 0.2 s late and says it is remote (as Mooncake's tier does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvpack.config.schema import EvictionPolicyName, KVPackConfig
from kvpack.identity.keys import StoreKey, chunk_hashes
from kvpack.identity.layout_spec import KVLayoutSpec
from kvpack.identity.objects import ObjectHeader
from kvpack.policy.eviction import make_policy
from kvpack.policy.groups import Coverage
from kvpack.store import KVStore
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.disk import DiskTier

pytest.importorskip("vllm")

from vllm_helpers import fake_request, scheduler_output  # noqa: E402

from kvpack.vllm_plugin.scheduler import SchedulerSide  # noqa: E402
from kvpack.vllm_plugin.scopes import CacheGroup, Scope  # noqa: E402

BS = 16
DELAY_S = 0.2
BUDGET_MS = 300


class LateRemoteDisk(DiskTier):
    """A disk tier whose lookups answer `DELAY_S` late, marked remote."""

    name = "late"
    remote = True

    def __init__(self, root: Path) -> None:
        super().__init__(root, 1 << 30, make_policy(EvictionPolicyName.LRU))
        self.lookup_calls = 0

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        self.lookup_calls += 1
        time.sleep(DELAY_S)
        return super().contains(keys)

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        self.lookup_calls += 1
        time.sleep(DELAY_S)
        return super().peek_headers(keys)


def _scheduler_over(
    remote: DiskTier, ids: list[int], chunks: int, can_save: bool = False, **config: object
) -> SchedulerSide:
    """A scheduler side whose store is the workers' (empty) memory index, then `remote`,
    which holds the first `chunks` chunks of `ids`."""
    cfg = KVPackConfig.from_dict({"disk": {"enabled": False}, **config})
    groups = (CacheGroup(0, Coverage.ALL, 0, ("model.layers.0.attn",), "FullAttentionSpec"),)
    spec = KVLayoutSpec(engine="vllm:cpu", model="dense", dtype="float32", chunk_tokens=BS)
    scope = Scope(spec=spec, members=("kv",), block_size=BS, draft="", groups=groups, world=1)
    side = SchedulerSide(cfg, scope, can_load=True, can_save=can_save)
    side.session.close()
    # the session's own metrics (`Session.report` counts there) over a store of the late tier
    side.session.store = KVStore(cfg, [side.memory.index, remote], side.session.report.metrics, read_only=True)
    for chunk in chunk_hashes(ids, BS)[:chunks]:
        payload = np.zeros(64, dtype=np.uint8)
        header = ObjectHeader(scope.fingerprint, "default", chunk, "kv", BS, payload.nbytes, None)
        key = StoreKey("default", scope.fingerprint, chunk, "kv")
        assert remote.put_from([PutItem(key, header, memoryview(payload))]) == [TierStatus.OK]
    return side


def test_a_steps_remote_waits_share_one_budget(tmp_path: Path) -> None:
    late = LateRemoteDisk(tmp_path / "late")
    ids = list(range(200, 260))  # 3 whole chunks and a 12-token tail
    side = _scheduler_over(late, ids, 3, io_timeout_ms=BUDGET_MS)

    start = time.monotonic()
    matched = [side.get_num_new_matched_tokens(fake_request(ids, f"r{i}"), 0)[0] for i in range(8)]
    took = time.monotonic() - start
    assert matched[0] == 3 * BS, "the remote tier is asked while the step's budget lasts"
    assert matched[1:] == [0] * 7, "once it is spent, the step's other lookups skip the remote tier"
    assert late.lookup_calls == 2  # the first request's chunk lookup and tail lookup
    assert side.session.report.metrics.value("budget_skips", tier="late") == 2 * 7
    assert took < 1.5, f"eight lookups took {took:.2f}s (unbounded: {8 * 2 * DELAY_S:.1f}s)"

    side.build_connector_meta(None)  # the next engine step renews the budget
    assert side.get_num_new_matched_tokens(fake_request(ids, "next-step"), 0)[0] == 3 * BS
    assert late.lookup_calls == 4


def _computes_prompts(req_ids: list[str], tokens: int) -> object:
    """A scheduler output in which each new request computes its whole `tokens`-token prompt."""
    new = [SimpleNamespace(req_id=r, block_ids=([1 + 4 * i, 2 + 4 * i, 3 + 4 * i],), num_computed_tokens=0)
           for i, r in enumerate(req_ids)]  # fmt: skip
    return scheduler_output(new, {}, dict.fromkeys(req_ids, tokens))


def test_a_steps_save_planning_shares_the_budget_its_lookups_spent(tmp_path: Path) -> None:
    """Placing a tail asks every tier for the tail slots' headers. With the budget renewed at the
    start of `build_connector_meta`, a step whose lookups had spent it waited a second budget
    there (in the soak, with the Mooncake segment holder stopped, the engine's scheduler thread
    sat 0.85 s in tail placements alone: 0.2 s calls, a 0.5 s budget)."""
    late = LateRemoteDisk(tmp_path / "late")
    prompts = {f"r{i}": list(range(1000 * (i + 1), 1000 * (i + 1) + 40)) for i in range(2)}  # 2 chunks + 8
    side = _scheduler_over(late, [], 0, can_save=True, io_timeout_ms=BUDGET_MS)

    for req_id, ids in prompts.items():
        assert side.get_num_new_matched_tokens(fake_request(ids, req_id), 0) == (0, False)
    assert late.lookup_calls == 2, "the first lookup spends the budget (two 0.2 s calls), the second skips"

    start = time.monotonic()
    saves = side.build_connector_meta(_computes_prompts(list(prompts), 40)).saves
    took = time.monotonic() - start
    assert [len(job.blocks) for job in saves] == [3, 3]  # two chunks and a tail each
    assert late.lookup_calls == 2, "tail placement in the same step skips the remote tier"
    assert side.session.report.metrics.value("budget_skips", tier="late") >= 2 + 2
    assert took < DELAY_S, f"the step's save planning waited {took:.2f}s on a spent budget"

    next_step = fake_request(list(range(5000, 5040)), "next-step")
    assert side.get_num_new_matched_tokens(next_step, 0) == (0, False)
    assert late.lookup_calls == 2 + 2, "the next step's lookups have a budget again (chunks, then the tail)"


class ConnectingRemoteDisk(DiskTier):
    """A remote tier still making its first connect until `connected` is set (as a new
    engine's Mooncake tier is for its first moments): it holds objects it cannot show yet."""

    name = "connecting"
    remote = True

    def __init__(self, root: Path) -> None:
        super().__init__(root, 1 << 30, make_policy(EvictionPolicyName.LRU))
        self.connected = False

    def warming_up(self) -> bool:
        return not self.connected

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        return super().contains(keys) if self.connected else [False] * len(keys)


def test_a_request_is_held_not_missed_while_a_tier_makes_its_first_connect(tmp_path: Path) -> None:
    """vLLM asks again next step when the connector answers None: the request waits, the
    engine does not. Before, the lookup ran at once and missed (0), recomputing a prefix
    the cluster held."""
    remote = ConnectingRemoteDisk(tmp_path / "remote")
    ids = list(range(300, 348))  # 3 whole chunks
    side = _scheduler_over(remote, ids, 3)

    request = fake_request(ids, "early")
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)
    assert side.get_num_new_matched_tokens(request, 0) == (None, False)  # the next step, still connecting
    assert side.session.report.metrics.value("lookups_held", tenant="default") == 2
    remote.connected = True
    assert side.get_num_new_matched_tokens(request, 0) == (3 * BS - 1, True)  # the last token is recomputed
