"""kvpack's one typed configuration.

Built from the engine's JSON (vLLM ``kv_connector_extra_config``, SGLang
``--hicache-storage-backend-extra-config``), from a JSON/TOML file, or in
code. Every key is checked at construction: an unknown key or a bad value
raises `ConfigError` naming the dotted field path and what is allowed, so a
wrong config fails at engine start-up, never mid-run.

Sizes accept ints (bytes) or strings such as ``"8GiB"``. Times carry their
unit in the field name (``_ms``, ``_s``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError
from .sizes import parse_size

T = TypeVar("T")

METRICS_PORT_SPAN = 16
"""Ports tried from `metrics_port` on: one per process of an engine."""


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


@dataclass(frozen=True)
class MemoryTierConfig:
    """Host-RAM tier (pinned when CUDA exists). Capacity in bytes."""

    enabled: bool = True
    capacity: int = _size_field("4GiB")


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
            raise ConfigError(f"{path}.path", "must be a directory path when the disk tier is enabled")


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
        if self.timeout_ms <= 0:
            raise ConfigError(f"{path}.timeout_ms", f"must be > 0, got {self.timeout_ms}")
        if self.backoff_s < 0:
            raise ConfigError(f"{path}.backoff_s", f"must be >= 0, got {self.backoff_s}")
        for name in ("replica_num", "setup_retries", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}", f"must be >= 1, got {getattr(self, name)}")
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
            data = json.loads(Path(file).read_text())
        except OSError as exc:
            raise ConfigError(where, f"cannot read {file}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(where, f"{file} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(where, f"{file} must hold a JSON object")
        unknown = sorted(set(data) - set(self.FILE_KEYS) - set(self.FILE_IGNORED_KEYS))
        if unknown:
            raise ConfigError(f"{where}:{unknown[0]}", f"unknown Mooncake config key; known: {', '.join(self.FILE_KEYS)}")
        defaults = MooncakeTierConfig()
        updates: dict[str, Any] = {}
        for key in self.FILE_KEYS:
            if key not in data or getattr(self, key) != getattr(defaults, key):
                continue
            value = data[key]
            try:
                if key in ("global_segment_size", "local_buffer_size"):
                    value = _mooncake_size(value)
                elif key == "protocol":
                    value = MooncakeProtocol(str(value).strip().lower())
                elif key == "device_name":
                    value = "" if value is None else str(value)
                elif not isinstance(value, str):
                    raise ValueError(f"expected a string, got {value!r}")
            except ValueError as exc:
                raise ConfigError(f"{where}:{key}", str(exc)) from None
            updates[key] = value
        return dataclasses.replace(self, **updates, config_file="") if updates else self


def _mooncake_size(value: Any) -> int:
    """A size as Mooncake's config files write it: ints, or "3.125GB"/"512mb" (powers of 1024)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        s = value.strip().lower()
        for suffix, mult in (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
                             ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1)):
            if s.endswith(suffix):
                return int(float(s[: -len(suffix)]) * mult)
        return int(float(s))
    raise ValueError(f"expected a size such as '4GB' or an integer, got {value!r}")


@dataclass(frozen=True)
class EvictionConfig:
    """Eviction over whole groups, with per-tenant guaranteed shares.

    `tenant_quotas` maps a tenant to the bytes of each bounded tier it is
    guaranteed: another tenant can never evict it below that share; a tenant
    above its share is evicted first (its own entries before anyone else's).
    Tenants without an entry have a guaranteed share of 0.
    """

    policy: EvictionPolicyName = EvictionPolicyName.LRU
    tenant_quotas: dict[str, int] = field(default_factory=dict, metadata={"size": True})


