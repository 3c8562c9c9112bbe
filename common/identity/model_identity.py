"""Model identity: what a checkpoint *is*, computed from what is on disk, not where it lives.

The layout fingerprint's ``model`` field (`kvpack.identity.layout_spec.KVLayoutSpec.model`)
must change exactly when the KV a model computes for the same token ids can
change. A path does neither job: the same checkpoint copied elsewhere is "another
model" (a needless miss), and a checkpoint rebuilt in place (other weights, same
path) is "the same model" (a wrong load). `model_identity` gives, engine-neutral:

- ``id:<model_id>`` when the operator names the model (`KVPackConfig.model_id`:
  "these checkpoints are the same weights"); nothing is read.
- ``ckpt:v1:<32 hex>`` for a local checkpoint directory: a SHA-256 over
  * ``config.json`` as canonical JSON (keys sorted, no whitespace), without
    the fields that change neither the weights nor the KV (`IGNORED_CONFIG_FIELDS`,
    at any depth; ``torch_dtype`` is read as ``dtype``, its newer name); list order
    (``architectures``...) is kept;
  * every weight tensor's name, dtype and shape from the safetensors headers
    (8-byte little-endian length + JSON at the start of each file; the files of
    ``model.safetensors.index.json`` when there is one, else ``*.safetensors``),
    in name order, so resharding the same tensors into other files keeps it;
  * a content sample of each tensor: `SAMPLE_BYTES` at its start, middle and end
    (at most `MAX_SAMPLED_TENSORS` tensors, spread evenly by name). Names, shapes
    and dtypes alone cannot tell two fine-tunes of one base, or one tiny model
    built with two seeds, apart; the sample does, without loading the weights.
  Checkpoints without safetensors (``*.bin``, ``*.pt``) contribute each file's
  size and samples at `FILE_SAMPLES` spread offsets instead; a single local file
  (a GGUF model) the same way.
- ``name:<as given>[@<revision>]`` otherwise (a hub name, a path that is not
  here): the name as the engine gives it, logged once per name at info level.

Invariants: the digest reads only headers and at most
``3 * SAMPLE_BYTES * MAX_SAMPLED_TENSORS`` bytes of tensor data; it is a pure
function of those bytes (path, mtime and file names other than the weight
files' own are not in it); results are cached per process by real path and the
(size, mtime, inode) of every file read, so a rebuild in place is seen.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kvpack.identity.model_identity")

IDENTITY_VERSION = 1
"""Version of the digest's recipe (in the identity string: ``ckpt:v1:``)."""
IGNORED_CONFIG_FIELDS = frozenset(
    {"_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset"}
)
"""config.json fields (at any depth) that say who saved the checkpoint or how HF runs it, not what it computes."""
SAMPLE_BYTES = 64
"""Bytes read at each of a tensor's three sample points (start, middle, end)."""
MAX_SAMPLED_TENSORS = 4096
"""Most tensors whose content is sampled (spread evenly over the name order); every
tensor's name, dtype and shape is in the digest regardless."""
FILE_SAMPLES = 16
"""Sample points in a weight file without a safetensors header (``*.bin``, GGUF)."""
MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header accepted (the format's own limit)."""
MODEL_ID_MAX = 256
_MODEL_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+=-]*")
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.gguf")


class IdentitySource(enum.Enum):
    """Where an identity came from."""

    MODEL_ID = "model_id"
    """The operator's `KVPackConfig.model_id`."""
    DIGEST = "digest"
    """A digest of a local checkpoint (directory or single file)."""
    NAME = "name"
    """The name as the engine gave it (hub name, or a path that is not here)."""


@dataclass(frozen=True)
class ModelIdentity:
    """One model's identity.

    Attributes:
        value: what goes into `KVLayoutSpec.model` (``id:...``, ``ckpt:v1:...``, ``name:...``).
        source: how `value` was found.
        detail: the path digested, or the name used (logs).
    """

    value: str
    source: IdentitySource
    detail: str


