"""kvpack's one typed configuration.

Built from the engine's JSON (vLLM ``kv_connector_extra_config``, SGLang
``--hicache-storage-backend-extra-config``), from a JSON/TOML file, or in
code. Every key is checked at construction: an unknown key or a bad value
raises `ConfigError` naming the dotted field path and what is allowed, so a
wrong config fails at engine start-up, never mid-run.

Sizes accept ints (bytes) or strings such as ``"8GiB"``, whole bytes only
(`kvpack.config.sizes`). Times carry their unit in the field name (``_ms``, ``_s``).
Every number has a stated range (`check_range`): NaN, infinities and absurd
values (``10**30`` ms) are refused naming the field, and thread counts are
capped at `MAX_THREADS`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ..errors import ConfigError, shown
from ..identity.keys import validate_tenant
from ..identity.model_identity import validate_model_id
from .build import build_dataclass, join_path, to_plain
from .files import parse_json, parse_toml, read_text
from .reset import ResetConfig
from .sizes import MAX_SIZE, parse_mooncake_size, parse_size
from .store_path import check_store_path_text

logger = logging.getLogger(__name__)

T = TypeVar("T")

METRICS_PORT_SPAN = 16
"""Ports tried from `metrics_port` on: one per process of an engine."""
MAX_THREADS = 64
"""Upper bound of every thread count (`io_threads`, `mooncake.workers`)."""
MAX_WAIT_MS = 600_000
"""Upper bound of every timeout in milliseconds (10 minutes)."""
MAX_KEY_FILE_BYTES = 4096
"""Largest `KVPackConfig.integrity_key_file` read (a hex key of 64 bytes is 128 characters)."""


def check_range(path: str, value: int | float, lo: int | float, hi: int | float) -> None:
    """Raise ConfigError naming `path` unless ``lo <= value <= hi`` (NaN is never in range)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path, f"must be a finite number, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(path, f"must be between {lo} and {hi}, got {shown(value)}")


def _size_field(default: int | str, doc: str = "") -> Any:
    """A dataclass field holding a byte size; strings like "8GiB" are parsed."""
    return field(default=parse_size(default), metadata={"size": True, "doc": doc})


class EvictionPolicyName(enum.Enum):
    LRU = "lru"
    ARC = "arc"


class DraftPolicy(enum.Enum):
    """What a lookup reports when the target KV is stored but a draft member is not.

    RECOMPUTE: the prefix is not a hit (the engine recomputes target and draft);
    the partial hit is counted by missing member. TARGET_ONLY: the target KV is
    used without the draft state; the hit is counted as partial. Engines do not
    recompute draft KV for tokens they did not schedule (vLLM's drafter runs on
    empty draft blocks), so expect a lower accept rate for those requests: this
    trades acceptance for prefill time, visibly. Neither is ever silent.
    """

    RECOMPUTE = "recompute"
    TARGET_ONLY = "target_only"


class DraftPlacementMode(enum.Enum):
    """Where draft-model (speculative decoding) KV is stored beside the target's.

    AUTO: PACKED when the draft layers share the target's block index space,
    SIDECAR otherwise. PACKED: the draft layers are copied into the target's
    object (one member, so they cannot be lost on their own). SIDECAR: a
    separate ``draft`` member of the same group (same chunk keys, its own
    layout fingerprint); a chunk stored without it is a partial hit, handled by
    `DraftPolicy`. Without speculative decoding nothing is stored for a draft.
    """

    AUTO = "auto"
    PACKED = "packed"
    SIDECAR = "sidecar"


class ChecksumPolicy(enum.Enum):
    """When payload checksums are verified on load (headers always are).

    BOUNDARY: for objects that crossed a process or persistence boundary (disk,
    Mooncake); host-memory objects never left this process. ALWAYS: every
    tier. NEVER: no payload checksums (benchmarks only).
    """

    BOUNDARY = "boundary"
    ALWAYS = "always"
    NEVER = "never"


class MooncakeProtocol(enum.Enum):
    TCP = "tcp"
    RDMA = "rdma"


