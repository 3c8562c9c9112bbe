"""``kvpack usage`` and ``kvpack clear``: what the stores of a config hold per tenant and model,
and removing one tenant's objects (of one model) from every tier, by the rule of `kvpack.policy.clearing`.

Which stores: the disk folder of the config (``disk.path``), every host store of this user
(`kvpack.tiers.host.stores`: a tenant's objects may sit in any of them), and the config's Mooncake
cluster (``mooncake.*``). A per-process memory tier lives inside its engine's process and is not
visible from here; an engine's own reset verb reaches it (vLLM ``reset_prefix_cache``, SGLang's
storage clear).

Usage reads the indexes only (one grouped SQL scan each; no object file is opened), through a
read-only connection: it changes nothing, takes no writer lock and is not a user of a host store.
Mooncake's client API lists no keys; its master's HTTP server does (``/get_all_keys``, sizes
from ``/batch_query_keys``), which usage reads when given its address (``--mooncake-http``).

Clear is safe against engines running at that moment: it removes through each tier's own path
(index rows, then files; the host store's pages; Mooncake's forced ``remove_by_regex``), and a
load of an object removed meanwhile is a miss the engine recomputes, never an error or a wrong
load. ``--model`` names a model by a part of its label (`KVLayoutSpec.describe`, recorded in the
indexes when an engine first stored under it) or by its group fingerprint.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..config.schema import KVPackConfig
from ..errors import ConfigError
from ..policy.clearing import Cleared, ClearScope, ClearUnsupported
from ..store.pins import drop_pins, pinned_per_tenant

# the tiers through their packages (`kvpack.exports`): a tier's module, and torch, load when a command opens it
from ..tiers import disk as disk_tiers
from ..tiers import host as host_tiers
from ..tiers import mooncake as mooncake_tiers
from ..tiers.host.stores import HostStore, host_stores
from ..tiers.index import census
from ..tiers.index.catalog import INDEX_NAME

MOONCAKE_NOT_LISTABLE = "its client API lists no keys: pass --mooncake-http HOST:PORT (the master's --metrics_port)"
MAX_LISTED_KEYS = 10_000_000
"""Keys read from a Mooncake master's listing at most (a bounded answer from a server)."""
MAX_LISTING_BYTES = 2 << 30
SIZE_BATCH = 100
"""Keys per ``/batch_query_keys`` call (a GET: the keys travel in its URL)."""
MEMORY_NOT_VISIBLE = "a per-process memory tier is inside its engine's process (the engine's reset verb reaches it)"


