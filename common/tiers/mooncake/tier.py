"""`MooncakeTier`: the `Tier` facade over a connection, a staging arena, gets and puts.

It checks what the installed Mooncake supports against the config (a tenant
needs ``setup(tenant_id=...)``; groups need ``ReplicateConfig.group_ids``),
builds the parts, and forwards each `Tier` method to the part that owns it.
What each part guarantees is in its module: `connection` (gate, breaker,
background connect), `staging`, `runner`, `gets`, `puts`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ...config.schema import MooncakeProtocol, MooncakeTierConfig
from ...identity.keys import GroupKey, StoreKey
from ...identity.objects import Expectation, ObjectHeader, Payload
from ...policy.clearing import Cleared, ClearScope, ClearUnsupported
from ..base import GetResult, Medium, PutItem, Tier, TierStatus, TierUsage
from . import connection
from .connection import CircuitBreaker, Connection, TierEvents, TierState
from .gets import Gets
from .puts import OverwriteKeys, Puts
from .runner import LaneRunner
from .staging import Staging

log = logging.getLogger("kvpack")


class MooncakeTier(Tier):
    """kvpack objects in a Mooncake distributed store, with bounded failure (see the package docstring).

    `wait_ready_s` > 0 blocks construction until connected or that many seconds
    passed (tests and tools; an engine never waits)."""

    name = "mooncake"
    medium = Medium.REMOTE
    remote = True

    def __init__(self, config: MooncakeTierConfig, *, wait_ready_s: float = 0.0) -> None:
        self.config = config.resolved()
        cfg = self.config
        store_cls, replicate_cls, tenant_kw = connection.check_support(cfg)
        groups = cfg.use_groups and connection.supports_groups(replicate_cls)
        if cfg.use_groups and not groups:
            log.warning(
                "kvpack: the installed Mooncake has no ReplicateConfig.group_ids; groups are not leased together"
            )
        self.staging = Staging(cfg.staging_size, cfg.workers)
        """Registered with Mooncake after setup; one lane per worker."""
        self.runner = LaneRunner(cfg.workers, self.staging.lanes, max_queued=max(16, 8 * cfg.workers))
        self.connection = Connection(cfg, store_cls, tenant_kw, self.runner, self.staging.address, self.staging.nbytes)
        overwrite = OverwriteKeys()
        direct_put = cfg.protocol is MooncakeProtocol.TCP and hasattr(store_cls, "batch_put_from_multi_buffers")
        """RDMA needs registered memory: there every payload goes through the arena."""
        self._gets = Gets(self.connection, self.staging, overwrite)
        self._puts = Puts(self.connection, self.staging, overwrite, replicate_cls, groups, direct_put)
        self.connection.start()
        if wait_ready_s > 0:
            self.wait_ready(wait_ready_s)

    # -- lifecycle -------------------------------------------------------------------

    @property
    def state(self) -> TierState:
        return self.connection.state

    @property
    def breaker(self) -> CircuitBreaker:
        return self.connection.breaker

    @property
    def events(self) -> TierEvents:
        """Timeouts, stalls, puts undone, setup attempts (counts since start)."""
        return self.connection.events

    @property
    def available(self) -> bool:
        """Connected, tenant accepted, and the circuit breaker closed."""
        return self.state is TierState.READY and self.breaker.allow()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` until connected (for tests and tools, never the engine)."""
        return self.connection.wait_ready(timeout_s)

    def warming_up(self) -> bool:
        return self.connection.warming_up()

    def wait_warm(self) -> bool:
        return self.connection.wait_warm()

    def close(self) -> None:
        """Stop admitting calls, wait (bounded) for calls in flight, close the client.
        A client a stuck call still uses is left open, and the staging arena with it."""
        self.connection.close()

    # -- the Tier interface ------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        return self._gets.contains(keys)

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        return self._gets.peek_headers(keys)

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        return self._gets.get_into(keys, dsts, expected, verify_checksum)

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Puts come from background threads only (write-back, an adapter's save thread),
        so a put during the first connect waits for it (bounded by ``connect_wait_ms``)
        instead of dropping what the engine computed (`wait_warm` returns at once otherwise)."""
        self.connection.wait_warm()
        return self._puts.put_from(items)

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        return self._puts.remove_groups(groups)

    def clear(self, scope: ClearScope, dry_run: bool = False) -> Cleared:
        """One ``remove_by_regex`` over the scope's key prefix (`ClearScope.key_regex`), forced: a
        reader racing with it gets a miss or bytes its checks refuse, never a wrong load. Mooncake
        tells how many objects it removed, not their bytes, and cannot count without removing
        (a dry run raises `ClearUnsupported`)."""
        if dry_run:
            raise ClearUnsupported("Mooncake cannot count objects without removing them")
        return Cleared(self._puts.remove_matching(scope.key_regex()), None)

    def usage(self) -> TierUsage:
        """Mooncake's capacity is cluster-wide and owned by the master: this
        reports the segment this process contributes, and no per-object count."""
        return TierUsage(used_bytes=0, capacity_bytes=self.config.global_segment_size, objects=0, groups=0)