class MemoryMode(enum.Enum):
    """Where the memory tier lives (`kvpack.tiers.host`).

    PROCESS: an arena in each process (`capacity` per process). HOST: one store in the
    host's shared memory (``/dev/shm``) that every kvpack process of this user and
    `host_name` shares (`capacity` per host). AUTO: HOST when the engine runs more than
    one process on the host (the adapter says so) or another live process already uses
    the host store, else PROCESS (faster for one process: `kvpack.tiers.host.choice`)."""

    PROCESS = "process"
    HOST = "host"
    AUTO = "auto"


HOST_NAME_RE = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"
"""What `MemoryTierConfig.host_name` may be (it is part of a folder name)."""


@dataclass(frozen=True)
class MemoryTierConfig:
    """Host-RAM tier. Capacity in bytes (per process, or per host in `MemoryMode.HOST`).
    Its memory is not pinned: GPU copies go through the transfer staging
    (`TransferConfig`), never straight from the tier. `host_name` names the host store
    (its folder is ``/dev/shm/kvpack-<uid>-<name>``): processes share it only when they run
    as one user with one name. Empty (the default): named after the disk store (processes
    on one ``disk.path`` share one host store), or ``default`` with the disk tier off."""

    enabled: bool = True
    capacity: int = _size_field("4GiB")
    mode: MemoryMode = MemoryMode.AUTO
    host_name: str = ""

    def validate(self, path: str) -> None:

        if self.host_name and not re.fullmatch(HOST_NAME_RE, self.host_name):
            raise ConfigError(join_path(path, "host_name"), f"{shown(self.host_name, 80)} must match {HOST_NAME_RE}")


MAX_TRANSFER_BYTES = 1 << 40
"""Upper bound of every transfer byte bound (1 TiB)."""


@dataclass(frozen=True)
class TransferConfig:
    """Host memory a process's transfers may hold (`kvpack.transfers`). Each bound turns a
    transfer away (counted in ``kvpack_transfers_turned_away``) instead of making the
    engine wait; one transfer larger than a bound still runs when nothing else is held.

    `staging_bytes`: pinned host staging of a GPU cache (one pool per process, reused;
    a CPU cache stages in plain memory). `max_queued_save_bytes`: payload bytes of saves
    queued and not yet stored (a turned-away save is a future miss).
    `max_inflight_load_bytes`: payload bytes of loads accepted and not yet reported
    (a turned-away load is recomputed)."""

    staging_bytes: int = _size_field("2GiB")
    max_queued_save_bytes: int = _size_field("1GiB")
    max_inflight_load_bytes: int = _size_field("1GiB")

    def validate(self, path: str) -> None:
        for name in ("staging_bytes", "max_queued_save_bytes", "max_inflight_load_bytes"):
            check_range(join_path(path, name), getattr(self, name), 1 << 20, MAX_TRANSFER_BYTES)


def _default_disk_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvpack", "store")


@dataclass(frozen=True)
class DiskTierConfig:
    """Local-disk tier: one directory, atomic writes, survives restarts."""

    enabled: bool = True
    path: str = field(default_factory=_default_disk_path)
    capacity: int = _size_field("32GiB")
    fsync: bool = False

    def validate(self, path: str) -> None:
        if self.enabled and not self.path:
            raise ConfigError(join_path(path, "path"), "must be a directory path when the disk tier is enabled")
        if self.enabled:
            try:
                check_store_path_text(self.path)
            except ValueError as exc:
                raise ConfigError(join_path(path, "path"), str(exc)) from None


