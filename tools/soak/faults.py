"""Faults and security probes the soak injects on a schedule while the load runs.

Each fault is a function of the running `Soak` that breaks something real,
keeps it broken for a few seconds, repairs it, and returns a note; the soak
records the window during which a tier was down, so the step delays measured
by the clients can be split into "while a tier was down" and the rest.

Tier faults: the Mooncake master killed (SIGKILL) and restarted; the segment
holder killed and restarted; master and holder stopped (SIGSTOP) then
resumed: a slow tier, so calls hit kvpack's bounded timeouts and circuit
breaker; the disk tier's directory replaced by a plain file (as root, chmod
does not stop writes) and put back; the disk filled to the last byte (a
tmpfs under the store, so ENOSPC is real) and emptied again.

Events (no tier down): `corrupt_objects` stores a canary prompt, flips a
payload byte of each of its objects on disk and in Mooncake, pushes it out of
host memory with other prompts, and asks again (the answer must equal the
reference: the objects are refused, counted, recomputed).
`security_probes` sends invalid tenant names and salts (path traversal, 300
characters, NUL and control bytes, non-strings), plants hostile entries on disk (a FIFO,
a symlinked tenant folder), and plants a pickle whose unpickling would create a file in
Mooncake under the keys a request will look up: each object must be refused
(``bad_magic``) and the file never appear. (A file planted on disk under a new key is
never read: the disk index, not the folder, answers lookups. A pickle written over a
stored disk object is refused in ``tests/common/test_tiers.py``; in the soak the evictors
that push the canary out of memory push its disk copies out too.)
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .report import by_labels, parse_prometheus

if TYPE_CHECKING:
    from . import Soak

FaultFn = Callable[["Soak"], str]


# -- Mooncake --------------------------------------------------------------------------


def master_killed(soak: Soak) -> str:
    mc = soak.mooncake
    if mc is None:
        return "skipped: no Mooncake tier"
    mc.master.kill()  # type: ignore[union-attr]
    time.sleep(soak.cfg.fault_hold_s)
    mc.restart_master()
    return f"SIGKILL, restarted after {soak.cfg.fault_hold_s:.0f}s"


def holder_killed(soak: Soak) -> str:
    mc = soak.mooncake
    if mc is None:
        return "skipped: no Mooncake tier"
    mc.holder.kill()  # type: ignore[union-attr]
    time.sleep(soak.cfg.fault_hold_s)
    mc.restart_holder()
    return f"SIGKILL, restarted after {soak.cfg.fault_hold_s:.0f}s"


def _stopped(soak: Soak, which: str) -> str:
    mc = soak.mooncake
    if mc is None:
        return "skipped: no Mooncake tier"
    proc = mc.master if which == "master" else mc.holder
    assert proc is not None
    proc.pause()
    try:
        time.sleep(soak.cfg.slow_hold_s)
    finally:
        proc.resume()
    return f"SIGSTOP for {soak.cfg.slow_hold_s:.0f}s, then SIGCONT"


def master_stopped(soak: Soak) -> str:
    return _stopped(soak, "master")


def holder_stopped(soak: Soak) -> str:
    return _stopped(soak, "holder")


# -- disk ------------------------------------------------------------------------------


def disk_dir_replaced(soak: Soak) -> str:
    root = soak.disk_root
    away = root.with_name(root.name + ".away")
    os.rename(root, away)
    root.write_bytes(b"not a directory\n")
    try:
        time.sleep(soak.cfg.fault_hold_s)
    finally:
        root.unlink()
        os.rename(away, root)
    return f"directory replaced by a file for {soak.cfg.fault_hold_s:.0f}s, then put back"


def disk_full(soak: Soak) -> str:
    if not soak.tmpfs.mounted:
        return "skipped: could not mount a tmpfs here (needs root); capacity eviction only"
    filler = soak.tmpfs.path / "filler"
    written = 0
    try:
        with open(filler, "wb", buffering=0) as f:
            block = bytes(1 << 20)
            while True:
                try:
                    written += f.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
            small = bytes(4096)
            while True:
                try:
                    written += f.write(small)
                except OSError:
                    break
        time.sleep(soak.cfg.fault_hold_s)
    finally:
        filler.unlink(missing_ok=True)
    return f"filesystem filled ({written >> 20} MiB filler, ENOSPC) for {soak.cfg.fault_hold_s:.0f}s, then emptied"


# -- stored objects ------------------------------------------------------------------


def _flip_payload_byte(path: Path) -> bool:
    from kvpack.identity.objects import decode_header

    try:
        raw = bytearray(path.read_bytes())
        header = decode_header(bytes(raw))
    except Exception:
        return False
    if header.payload_len == 0:
        return False
    raw[len(raw) - header.payload_len // 2 - 1] ^= 0xFF
    path.write_bytes(bytes(raw))
    return True


MOONCAKE_HELPER = r"""
import json, sys, time
from mooncake.store import MooncakeDistributedStore
spec = json.loads(sys.argv[1])
store = MooncakeDistributedStore()
rc = store.setup(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", global_segment_size=0,
                 local_buffer_size=16 << 20, protocol="tcp", rdma_devices="", master_server_addr=spec["master"])