def validate_model_id(model_id: str) -> str:
    """Return `model_id` if it is a valid `KVPackConfig.model_id`, else raise ValueError.

    Allowed: 1-256 characters of letters, digits and ``._:/@+=-``, starting with a
    letter or digit (a hub name with a revision, ``org/model@rev``, fits)."""
    if not isinstance(model_id, str) or len(model_id) > MODEL_ID_MAX or not _MODEL_ID_RE.fullmatch(model_id):
        raise ValueError(
            f"invalid model_id {str(model_id)[:80]!r}: use 1-{MODEL_ID_MAX} characters of letters, digits, "
            "'.', '_', ':', '/', '@', '+', '=', '-', starting with a letter or digit"
        )
    return model_id


_cache: dict[tuple[str, tuple[tuple[str, int, int, int], ...]], str] = {}
_cache_lock = threading.Lock()
_named: set[str] = set()


def model_identity(
    model: str | os.PathLike[str], *, model_id: str = "", revision: str | None = None, page_format: str = ""
) -> ModelIdentity:
    """The identity of the model the engine names `model` (a path or a hub name).

    `model_id` (non-empty) wins and nothing is read. A local directory or file is
    digested (see the module docstring); anything else is the name as given, with
    `revision` appended when there is one. `page_format`: the engine's own format of this
    model's KV pages when it has one (SGLang's storage format tag), appended as
    ``|format=<tag>`` to any of the three: it splits the cache, `model_id` never replaces
    it. Raises ValueError for a checkpoint whose safetensors header is damaged (the engine
    could not load it either)."""
    found = _identity(model, model_id, revision)
    if not page_format:
        return found
    return ModelIdentity(f"{found.value}|format={page_format}", found.source, found.detail)


def _identity(model: str | os.PathLike[str], model_id: str, revision: str | None) -> ModelIdentity:
    """`model_identity` without a page format."""
    if model_id:
        return ModelIdentity(f"id:{validate_model_id(model_id)}", IdentitySource.MODEL_ID, model_id)
    name = os.fspath(model)
    path = Path(name).expanduser()
    if name and (path.is_dir() and _has_checkpoint(path) or path.is_file()):
        return ModelIdentity(f"ckpt:v{IDENTITY_VERSION}:{checkpoint_digest(path)}", IdentitySource.DIGEST, str(path))
    shown = f"{name}@{revision}" if revision else name
    with _cache_lock:
        first = shown not in _named
        _named.add(shown)
    if first:
        log.info(
            "kvpack: model %r is not a local checkpoint directory; its cache identity is the name as given "
            "(set model_id to name the weights)",
            shown,
        )
    return ModelIdentity(f"name:{shown}", IdentitySource.NAME, shown)


def checkpoint_kv_heads(model: str | os.PathLike[str]) -> int:
    """The model's KV heads over all tensor-parallel ranks, from its local checkpoint's
    ``config.json`` (``num_key_value_heads``, else ``num_attention_heads``; a multimodal
    model's ``text_config`` first). 0 when `model` is no local checkpoint directory, or its
    config is unreadable or says nothing: the caller then does not know, never guesses."""
    name = os.fspath(model)
    try:
        config = json.loads((Path(name) / "config.json").read_text()) if name else {}
    except (OSError, ValueError):
        return 0
    if not isinstance(config, dict):
        return 0
    for section in (config.get("text_config"), config):
        if isinstance(section, dict):
            for key in ("num_key_value_heads", "num_attention_heads"):
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return 0


def checkpoint_digest(path: str | os.PathLike[str]) -> str:
    """32 hex chars identifying the checkpoint at `path` (a directory or one weight file).
    Cached per real path and the size/mtime/inode of every file it reads."""
    root = Path(path).resolve()
    files = _files_read(root)
    signature = tuple(_stat_key(root, f) for f in files)
    key = (str(root), signature)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    digest = _compute(root, files)
    with _cache_lock:
        _cache[key] = digest
    return digest