@dataclass(frozen=True)
class KVPackConfig:
    """The whole kvpack configuration. See the module docstring."""

    tenant: str = "default"
    """Tenant of requests that name none."""
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
    shutdown_flush_s: float = 10.0
    """Longest a process waits, when it exits (normally, or on SIGINT/SIGTERM), for the
    stores it accepted to reach every tier; what is still queued then is counted as
    ``store_dropped{reason="shutdown"}`` and logged."""
    metrics_port: int = 0
    """Serve this process's kvpack_* Prometheus metrics on 127.0.0.1 (0: off).
    Each process (vLLM scheduler, each worker) takes the first free port of
    metrics_port .. metrics_port + 15 and logs which."""
    memory: MemoryTierConfig = field(default_factory=MemoryTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    mooncake: MooncakeTierConfig = field(default_factory=MooncakeTierConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

    def validate(self, path: str) -> None:
        from .keys import validate_tenant

        try:
            validate_tenant(self.tenant)
        except ValueError as exc:
            raise ConfigError(_join(path, "tenant"), str(exc)) from None
        for tenant in self.eviction.tenant_quotas:
            try:
                validate_tenant(tenant)
            except ValueError as exc:
                raise ConfigError(_join(path, f"eviction.tenant_quotas.{tenant}"), str(exc)) from None
        positive = {
            "prefix_match_unit": self.prefix_match_unit,
            "io_timeout_ms": self.io_timeout_ms,
            "write_queue_depth": self.write_queue_depth,
            "io_threads": self.io_threads,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(_join(path, name), f"must be > 0, got {value}")
        if not (math.isfinite(self.shutdown_flush_s) and 0 < self.shutdown_flush_s <= 3600):
            raise ConfigError(_join(path, "shutdown_flush_s"), f"must be > 0 and <= 3600 seconds, got {self.shutdown_flush_s}")
        if not 0 <= self.metrics_port <= 65535 - METRICS_PORT_SPAN:
            raise ConfigError(_join(path, "metrics_port"), f"must be 0 (off) or a port below {65535 - METRICS_PORT_SPAN}")
        if not (self.memory.enabled or self.disk.enabled or self.mooncake.enabled):
            raise ConfigError(_join(path, "memory.enabled"), "at least one tier (memory, disk, mooncake) must be enabled")

    # -- construction -------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> KVPackConfig:
        """Build from a plain dict (engine JSON). Raises ConfigError naming the field."""
        return build_dataclass(cls, data or {}, "")

    @classmethod
    def from_json(cls, text: str) -> KVPackConfig:
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError("<json>", f"not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("<json>", "must be a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KVPackConfig:
        """Build from a .json or .toml file."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise ConfigError("<file>", f"cannot read {p}: {exc}") from None
        if p.suffix == ".toml":
            try:
                return cls.from_dict(tomllib.loads(raw.decode()))
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError("<file>", f"{p} is not valid TOML: {exc}") from None
        return cls.from_json(raw.decode())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict that `from_dict` accepts back."""
        return _to_plain(self)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def build_dataclass(cls: type[T], data: Mapping[str, Any], path: str) -> T:
    """Strictly build dataclass `cls` from `data`, recursing into nested ones.

    Unknown keys, wrong types and invalid values raise ConfigError with the
    dotted path. Calls ``validate(path)`` on the result when it exists.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", f"expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            _join(path, str(unknown[0])),
            f"unknown key; allowed keys: {', '.join(sorted(fields))}",
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        f = fields[name]
        kwargs[name] = _coerce(hints[name], value, _join(path, name), bool(f.metadata.get("size")))
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def _coerce(tp: Any, value: Any, path: str, is_size: bool) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path)  # type: ignore[arg-type]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        allowed = [m.value for m in tp]
        if value not in allowed:
            raise ConfigError(path, f"must be one of {allowed}, got {value!r}")
        return tp(value)
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected an object, got {type(value).__name__}")
        return {
            _coerce(key_tp, k, f"{path}.{k}", False): _coerce(val_tp, v, f"{path}.{k}", is_size)
            for k, v in value.items()
        }
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, path, is_size)
    if tp is int and is_size:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ConfigError(path, str(exc)) from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    raise ConfigError(path, f"unsupported config type {tp!r}")  # pragma: no cover - programming error


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value