if rc != 0:
    print(json.dumps({"setup": rc})); sys.exit(0)
out = {"setup": 0, "corrupted": 0, "missing": 0, "planted": 0, "errors": []}
deadline = time.monotonic() + spec.get("wait_s", 0)
for key in spec.get("corrupt", []):
    while store.is_exist(key) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # the soak's write-back may still be putting it
    data = bytearray(store.get(key))
    if not data:
        out["missing"] += 1; continue
    data[len(data) - 100] ^= 0xFF
    rc = store.upsert(key, bytes(data))
    if rc == 0 and bytes(store.get(key)) == bytes(data): out["corrupted"] += 1
    else: out["errors"].append([key, rc])
for key, hexdata in spec.get("plant", []):
    rc = store.upsert(key, bytes.fromhex(hexdata))
    if rc == 0: out["planted"] += 1
    else: out["errors"].append([key, rc])
print(json.dumps(out))
sys.stdout.flush()
store.close()
"""


def mooncake_edit(
    soak: Soak,
    corrupt: list[str] = (),  # type: ignore[assignment]
    plant: list[tuple[str, bytes]] = (),  # type: ignore[assignment]
    wait_s: float = 0.0,
) -> dict[str, Any]:
    """Corrupt or plant objects in Mooncake from a child process (a Mooncake client
    that misbehaves can segfault; it must not take the soak down). An object to corrupt
    that is not there yet is waited for, all of them within `wait_s` seconds."""
    if soak.mooncake is None:
        return {"skipped": True}
    spec = {
        "master": soak.mooncake.address,
        "corrupt": list(corrupt),
        "plant": [[k, v.hex()] for k, v in plant],
        "wait_s": wait_s,
    }
    from .procs import mooncake_env

    try:
        r = subprocess.run(
            [sys.executable, "-c", MOONCAKE_HELPER, json.dumps(spec)],
            capture_output=True,
            timeout=60,
            env=mooncake_env(),
        )
    except subprocess.TimeoutExpired:
        return {"error": "helper timed out"}
    lines = [ln for ln in r.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"helper rc={r.returncode}: {r.stderr.decode(errors='replace')[-300:]}"}
    return json.loads(lines[-1])


CANARY_WAIT_S = 20.0
"""How long the canary event waits for the canary's objects to land on disk, then in Mooncake."""
CANARY_ATTEMPTS = 2
"""Stores of the canary (each under a new tenant) until every object of one is on disk."""


def _store_canary(soak: Soak, tenant: str, prompt: tuple[int, ...], objects: int) -> tuple[list[Path], str]:
    """Send the canary under `tenant`; wait (bounded) until its `objects` files are on disk.
    Returns the files found and the request's status."""
    res = soak.send("canary-store", tenant, prompt)
    files: list[Path] = []
    deadline = time.monotonic() + CANARY_WAIT_S  # a loaded CI machine can take seconds per write-back
    while time.monotonic() < deadline:
        files = sorted((soak.disk_root / tenant).rglob("*.kvp"))
        if len(files) >= objects:
            break
        time.sleep(0.25)
    return files, res.status