def clear_cache() -> None:
    """Forget every cached digest (tests; a long-lived process never needs it)."""
    with _cache_lock:
        _cache.clear()
        _adapter_cache.clear()
        _named.clear()


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_IGNORED_FIELDS = IGNORED_CONFIG_FIELDS | {"base_model_name_or_path", "revision"}
"""adapter_config.json fields that name where the base came from, not what the adapter computes
(the base model is in the layout fingerprint already)."""
_ADAPTER_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_adapter_cache: dict[tuple[str, tuple[tuple[str, int, int, int], ...]], str] = {}


def adapter_identity(path: str | os.PathLike[str] | None, name: str) -> str:
    """The identity of a LoRA adapter in a request's key seed: what the adapter computes, not
    what it is called.

    A local adapter directory (one with ``adapter_config.json``) is ``lora:v1:<32 hex>``: a
    SHA-256 over that file as canonical JSON (without `ADAPTER_IGNORED_FIELDS`) and every
    weight file's name and whole content (adapters are small), so an adapter reloaded under
    the same name with other weights never shares keys, and the same adapter shares under
    any name or path. Cached per real path and the size/mtime/inode of every file read.
    Anything else (a hub name, a path not on this machine, an unreadable file) is
    ``name:<name>``, logged once per name."""
    root = Path(os.fspath(path)).expanduser() if path else None
    if root is not None and (root / ADAPTER_CONFIG).is_file():
        try:
            return f"lora:v{IDENTITY_VERSION}:{_adapter_digest(root.resolve())}"
        except (OSError, ValueError) as exc:
            reason = f"cannot read it: {exc}"
    else:
        reason = "not a local adapter directory"
    with _cache_lock:
        first = f"lora\0{name}" not in _named
        _named.add(f"lora\0{name}")
    if first:
        log.info("kvpack: LoRA adapter %r at %r: %s; its cache identity is its name", name, str(path or ""), reason)
    return f"name:{name}"