@dataclass(frozen=True)
class MooncakeTierConfig:
    """Mooncake distributed store tier (off unless configured).

    Connection: `master_server_address` (``host:port`` of ``mooncake_master``),
    `metadata_server` (``P2PHANDSHAKE``: no etcd/HTTP metadata service needed),
    `protocol` tcp or rdma with `device_name` (e.g. ``mlx5_0``; rdma only),
    `local_hostname` (the address other nodes reach this process on).
    `global_segment_size` is the memory this process contributes to the
    cluster (0: pure client; then a ``mooncake_client`` holder must exist).
    `local_buffer_size` is Mooncake's own client buffer (kvpack does not use
    it); `staging_size` is kvpack's registered transfer arena, split into one
    lane per worker thread (`workers`).

    Tenants and groups: `tenant_id` is the Mooncake tenant (a namespace the
    master isolates when run with ``--enable_multi_tenants``); kvpack's own
    tenant scoping of keys holds inside it. With `use_groups`, the members of
    one kvpack group share one Mooncake group id, so the store leases and
    evicts them together.

    Bounded failure: `timeout_ms` bounds every call kvpack makes into
    Mooncake; after a stall or connection failure the tier stops calling for
    `backoff_s` seconds (circuit breaker), probes in the background and
    recovers by itself. `setup_retries` is Mooncake's
    ``MC_STORE_CLIENT_SETUP_RETRIES`` for one background connect attempt.
    `connect_wait_ms` bounds how long, after start-up, lookups and transfers
    wait for the first connect while it is still in progress (a master that
    cannot be reached is not waited for): vLLM holds the request, not the
    engine, and asks again next step; SGLang's prefetch thread and the
    write-back threads wait. 0: never wait (the tier misses until connected).

    `config_file` may name a Mooncake JSON config (``MOONCAKE_CONFIG_PATH``
    style keys: local_hostname, metadata_server, global_segment_size,
    local_buffer_size, protocol, device_name, master_server_address,
    tenant_id); its values fill the fields left at their defaults here. When
    neither `master_server_address` nor `config_file` is given, the file named
    by the ``MOONCAKE_CONFIG_PATH`` environment variable is used.
    """

    enabled: bool = False
    master_server_address: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: MooncakeProtocol = MooncakeProtocol.TCP
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = _size_field("512MiB")
    local_buffer_size: int = _size_field("16MiB")
    staging_size: int = _size_field("64MiB")
    tenant_id: str = "default"
    use_groups: bool = True
    replica_num: int = 1
    timeout_ms: int = 200
    backoff_s: float = 5.0
    setup_retries: int = 1
    connect_wait_ms: int = 5000
    workers: int = 2
    config_file: str = ""

    # Keys of a Mooncake JSON config that map onto fields here, and keys kvpack
    # accepts in such a file but does not use (Mooncake's SSD offload and
    # client HTTP server belong to the holder process, not to an engine).
    FILE_KEYS = (
        "local_hostname",
        "metadata_server",
        "global_segment_size",
        "local_buffer_size",
        "protocol",
        "device_name",
        "master_server_address",
        "tenant_id",
    )
    FILE_IGNORED_KEYS = ("enable_ssd_offload", "ssd_offload_path", "enable_client_http_server", "client_http_port")

    def validate(self, path: str) -> None:
        if self.enabled:
            resolved = self.resolved(path)
            if not resolved.master_server_address:
                raise ConfigError(
                    f"{path}.master_server_address",
                    "required when the Mooncake tier is enabled (e.g. '127.0.0.1:50051'), "
                    "directly or through config_file / MOONCAKE_CONFIG_PATH",
                )
            if resolved.protocol is MooncakeProtocol.RDMA and not resolved.device_name:
                raise ConfigError(f"{path}.device_name", "required with protocol 'rdma' (e.g. 'mlx5_0')")
            if not resolved.tenant_id:
                raise ConfigError(f"{path}.tenant_id", "must not be empty")
        check_range(f"{path}.timeout_ms", self.timeout_ms, 1, MAX_WAIT_MS)
        check_range(f"{path}.backoff_s", self.backoff_s, 0, 3600)
        check_range(f"{path}.replica_num", self.replica_num, 1, 64)
        check_range(f"{path}.setup_retries", self.setup_retries, 1, 100)
        check_range(f"{path}.connect_wait_ms", self.connect_wait_ms, 0, MAX_WAIT_MS)
        check_range(f"{path}.workers", self.workers, 1, MAX_THREADS)
        if self.staging_size < self.workers * (1 << 20):
            raise ConfigError(f"{path}.staging_size", f"must be at least 1MiB per worker, got {self.staging_size}")

    def resolved(self, path: str = "mooncake") -> MooncakeTierConfig:
        """This config with the Mooncake JSON file's values filled in.

        Fields still at their default take the file's value; anything set
        here wins. Raises ConfigError naming the file key on a bad file."""
        file = self.config_file
        if not file and not self.master_server_address:
            file = os.environ.get("MOONCAKE_CONFIG_PATH", "")
        if not file:
            return self
        where = f"{path}.config_file" if self.config_file else "MOONCAKE_CONFIG_PATH"
        try:
            data = parse_json(read_text(file), file)
        except ConfigError as exc:
            raise ConfigError(where, f"{exc.source} {exc.problem}") from None
        if not isinstance(data, dict):
            raise ConfigError(where, f"{file} must hold a JSON object")
        unknown = sorted(set(data) - set(self.FILE_KEYS) - set(self.FILE_IGNORED_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}:{unknown[0]}", f"unknown Mooncake config key; known: {', '.join(self.FILE_KEYS)}"
            )
        defaults = MooncakeTierConfig()
        updates: dict[str, Any] = {}
        for key in self.FILE_KEYS:
            if key not in data or getattr(self, key) != getattr(defaults, key):
                continue
            value = data[key]
            try:
                if key in ("global_segment_size", "local_buffer_size"):
                    value = parse_mooncake_size(value)
                    if value > MAX_SIZE:
                        raise ValueError(f"size must be at most {MAX_SIZE} bytes, got {shown(value)}")
                elif key == "protocol":
                    if not isinstance(value, str):
                        raise ValueError(f"expected 'tcp' or 'rdma', got {shown(value)}")
                    value = MooncakeProtocol(value.strip().lower())
                elif key == "device_name":
                    if value is not None and not isinstance(value, str):
                        raise ValueError(f"expected a string, got {shown(value)}")
                    value = value or ""
                elif not isinstance(value, str):
                    raise ValueError(f"expected a string, got {shown(value)}")
            except ValueError as exc:
                raise ConfigError(f"{where}:{key}", str(exc)) from None
            updates[key] = value
        return dataclasses.replace(self, **updates, config_file="") if updates else self