def corrupt_objects(soak: Soak) -> str:
    """Canary: store, corrupt on disk and in Mooncake, evict from memory, ask again.

    A store whose disk copies did not all land (seen once in a fresh-clone CI run on
    2026-12-03: none of 5, cause not found) is said in the event's line and tried once more under a new tenant:
    the refusal is what this event checks, and it needs the copies it corrupts."""
    from kvpack.identity.keys import StoreKey, chunk_hashes
    from kvpack.policy.tails import tail_chunk

    n = soak.cycle_index
    prompt = soak.workload.extra["canary"]
    hashes = chunk_hashes(prompt, soak.cfg.block_size)
    chunks = [*hashes, tail_chunk(hashes[-1])]
    stores: list[str] = []
    with soak.quiet():  # the load pauses (bounded) so the canary's write-back is not dropped
        for attempt in range(CANARY_ATTEMPTS):
            tenant = f"canary-{n}" if attempt == 0 else f"canary-{n}-{attempt + 1}"
            files, status = _store_canary(soak, tenant, prompt, len(chunks))
            stores.append(f"{tenant}: store {status}, {len(files)} of {len(chunks)} on disk")
            if len(files) >= len(chunks):
                break
        fp = soak.fingerprint()
        keys = [StoreKey(tenant, fp, c, "kv").as_str() for c in chunks] if fp else []
        mc = mooncake_edit(soak, corrupt=keys, wait_s=CANARY_WAIT_S) if keys else {}
    flipped = sum(_flip_payload_byte(p) for p in files)
    # Host memory evicts a tenant's own entries first: push the canary out with its own tenant's.
    # The load stays paused until the reload: its writes (the disk tier is 40 MiB, shared in plain
    # LRU order) could push the corrupted disk copies out too, leaving nothing to refuse (a
    # fresh-clone CI run, 2026-12-05: 5 disk copies corrupted, 1 of 5 in Mooncake, reload
    # cached_tokens=0). The evictors alone write about 24 MiB.
    with soak.quiet(max_s=30.0):
        soak.evict_memory(tenant)
        left = sum(p.exists() for p in files)
        res = soak.send("canary-reload", tenant, prompt)
    return (
        f"{'; '.join(stores)}; {flipped} disk and {mc.get('corrupted', 0)} of {len(keys)} Mooncake objects "
        f"corrupted ({mc.get('error', 'ok') if mc else 'no Mooncake'}); "
        f"{left} of {len(files)} disk copies left after the evictors; "
        f"reload: {res.status}, cached_tokens={res.cached_tokens}"
    )