@dataclass
class StoreUsage:
    """What one store's index holds: `rows` per tenant and fingerprint, `models` naming them."""

    tier: str
    store: str
    rows: list[census.UsageRow] = field(default_factory=list)
    models: dict[str, str] = field(default_factory=dict)
    note: str = ""
    """Why the store could not be read (empty: it was)."""
    users: int | None = None
    """A host store's live users now."""
    held_bytes: int | None = None
    """A host store's memory held (its whole arena, from its making until dropped)."""
    pinned: dict[str, tuple[int, int]] = field(default_factory=dict)
    """A disk folder's pinned prefixes: tenant -> (groups, bytes) (`kvpack.store.pins`)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tier": self.tier,
            "store": self.store,
            "rows": [
                {
                    "tenant": r.tenant,
                    "fingerprint": r.fingerprint,
                    "model": self.models.get(r.fingerprint, ""),
                    "objects": r.objects,
                    "bytes": r.nbytes if r.nbytes >= 0 else None,
                }
                for r in self.rows
            ],
        }
        if self.note:
            out["note"] = self.note
        if self.pinned:
            out["pinned"] = {t: {"groups": g, "bytes": b} for t, (g, b) in self.pinned.items()}
        if self.users is not None:
            out["users"] = self.users
            out["held_bytes"] = self.held_bytes
        return out


@contextlib.contextmanager
def read_index(root: str) -> Iterator[sqlite3.Connection]:
    """A read-only connection to the index of the store folder `root`; FileNotFoundError when it
    has none, ValueError when the index is not a regular file (a link is never opened)."""
    path = os.path.join(root, INDEX_NAME)
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    try:
        db.execute("PRAGMA query_only=1")
        yield db
    finally:
        db.close()


def _store_usage(tier: str, root: str, shown: str) -> StoreUsage:
    usage = StoreUsage(tier, shown)
    try:
        with read_index(root) as db:
            usage.rows = census.usage_rows(db)
            with contextlib.suppress(sqlite3.Error):  # an index of an older kvpack: no names
                usage.models = census.fingerprint_names(db)
    except FileNotFoundError:
        usage.note = "no kvpack index here"
    except (OSError, ValueError, sqlite3.Error) as exc:
        usage.note = f"unreadable: {str(exc).splitlines()[0][:200]}"
    return usage


def mooncake_usage(http: str, sized: int = 100_000, timeout_s: float = 30.0) -> StoreUsage:
    """Objects (and bytes, for the first `sized` keys) per tenant and fingerprint in a Mooncake
    cluster, from its master's HTTP listing (``/get_all_keys``, ``/batch_query_keys``: the
    master's ``--metrics_port``); kvpack's keys only. Bytes are None past `sized` keys."""

    out = StoreUsage("mooncake", http)
    base = http if http.startswith("http://") else f"http://{http}"
    try:
        with urllib.request.urlopen(f"{base}/get_all_keys", timeout=timeout_s) as resp:  # noqa: S310 - operator's URL
            text = resp.read(MAX_LISTING_BYTES).decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        out.note = f"unreachable: {str(exc)[:200]}"
        return out
    counts: dict[tuple[str, str], list[int]] = {}
    keys = [k for k in text.splitlines()[:MAX_LISTED_KEYS] if k.startswith("kvpack/") and k.count("/") == 4]
    sizes: dict[str, int] = {}
    for lo in range(0, min(len(keys), sized), SIZE_BATCH):
        part = keys[lo : min(lo + SIZE_BATCH, sized)]
        url = f"{base}/batch_query_keys?keys=" + urllib.parse.quote(",".join(part), safe=",/")
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310
                data = json.loads(resp.read(64 << 20)).get("data") or {}
        except (OSError, ValueError):
            break
        for key, info in data.items():
            values = (info or {}).get("values") or []
            if values and isinstance(values[0], dict):
                sizes[key] = int(values[0].get("size_", 0))
    for key in keys:
        _, tenant, fp, _, _ = key.split("/")
        acc = counts.setdefault((tenant, fp), [0, 0])
        acc[0] += 1
        acc[1] = -1 if acc[1] < 0 or key not in sizes else acc[1] + sizes[key]
    out.rows = [census.UsageRow(t, fp, n, b) for (t, fp), (n, b) in sorted(counts.items())]
    return out


def usage(config: KVPackConfig, mooncake_http: str = "") -> tuple[list[StoreUsage], dict[str, str]]:
    """(each readable store's usage, tiers not visible from here -> why)."""
    out: list[StoreUsage] = []
    for host in host_stores():
        u = _store_usage("host", host.path, host.name)
        u.users, u.held_bytes = host.users, host.held_bytes
        out.append(u)
    if config.disk.enabled:
        out.append(_store_usage("disk", config.disk.path, config.disk.path))
        with contextlib.suppress(OSError, ValueError, sqlite3.Error):  # the objects' usage is shown regardless
            out[-1].pinned = pinned_per_tenant(config.disk.path)
    hidden = {"memory": MEMORY_NOT_VISIBLE}
    if mooncake_http:
        out.append(mooncake_usage(mooncake_http))
    elif config.mooncake.enabled:
        hidden["mooncake"] = MOONCAKE_NOT_LISTABLE
    return out, hidden


def resolve_model(stores: list[StoreUsage], model: str) -> frozenset[str]:
    """The group fingerprints `model` names in `stores`: itself when it is one, else every
    fingerprint whose recorded label contains it. ValueError (one line) when it names none."""
    known = {fp: label for s in stores for fp, label in s.models.items()}
    fps = {r.fingerprint for s in stores for r in s.rows} | set(known)
    if model in fps or (len(model) == 32 and all(c in "0123456789abcdef" for c in model)):
        return frozenset({model})
    found = frozenset(fp for fp, label in known.items() if model in label)
    if not found:
        raise ValueError(f"no model named {model[:80]!r} in the stores' indexes (kvpack usage lists them)")
    return found


@dataclass
class StoreCleared:
    tier: str
    store: str
    cleared: Cleared | None = None
    failed: str = ""


def clear(
    config: KVPackConfig,
    scope: ClearScope,
    dry_run: bool,
    mooncake_wait_s: float = 10.0,
    hosts: Sequence[str] | None = None,
) -> list[StoreCleared]:
    """Apply `scope` to every store of `config` it covers (see the module docstring); `hosts`:
    only the host stores of these names (None: every host store of this user)."""
    out: list[StoreCleared] = []
    if scope.covers_tier("host"):
        stores = [h for h in host_stores() if hosts is None or h.name in hosts]
        out += [_clear_host(h, scope, dry_run) for h in stores]
        found = {h.name for h in stores}
        out += [
            StoreCleared("host", n, failed="no host store of this user by that name")
            for n in hosts or ()
            if n not in found
        ]
    if scope.covers_tier("disk") and config.disk.enabled:
        out.append(_clear_disk(config.disk.path, scope, dry_run))
    if scope.covers_tier("mooncake") and config.mooncake.enabled:
        out.append(_clear_mooncake(config, scope, dry_run, mooncake_wait_s))
    return out


def _run(result: StoreCleared, scope: ClearScope, dry_run: bool, tier: Any) -> StoreCleared:
    try:
        result.cleared = tier.clear(scope, dry_run)
    except (ClearUnsupported, RuntimeError, OSError, sqlite3.Error) as exc:
        result.failed = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return result


def _clear_host(host: HostStore, scope: ClearScope, dry_run: bool) -> StoreCleared:
    result = StoreCleared("host", host.name)
    try:
        tier = host_tiers.HostTier(host.name, 1 << 20, asked_for=False)  # an existing store keeps its own size
    except (ConfigError, OSError, sqlite3.Error) as exc:
        result.failed = str(exc).splitlines()[0][:200]
        return result
    try:
        return _run(result, scope, dry_run, tier)
    finally:
        tier.close()


def _clear_disk(path: str, scope: ClearScope, dry_run: bool) -> StoreCleared:
    result = StoreCleared("disk", path)
    if not os.path.isfile(os.path.join(path, INDEX_NAME)):
        result.cleared = Cleared(0, 0)  # no store here: nothing of anyone's
        return result
    try:
        tier = disk_tiers.DiskTier(path, 1 << 60)
    except (ConfigError, OSError, sqlite3.Error) as exc:
        result.failed = str(exc).splitlines()[0][:200]
        return result
    try:
        tier.wait_indexed(60.0)  # an index still being built: it raises in `clear`, one line
        _run(result, scope, dry_run, tier)
        if not dry_run and not result.failed:
            try:
                drop_pins(path, scope.tenants, scope.fingerprints)  # the pin list keeps no trace of them
            except (ConfigError, sqlite3.Error) as exc:
                result.failed = f"objects removed, pins not: {str(exc).splitlines()[0][:160]}"
        return result
    finally:
        tier.close()


def _clear_mooncake(config: KVPackConfig, scope: ClearScope, dry_run: bool, wait_s: float) -> StoreCleared:

    result = StoreCleared("mooncake", config.mooncake.master_server_address)
    if dry_run:
        result.failed = "Mooncake cannot count objects without removing them"
        return result
    try:
        client = replace(config.mooncake, global_segment_size=0)  # a client: contributes no memory
        tier = mooncake_tiers.MooncakeTier(client)
    except Exception as exc:  # noqa: BLE001 - an unusable Mooncake is one line, never a traceback
        result.failed = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return result
    try:
        if not tier.wait_ready(wait_s):
            result.failed = f"not connected to {config.mooncake.master_server_address} within {wait_s:.0f} s"
            return result
        return _run(result, scope, dry_run, tier)
    finally:
        tier.close()


def size(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def format_usage(stores: list[StoreUsage], hidden: dict[str, str]) -> str:
    """The human table of `usage`: one line per (store, tenant, model), then the host stores and
    the tiers not visible."""
    lines = [f"{'tier':<6} {'store':<34} {'tenant':<16} {'objects':>9} {'bytes':>10}  model"]
    for s in stores:
        if s.note:
            lines.append(f"{s.tier:<6} {s.store[-34:]:<34} ({s.note})")
        for r in s.rows:
            model = s.models.get(r.fingerprint) or f"fingerprint {r.fingerprint}"
            nbytes = size(r.nbytes if r.nbytes >= 0 else None)
            lines.append(f"{s.tier:<6} {s.store[-34:]:<34} {r.tenant[:16]:<16} {r.objects:>9} {nbytes:>10}  {model}")
    for s in stores:
        lines += [f"pinned in {s.store}: tenant {t}: {g} groups, {size(b)}" for t, (g, b) in s.pinned.items()]
        if s.users is not None:
            lines.append(
                f"host store {s.store}: {size(s.held_bytes)} of shared memory held until dropped, "
                f"{s.users} live user(s) (kvpack host drop {s.store})"
            )
    lines += [f"{tier}: not visible here: {why}" for tier, why in hidden.items()]
    return "\n".join(lines)
