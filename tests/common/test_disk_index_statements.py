"""The disk index runs a number of SQL statements per put that does not grow with the batch (#34, #37).

Every sqlite3 step gives the GIL up; beside a busy Python thread (SGLang's scheduler) each re-take
can wait up to the 5 ms switch interval, so a put of 64 pages must not run 64x the statements of a
put of 4. Counted with SQLite's own trace callback on the tier's index connection: a put into room
(admit + mark ready), a put that evicts as many groups as it stores, the removal of groups and
the facts of a batch, on the disk tier and the host tier (which adds its pending-writer rows and
allocates the objects' pages).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fixtures.builders import chunk_id, make_item
from kvpack.errors import ConfigError
from kvpack.observe.router_facts import RouterFacts
from kvpack.tiers.base import TierStatus
from kvpack.tiers.disk import DiskTier, batch_sql
from kvpack.tiers.host import HostTier, host_root

PAGE = 1024
SIZES = (4, 64)

Make = Callable[[int], DiskTier]


@pytest.fixture(params=["disk", "host"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """Builds a tier of the parameter's kind with `capacity` bytes, each in a folder of its own."""
    made: list[DiskTier] = []
    names: list[str] = []

    def build(capacity: int) -> DiskTier:
        if request.param == "disk":
            tier: DiskTier = DiskTier(str(tmp_path / f"kv{len(made)}"), capacity)
        else:
            names.append(f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            tier = HostTier(names[-1], capacity)
        made.append(tier)
        return tier

    yield build
    for tier in made:
        tier.close()
    for name in names:
        shutil.rmtree(host_root(name), ignore_errors=True)


def _traced(tier: DiskTier, run: Callable[[], object]) -> list[str]:
    """SQL statements `run` executes on `tier`'s index connection, in order (SQLite's trace callback).
    A trigger's statements (the host tier's, freeing an object's pages) are traced with the text of
    the statement that fired them, right after it: they run inside its step, so they count with it."""
    statements: list[str] = []
    db = tier._catalog._db
    db.set_trace_callback(statements.append)
    try:
        run()
    finally:
        db.set_trace_callback(None)
    return [text for i, text in enumerate(statements) if i == 0 or text != statements[i - 1]]


def _counted(tier: DiskTier, run: Callable[[], object]) -> int:
    """How many SQL statements `run` executes on `tier`'s index connection (`_traced`)."""
    return len(_traced(tier, run))


def _items(first: int, count: int) -> list:  # type: ignore[type-arg]
    return [make_item("t", chunk_id(first + i), nbytes=PAGE, seed=first + i)[0] for i in range(count)]


def _put(tier: DiskTier, first: int, count: int) -> Callable[[], object]:
    def run() -> None:
        assert tier.put_from(_items(first, count)) == [TierStatus.OK] * count

    return run


def test_a_put_runs_as_many_statements_for_64_pages_as_for_4(make: Make) -> None:
    counts = []
    for n in SIZES:
        tier = make(1 << 30)
        counts.append(_counted(tier, _put(tier, 0, n)))
    assert counts[0] == counts[1], f"statements per put of {SIZES} pages: {counts}"


def test_a_put_that_evicts_runs_as_many_statements_for_64_pages_as_for_4(make: Make) -> None:
    probe = make(1 << 30)
    _put(probe, 0, 1)()
    charge = probe.usage().used_bytes  # what the index counts for one page (the host tier counts whole 4 KiB pages)
    counts = []
    for n in SIZES:
        tier = make(n * charge)  # full after the first n pages: the next n evict them all
        _put(tier, 0, n)()
        counts.append(_counted(tier, _put(tier, 10_000, n)))
        assert tier.usage().groups == n
        assert not any(tier._catalog.lookup([item.key for item in _items(0, n)]))  # the first n were evicted
    assert counts[0] == counts[1], f"statements per evicting put of {SIZES} pages: {counts}"


def test_removing_groups_and_recording_facts_take_as_many_statements_for_64_as_for_4(make: Make) -> None:
    removes, facts = [], []
    for n in SIZES:
        tier = make(1 << 30)
        items = _items(0, n)
        tier.put_from(items)
        rows = [(item.key.group, RouterFacts("origin", "identity", b"facts")) for item in items]
        facts.append(_counted(tier, lambda: tier.record_facts(rows)))
        assert len(tier.facts_after(0, 1000)) == n
        removes.append(_counted(tier, lambda: tier.remove_groups([item.key.group for item in items]) == n))
        assert tier.usage().groups == 0 and tier.facts_after(0, 1000) == []
    assert facts[0] == facts[1], f"statements per facts batch of {SIZES}: {facts}"
    assert removes[0] == removes[1], f"statements per removal of {SIZES} groups: {removes}"


def test_marking_a_put_ready_is_one_statement_with_no_transaction_of_its_own(tmp_path: Path) -> None:
    """``BEGIN`` and ``COMMIT`` around the disk tier's one ``UPDATE`` would be two more GIL hand-offs
    per put (the host tier's ready mark also clears its pending rows: a transaction of its own)."""
    tier = DiskTier(str(tmp_path / "kv"), 1 << 30)
    statements = _traced(tier, _put(tier, 0, 8))
    ready = [i for i, text in enumerate(statements) if "SET ready=1" in text]
    assert len(ready) == 1, statements
    assert statements[ready[0] - 1] == "COMMIT", statements  # the admission's transaction ended before it
    assert not any(text.startswith("BEGIN") for text in statements[ready[0] :]), statements
    assert all(tier._catalog.lookup([item.key for item in _items(0, 8)]))
    tier.close()


def test_no_statement_binds_more_parameters_than_sqlite_takes(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """With SQLite's own limit lowered to kvpack's, every statement of puts (one evicting), facts
    and removals fits (the ready mark binds its time besides two per row: it once took one too many)."""
    limit = 12
    monkeypatch.setattr(batch_sql, "MAX_VARIABLES", limit)
    probe = make(1 << 30)
    _put(probe, 0, 1)()
    tier = make(20 * probe.usage().used_bytes)
    tier._catalog._db.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit)
    _put(tier, 0, 16)()
    _put(tier, 100, 12)()  # evicts 8
    items = _items(100, 12)
    assert tier.record_facts([(item.key.group, RouterFacts("o", "i", b"f")) for item in items]) == 12
    assert tier.remove_groups([item.key.group for item in items[:5]]) == 5
    assert tier._catalog.lookup([item.key for item in items]) == [False] * 5 + [True] * 7


def test_batches_over_one_statements_parameters_are_split_and_index_the_same(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for a few rows per statement, the same puts, evictions, facts and removals leave the
    same index as one statement per batch does."""
    states = []
    for limit in (batch_sql.MAX_VARIABLES, 13):
        monkeypatch.setattr(batch_sql, "MAX_VARIABLES", limit)
        probe = make(1 << 30)
        _put(probe, 0, 1)()
        tier = make(40 * probe.usage().used_bytes)
        _put(tier, 0, 32)()
        _put(tier, 100, 24)()  # evicts the 16 oldest
        items = _items(100, 24)
        assert tier.record_facts([(item.key.group, RouterFacts("o", "i", b"f")) for item in items]) == 24
        assert tier.remove_groups([item.key.group for item in items[:5]]) == 5
        found = tier._catalog.lookup([item.key for item in _items(0, 32) + items])
        states.append((tier.usage(), found, [row.group for row in tier.facts_after(0, 100)]))
    assert states[0][1] == [False] * 16 + [True] * 16 + [False] * 5 + [True] * 19
    assert states[0][0].used_bytes == states[1][0].used_bytes and states[0][1:] == states[1][1:]


def test_a_sqlite_too_old_for_the_index_is_one_config_line_naming_the_field(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statements need SQLite >= 3.35 (RETURNING); an older library is refused at open with one
    line naming the field, not a traceback at the first put."""
    monkeypatch.setattr(batch_sql.sqlite3, "sqlite_version_info", (3, 31, 1))
    with pytest.raises(ConfigError) as err:
        make(1 << 20)
    assert err.value.field in ("disk.path", "memory.mode")
    assert "needs SQLite >= 3.35.0" in str(err.value) and "SQLite 3.31.1" in str(err.value)
    assert "\n" not in str(err.value)
    assert batch_sql.sqlite_too_old((3, 35, 0)) is None