class _Bomb:
    """Unpickling this creates `path` (it must never happen)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _bomb_bytes(sentinel: Path) -> bytes:
    return pickle.dumps(_Bomb(str(sentinel)))


BAD_TENANTS: tuple[Any, ...] = (
    "../acme",
    "acme/../globex",
    "/etc/passwd",
    "..",
    "a" * 300,
    "ten\x00ant",
    "tenant\nacme",
    "t\u00e9n\u00e4nt",
    "",
    12345,
    ["acme"],
    {"$ne": "acme"},
)
BAD_SALTS: tuple[str, ...] = ("../acme", "x" * 200, "nul\x00salt")
ODD_SALTS: tuple[str, ...] = ("salt with spaces and \u00fcml\u00e4uts",)


def security_probes(soak: Soak) -> str:
    """Bad tenants and salts, hostile entries on disk, pickle bombs in Mooncake."""
    victim = soak.workload.first_turn("public", 0)
    soak.send("victim-store", "acme", victim)
    bad = 0
    for tenant in BAD_TENANTS:
        res = soak.send("bad-tenant", tenant, victim)
        bad += res.status == "ok"
    refused = 0
    for salt in BAD_SALTS:
        res = soak.send("bad-salt", None, victim, cache_salt=salt)
        refused += res.status == "http_400"
    for salt in ODD_SALTS:
        soak.send("odd-salt", None, victim, cache_salt=salt)
    fp = soak.fingerprint()
    notes = [
        f"{bad}/{len(BAD_TENANTS)} bad tenants served without the cache",
        f"{refused}/{len(BAD_SALTS)} bad salts got HTTP 400",
    ]
    if fp is None:
        return "; ".join(notes + ["no fingerprint yet: planted entries and bombs skipped"])
    notes.append(_planted_entries(soak, fp, soak.workload.extra["planted"], soak.cycle_index))
    if soak.mooncake is not None:
        notes.append(_bomb_mooncake(soak, fp))
    return "; ".join(notes)


BOMB_ATTEMPTS = 3
"""Plantings of the Mooncake bomb. Another is made only when the attempt's request could
not reach Mooncake (`MooncakeCounts.unreached` grew: the tier was down or timed out, or an
engine step's wait budget skipped it), as the schedule's own tier faults make happen; each
attempt is said in the event's line. A bomb the tier answered and kvpack did not refuse is
never planted again: that is the failure this event exists to show."""


@dataclass(frozen=True)
class MooncakeCounts:
    """kvpack's Mooncake counters summed over every process of the server."""

    bombs_refused: float
    """Objects refused for their first bytes (``rejected_objects{tier="mooncake",reason="bad_magic"}``)."""
    unreached: float
    """Calls that did not reach the tier: ``tier_errors{tier="mooncake"}`` (down, timed out,
    failed) and ``budget_skips{tier="mooncake"}``."""

    @classmethod
    def scrape(cls, soak: Soak) -> MooncakeCounts:
        prom = parse_prometheus(soak.scrape_metrics())
        return cls(
            by_labels(prom, "rejected_objects", ("tier", "reason"))[("mooncake", "bad_magic")],
            by_labels(prom, "tier_errors", ("tier",))[("mooncake",)]
            + by_labels(prom, "budget_skips", ("tier",))[("mooncake",)],
        )


def _bomb_mooncake(soak: Soak, fp: str) -> str:
    """Plant pickle bombs in Mooncake under the keys a request of a new tenant will look up,
    then send it; see `BOMB_ATTEMPTS`. Each attempt rotates the prompt by one token so that
    vLLM's own prefix cache (which the previous attempt filled) does not answer it."""
    from kvpack.identity.keys import StoreKey, chunk_hashes

    bomb = _bomb_bytes(soak.sentinel)
    base = soak.workload.extra["bomb-mooncake"]
    said: list[str] = []
    for attempt in range(BOMB_ATTEMPTS):
        prompt = base[attempt:] + base[:attempt]
        tenant = f"bomb-mc-{soak.cycle_index}-{attempt + 1}"
        keys = [StoreKey(tenant, fp, c, "kv").as_str() for c in chunk_hashes(prompt, soak.cfg.block_size)]
        before = MooncakeCounts.scrape(soak)
        mc = mooncake_edit(soak, plant=[(k, bomb) for k in keys])
        res = soak.send("bomb-mooncake", tenant, prompt)
        after = MooncakeCounts.scrape(soak)
        refused = after.bombs_refused - before.bombs_refused
        unreached = after.unreached - before.unreached
        said.append(
            f"{tenant}: {mc.get('planted', mc)} of {len(keys)} planted, request {res.status}, "
            f"{refused:.0f} refused, {unreached:.0f} Mooncake calls unreached"
        )
        if refused or not unreached:
            break
    return "pickle bombs in Mooncake: " + "; ".join(said)


def _planted_entries(soak: Soak, fp: str, prompt: tuple[int, ...], n: int) -> str:
    """Hostile store entries: a FIFO at an object path and a tenant folder symlinked out of the store.

    The requests must complete (a FIFO never blocks a lookup or load) and nothing
    may be written where the symlink points (kvpack never follows it)."""
    from kvpack.identity.keys import chunk_hashes

    chunks = chunk_hashes(prompt, soak.cfg.block_size)
    t_fifo = f"fifo-{n}"
    path = soak.disk_root / t_fifo / fp / chunks[0][:2] / f"{chunks[0]}.kv.kvp"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    fifo = soak.send("planted-fifo", t_fifo, prompt)
    outside = soak.work / f"outside-{n}"
    outside.mkdir(exist_ok=True)
    os.symlink(outside, soak.disk_root / f"link-{n}")
    link = soak.send("planted-symlink", f"link-{n}", prompt)
    written = sum(1 for p in outside.rglob("*") if p.is_file())
    return (
        f"FIFO at an object path: {fifo.status}; symlinked tenant folder: {link.status}, "
        f"{written} files written outside"
    )


# -- the schedule ----------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    name: str
    at: float
    """Offset in a cycle, as a fraction of the cycle."""
    fn: FaultFn
    tier_down: bool
    needs_mooncake: bool = False


SCHEDULE: tuple[Fault, ...] = (
    Fault("mooncake master slow (SIGSTOP)", 0.08, master_stopped, True, True),
    Fault("mooncake master killed + restarted", 0.16, master_killed, True, True),
    Fault("segment holder killed + restarted", 0.30, holder_killed, True, True),
    Fault("disk directory replaced by a file", 0.42, disk_dir_replaced, True),
    Fault("disk full (ENOSPC)", 0.50, disk_full, True),
    Fault("segment holder slow (SIGSTOP)", 0.58, holder_stopped, True, True),
    Fault("security: bad tenants, salts, pickle bombs", 0.66, security_probes, False),
    Fault("objects corrupted on disk and in Mooncake", 0.76, corrupt_objects, False),
)


def selected(only: Sequence[str] = ()) -> tuple[Fault, ...]:
    """The faults of `SCHEDULE` named in `only` (their functions' names), in schedule order;
    all of them when `only` is empty. An unknown name is a ValueError that lists the names."""
    names = [f.fn.__name__ for f in SCHEDULE]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown fault {', '.join(unknown)} (one of {', '.join(names)})")
    return tuple(f for f in SCHEDULE if not only or f.fn.__name__ in only)


def cleanup_disk(root: Path) -> None:
    """Put the disk tier's directory back if a fault was interrupted."""
    away = root.with_name(root.name + ".away")
    if away.exists():
        if root.is_file():
            root.unlink()
        if not root.exists():
            os.rename(away, root)
        else:
            shutil.rmtree(away, ignore_errors=True)