def _adapter_digest(root: Path) -> str:
    config = root / ADAPTER_CONFIG
    weights = sorted({p for pattern in _ADAPTER_WEIGHTS for p in root.glob(pattern) if p.is_file()})
    key = (str(root), tuple(_stat_key(root, f) for f in [config, *weights]))
    with _cache_lock:
        hit = _adapter_cache.get(key)
    if hit is not None:
        return hit
    try:
        data = json.loads(config.read_text())
    except ValueError as exc:
        raise ValueError(f"{config}: {exc}") from None
    cleaned = (
        {k: _clean(v) for k, v in data.items() if k not in ADAPTER_IGNORED_FIELDS} if isinstance(data, dict) else data
    )
    h = hashlib.sha256(f"kvpack-adapter-identity-v{IDENTITY_VERSION}\0".encode())
    h.update(json.dumps(cleaned, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    for f in weights:
        h.update(f"\0file:{f.name}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    digest = h.hexdigest()[:32]
    with _cache_lock:
        _adapter_cache[key] = digest
    return digest


# -- what is read ------------------------------------------------------------------


def _has_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() or bool(_weight_files(path))


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files of the index (or every top-level ``*.safetensors``), else other weight files."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (OSError, ValueError) as exc:
            raise ValueError(f"kvpack: cannot read {index}: {exc}") from None
        names = sorted({str(v) for v in weight_map.values()})
        bad = [n for n in names if not n or Path(n).is_absolute() or ".." in Path(n).parts]
        if bad:
            raise ValueError(f"kvpack: {index} names weight files outside the checkpoint: {bad[:3]}")
        return [root / n for n in names]
    found = sorted(root.glob("*.safetensors"))
    if found:
        return found
    return sorted(p for pattern in _OTHER_WEIGHTS for p in root.glob(pattern))


def _files_read(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    config = root / "config.json"
    return ([config] if config.is_file() else []) + _weight_files(root)


def _stat_key(root: Path, f: Path) -> tuple[str, int, int, int]:
    try:
        st = f.stat()
    except OSError:
        return (f.name, -1, -1, -1)
    return (f.name if f != root else "", st.st_size, st.st_mtime_ns, st.st_ino)


def _compute(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256(f"kvpack-model-identity-v{IDENTITY_VERSION}\0".encode())
    if root.is_file():
        h.update(b"file\0")
        _sample_file(h, root)
        return h.hexdigest()[:32]
    config = root / "config.json"
    h.update(b"config\0")
    if config in files:
        h.update(canonical_config(config).encode())
    h.update(b"\0weights\0")
    tensors: list[tuple[str, str, tuple[int, ...], Path, int, int]] = []
    others: list[Path] = []
    for f in files:
        if f == config:
            continue
        if f.suffix == ".safetensors":
            tensors += _safetensors_entries(f)
        else:
            others.append(f)
    tensors.sort(key=lambda t: t[0])
    stride = max(1, -(-len(tensors) // MAX_SAMPLED_TENSORS))
    handles: dict[Path, int] = {}
    try:
        for i, (name, dtype, shape, f, begin, end) in enumerate(tensors):
            h.update(json.dumps([name, dtype, list(shape)], separators=(",", ":")).encode())
            if i % stride == 0:
                fd = handles.get(f)
                if fd is None:
                    fd = handles[f] = os.open(f, os.O_RDONLY)
                h.update(_tensor_sample(fd, begin, end))
    finally:
        for fd in handles.values():
            os.close(fd)
    for f in others:
        h.update(f"\0file:{f.name}\0".encode())
        _sample_file(h, f)
    return h.hexdigest()[:32]


def canonical_config(path: Path) -> str:
    """``config.json`` as canonical JSON without `IGNORED_CONFIG_FIELDS` (``torch_dtype`` read as ``dtype``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"kvpack: cannot read {path}: {exc}") from None
    return json.dumps(_clean(data), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        out = {k: _clean(v) for k, v in value.items() if k not in IGNORED_CONFIG_FIELDS}
        if "torch_dtype" in out and "dtype" not in out:
            out["dtype"] = out.pop("torch_dtype")
        return out
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _safetensors_entries(f: Path) -> list[tuple[str, str, tuple[int, ...], Path, int, int]]:
    """(name, dtype, shape, file, absolute begin, absolute end) of every tensor in `f`'s header."""
    try:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if not 2 <= n <= MAX_HEADER_BYTES:
                raise ValueError(f"header length {n} out of range")
            raw = fh.read(n)
            if len(raw) != n:
                raise ValueError("truncated header")
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        size = f.stat().st_size
        out = []
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in meta["data_offsets"])
            start = 8 + n
            if not 0 <= begin <= end or start + end > size:
                raise ValueError(f"tensor {name}: data_offsets {meta['data_offsets']} outside the file")
            out.append(
                (str(name), str(meta["dtype"]), tuple(int(d) for d in meta["shape"]), f, start + begin, start + end)
            )
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"kvpack: cannot read the safetensors header of {f}: {exc}") from None


def _tensor_sample(fd: int, begin: int, end: int) -> bytes:
    """`SAMPLE_BYTES` at a tensor's start, middle and end (the whole tensor when it is small)."""
    length = end - begin
    if length <= 3 * SAMPLE_BYTES:
        return os.pread(fd, length, begin)
    mid = begin + (length - SAMPLE_BYTES) // 2
    return b"".join(os.pread(fd, SAMPLE_BYTES, at) for at in (begin, mid, end - SAMPLE_BYTES))


def _sample_file(h: Any, f: Path) -> None:
    """A weight file without a header we read: its size and `FILE_SAMPLES` spread samples."""
    size = f.stat().st_size
    h.update(str(size).encode())
    fd = os.open(f, os.O_RDONLY)
    try:
        span = max(0, size - SAMPLE_BYTES)
        for i in range(FILE_SAMPLES):
            h.update(os.pread(fd, SAMPLE_BYTES, span * i // max(1, FILE_SAMPLES - 1)))
    finally:
        os.close(fd)