@dataclass(frozen=True)
class EvictionConfig:
    """Eviction over whole groups, with per-tenant guaranteed shares.

    `tenant_quotas` maps a tenant to the bytes of each bounded tier it is
    guaranteed: another tenant can never evict it below that share; a tenant
    above its share is evicted first (its own entries before anyone else's).
    Tenants without an entry have a guaranteed share of 0.

    `policy` orders the memory tier's victims; the disk tier's index, shared by
    every process on its folder, orders them by LRU whatever `policy` says.
    """

    policy: EvictionPolicyName = EvictionPolicyName.LRU
    tenant_quotas: dict[str, int] = field(default_factory=dict, metadata={"size": True})
    pinned_bytes_per_tenant: int = _size_field(0, "bytes a tenant may pin (`kvpack.store.pins`); 0: pins off")


@dataclass(frozen=True)
class KVPackConfig:
    """The whole kvpack configuration. See the module docstring."""

    tenant: str = "default"
    """Tenant of requests that name none."""
    model_id: str = ""
    """The model's cache identity, named by the operator (``"llama-3.1-8b@v2"``): stores of
    engines with the same `model_id` share entries whatever their paths. Empty (the
    default): a digest of the checkpoint's config and weight headers (`kvpack.identity.model_identity`).
    Only set it for checkpoints you know hold the same weights."""
    tail_reuse: bool = True
    """Store and reuse the computed tail of a request's last, partial block."""
    prefix_match_unit: int = 1
    """Granularity (tokens) of a partial-block match; 1 for full attention."""
    draft_policy: DraftPolicy = DraftPolicy.RECOMPUTE
    draft_placement: DraftPlacementMode = DraftPlacementMode.AUTO
    """Draft-model KV packed into the target's objects or in a sidecar member."""
    checksum: ChecksumPolicy = ChecksumPolicy.BOUNDARY
    """Which loads verify the payload checksum (headers are always verified)."""
    io_timeout_ms: int = 500
    """Longest any engine-facing call waits on storage before giving up (recompute)."""
    write_queue_depth: int = 256
    """Bounded write-back queue (objects); when full, stores are dropped and counted."""
    io_threads: int = 2
    """Write-back threads (and the tiers' copy/I-O threads, and the threads converting an
    SGLang GPU server's pages: `kvpack.conversion_threads`): 1 .. `MAX_THREADS`."""
    trusted_tenants: tuple[str, ...] = ()
    """Tenant names a request may choose with ``kv_transfer_params["kvpack_tenant"]``
    (``["*"]``: any valid name). Empty (the default): that parameter is ignored,
    counted and logged once, and the request's tenant is ``cache_salt``'s own
    scope or `tenant`. Only list names here behind a front end that sets the
    parameter itself: any HTTP client of vLLM's OpenAI server can send it."""
    tenant_signing_key: str = ""
    """Hex key (16-64 bytes) of a trusted front end: a request's ``kvpack_tenant``
    is honoured when ``kvpack_tenant_sig`` is `kvpack.identity.keys.tenant_signature`
    of it under this key. Either this or `trusted_tenants` opts in."""
    integrity_key: str = ""
    """Hex key (16-64 bytes) for a keyed MAC (HMAC-SHA256) over header and payload of every
    object that leaves the process (disk, Mooncake), checked on every load from
    them: with it, whoever can write the store folder or the Mooncake cluster
    but does not hold the key cannot forge an object. Empty: xxh3 checksums
    (catch damage, not forgery). See `integrity_key_file`."""
    integrity_key_file: str = ""
    """A file holding the hex integrity key (instead of `integrity_key` in the engine's JSON)."""
    metrics_max_tenants: int = 64
    """Tenants with their own Prometheus label; any further tenant is counted as ``other``
    (tenants named in this config always keep theirs)."""
    shutdown_flush_s: float = 10.0
    """Longest a process waits, when it exits (normally, or on SIGINT/SIGTERM), for the
    stores it accepted to reach every tier; what is still queued then is counted as
    ``store_dropped{reason="shutdown"}`` and logged."""
    handoff_wait_ms: int = 2000
    """Prefill/decode handoff (vLLM ``do_remote_prefill``): longest a decode instance's load
    waits for the prefill instance's objects to land in a shared tier; then it loads what
    is there and recomputes the rest (counted)."""
    metrics_port: int = 0
    """Serve this process's kvpack_* Prometheus metrics on 127.0.0.1 (0: off).
    Each process (vLLM scheduler, each worker) takes the first free port of
    metrics_port .. metrics_port + 15 and logs which."""
    memory: MemoryTierConfig = field(default_factory=MemoryTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    mooncake: MooncakeTierConfig = field(default_factory=MooncakeTierConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    reset: ResetConfig = field(default_factory=ResetConfig)
    """What the engine's own reset verb removes (`kvpack.policy.clearing`)."""

    def validate(self, path: str) -> None:

        try:
            validate_tenant(self.tenant)
        except ValueError as exc:
            raise ConfigError(join_path(path, "tenant"), str(exc)) from None
        if self.model_id:
            try:
                validate_model_id(self.model_id)
            except ValueError as exc:
                raise ConfigError(join_path(path, "model_id"), str(exc)) from None
        for tenant in self.eviction.tenant_quotas:
            try:
                validate_tenant(tenant)
            except ValueError as exc:
                raise ConfigError(join_path(path, f"eviction.tenant_quotas.{tenant}"), str(exc)) from None
        if self.eviction.pinned_bytes_per_tenant and not self.disk.enabled:
            raise ConfigError(
                join_path(path, "eviction.pinned_bytes_per_tenant"),
                "pins are kept in the disk store's folder: set disk.path, or 0 to turn pins off",
            )
        ranges: dict[str, tuple[int | float, int, int]] = {
            "prefix_match_unit": (self.prefix_match_unit, 1, 1 << 20),
            "io_timeout_ms": (self.io_timeout_ms, 1, MAX_WAIT_MS),
            "write_queue_depth": (self.write_queue_depth, 1, 1 << 20),
            "io_threads": (self.io_threads, 1, MAX_THREADS),
            "metrics_max_tenants": (self.metrics_max_tenants, 1, 10_000),
        }
        for name, (value, lo, hi) in ranges.items():
            check_range(join_path(path, name), value, lo, hi)
        for i, tenant in enumerate(self.trusted_tenants):
            if tenant == "*":
                continue
            try:
                validate_tenant(tenant)
            except ValueError as exc:
                raise ConfigError(join_path(path, f"trusted_tenants[{i}]"), str(exc)) from None
        if self.tenant_signing_key:
            _hex_key(join_path(path, "tenant_signing_key"), self.tenant_signing_key, 16, 64)
        if self.integrity_key and self.integrity_key_file:
            raise ConfigError(
                join_path(path, "integrity_key_file"), "set integrity_key or integrity_key_file, not both"
            )
        self.integrity_key_bytes(path)
        if not (math.isfinite(self.shutdown_flush_s) and 0 < self.shutdown_flush_s <= 3600):
            raise ConfigError(
                join_path(path, "shutdown_flush_s"), f"must be > 0 and <= 3600 seconds, got {self.shutdown_flush_s}"
            )
        check_range(join_path(path, "handoff_wait_ms"), self.handoff_wait_ms, 0, MAX_WAIT_MS)
        if not 0 <= self.metrics_port <= 65535 - METRICS_PORT_SPAN:
            raise ConfigError(
                join_path(path, "metrics_port"), f"must be 0 (off) or a port below {65535 - METRICS_PORT_SPAN}"
            )
        if not (self.memory.enabled or self.disk.enabled or self.mooncake.enabled):
            raise ConfigError(
                join_path(path, "memory.enabled"), "at least one tier (memory, disk, mooncake) must be enabled"
            )

    def signing_key_bytes(self) -> bytes:
        """The tenant signing key (b"" when none is configured)."""
        return bytes.fromhex(self.tenant_signing_key) if self.tenant_signing_key else b""

    def integrity_key_bytes(self, path: str = "") -> bytes | None:
        """The integrity key (`integrity_key` or the file's), None when off; ConfigError naming the field."""
        if self.integrity_key:
            return _hex_key(join_path(path, "integrity_key"), self.integrity_key, 16, 64)
        if not self.integrity_key_file:
            return None
        where = join_path(path, "integrity_key_file")
        try:
            text = read_text(self.integrity_key_file, limit=MAX_KEY_FILE_BYTES)
        except ConfigError as exc:
            raise ConfigError(where, f"{shown(exc.source, 200)} {exc.problem}") from None
        return _hex_key(where, text.strip(), 16, 64)

    # -- construction -------------------------------------------------------

    RENAMED: ClassVar[dict[str, str]] = {"pd_wait_ms": "handoff_wait_ms"}
    """Keys of earlier releases -> their names now: still read, with a warning."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> KVPackConfig:
        """Build from a plain dict (engine JSON). Raises ConfigError naming the field."""
        data = data or {}
        if isinstance(data, Mapping):  # anything else is build_dataclass's error to name
            data = dict(data)
            for old, new in cls.RENAMED.items():
                if old in data:
                    if new in data:
                        raise ConfigError(old, f"renamed to {new}, which is given too; keep only {new}")
                    logger.warning("kvpack config: %r is now called %r; reading it as %r", old, new, new)
                    data[new] = data.pop(old)
        return build_dataclass(cls, data, "")

    @classmethod
    def from_json(cls, text: str, source: str = "<json>") -> KVPackConfig:
        """Build from JSON text (empty: the defaults). Raises ConfigError naming `source` and the field."""
        data = parse_json(text, source) if text.strip() else {}
        if not isinstance(data, dict):
            raise ConfigError("", "must hold a JSON object", source)
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise exc.in_file(source) from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KVPackConfig:
        """Build from a .toml file, or a JSON one (any other name). Whatever the file
        holds, the result is a config or one `ConfigError` naming the file, the field
        where there is one, and the problem (`kvpack.config.files`)."""
        source = os.fspath(path)
        text = read_text(source)
        if Path(source).suffix != ".toml":
            return cls.from_json(text, source)
        data = parse_toml(text, source)
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise exc.in_file(source) from None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict that `from_dict` accepts back."""
        return to_plain(self)


def _hex_key(path: str, text: str, min_bytes: int, max_bytes: int) -> bytes:
    """`text` as the bytes of a hex key of `min_bytes`..`max_bytes`; ConfigError naming `path` (never the key)."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(path, "must be a hex string") from None
    if not min_bytes <= len(key) <= max_bytes:
        raise ConfigError(
            path, f"must be {min_bytes}-{max_bytes} bytes ({2 * min_bytes}-{2 * max_bytes} hex digits), got {len(key)}"
        )
    return key
