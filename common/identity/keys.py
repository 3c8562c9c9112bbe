"""Engine-neutral chunk keys.

A chunk key identifies a run of tokens by everything before it: a chained
SHA-256 over the previous chunk's digest plus the chunk's token ids as
little-endian uint32. This is byte-for-byte SGLang's HiCache page hash, so a
vLLM instance and an SGLang instance with the same page size address the same
entries. It is deterministic across processes and machines (never Python's
`hash`).

A chunk key alone is not a storage key: `StoreKey` scopes it by tenant and
layout fingerprint, so one tenant can never address another's entries and a
model with another layout can never hit them.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NewType

import numpy as np

from ..client_input import clip

ChunkHash = NewType("ChunkHash", str)
"""Hex digest (64 lowercase hex chars for kvpack's own chain; engine-given
hashes such as SGLang's page keys are accepted as they are)."""

# Matched with `fullmatch` only: `$` would also match before a final newline.
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MEMBER_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(@[0-9]{1,4}(of[0-9]{1,4})?)?")
_CHUNK_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_CHUNKS_RE = re.compile(r"(?:[A-Za-z0-9_-]{1,128}\n)*")
"""Many chunk hashes joined by newlines (a newline is no chunk character, so each piece is one chunk)."""


def validate_tenant(tenant: str) -> str:
    """Return `tenant` if it is a safe tenant name, else raise ValueError.

    Allowed: 1-64 characters of ``[A-Za-z0-9._-]``, starting with a letter or
    digit. This rules out path traversal (``..``, ``/``), empty names, control
    bytes and unbounded lengths on every tier.
    """
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant) or ".." in tenant:
        raise ValueError(
            f"invalid tenant name {tenant!r}: use 1-64 characters of letters, digits, '.', '_', '-', "
            "starting with a letter or digit, no '..'"
        )
    return tenant


def validate_member(member: str) -> str:
    """Return `member` if it is a valid member name (``kv``, ``draft``, ``kv@0of2``...)."""
    if not isinstance(member, str) or not _MEMBER_RE.fullmatch(member):
        raise ValueError(f"invalid member name {member!r}")
    return member


def member_name(
    base: str,
    shard: int = 0,
    shards: int = 1,
    *,
    group: int = 0,
    stage: int = 0,
    stages: int = 1,
    heads: tuple[int, int] | None = None,
) -> str:
    """The member name of one object of a chunk's group: the one naming rule for every engine.

    ``<base>[_g<group>][_pp<stage>][_h<start>_<stop>][@<shard>of<shards>]``, each part only
    where it applies:

    - `base`: what the object holds: ``kv`` (the target model's KV), ``draft`` (a sidecar
      drafter's KV), an engine pool's own name (SGLang's ``mamba``, ``indexer``...);
    - `group`: the engine's KV cache group (vLLM's hybrid allocator; group 0 has no suffix);
    - `stage` of `stages`: the pipeline stage, for an engine that keys its objects per stage;
    - `heads`: the KV-head range ``[start, stop)`` of a canonical object (`kvpack.identity.heads`;
      None: every head);
    - `shard` of `shards`: the engine rank whose bytes these are (no suffix with one).

    Always a valid member (`validate_member`): a name that would not be one (a pool named with
    other characters, or too long) keeps its suffix and replaces the rest by its first 20
    lowercase letters, digits and ``_`` and an 8-hex digest of it, so two such pools still
    differ."""
    stem = base
    if group:
        stem += f"_g{group}"
    if stages > 1:
        stem += f"_pp{stage}"
    if heads is not None:
        stem += f"_h{heads[0]}_{heads[1]}"
    suffix = f"@{shard}of{shards}" if shards > 1 else ""
    try:
        return validate_member(stem + suffix)
    except ValueError:
        digest = hashlib.sha256(stem.encode()).hexdigest()[:8]
        kept = "".join(c for c in stem if c.isalnum() or c == "_")[:20].lower() or "p"
        return validate_member(f"{kept}_{digest}{suffix}")


def validate_chunk_hash(chunk: str) -> str:
    if not isinstance(chunk, str) or not _CHUNK_RE.fullmatch(chunk):
        raise ValueError(f"invalid chunk hash {clip(chunk)}: expected 1-128 characters of [A-Za-z0-9_-]")
    return chunk


def validate_chunk_hashes(chunks: Sequence[str]) -> None:
    """`validate_chunk_hash` for each of `chunks` (the same ValueError for the first bad one),
    in one match over all of them joined (one regex call per page batch, not per key)."""
    try:
        joined = "\n".join(chunks) + "\n" if chunks else ""
    except TypeError:  # not every chunk is a str: name the first that fails
        joined = None
    if joined is not None and joined.count("\n") == len(chunks) and _CHUNKS_RE.fullmatch(joined):
        return  # as many pieces as chunks: no chunk held a newline
    for chunk in chunks:
        validate_chunk_hash(chunk)


def _tokens_le_u32(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False).tobytes()


def chain_hash(parent: ChunkHash | None, tokens: Sequence[int] | np.ndarray) -> ChunkHash:
    """SHA-256(bytes.fromhex(parent) + tokens as little-endian uint32), hex.

    `parent` is None for the first chunk of a sequence (or a tenant/salt seed
    produced by `seed_hash`).
    """
    hasher = hashlib.sha256()
    if parent:
        hasher.update(bytes.fromhex(parent))
    hasher.update(_tokens_le_u32(tokens))
    return ChunkHash(hasher.hexdigest())


def seed_hash(salt: str) -> ChunkHash:
    """A chain seed from a cache salt (so salted prompts never share keys)."""
    return ChunkHash(hashlib.sha256(b"kvpack-salt\x00" + salt.encode()).hexdigest())


def chunk_hashes(
    tokens: Sequence[int] | np.ndarray, chunk_tokens: int, parent: ChunkHash | None = None
) -> list[ChunkHash]:
    """Chained hashes of every *full* chunk of `tokens` (a trailing partial chunk is ignored)."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be > 0")
    arr = np.asarray(tokens, dtype=np.int64)
    out: list[ChunkHash] = []
    prev = parent
    for start in range(0, len(arr) - chunk_tokens + 1, chunk_tokens):
        prev = chain_hash(prev, arr[start : start + chunk_tokens])
        out.append(prev)
    return out


@dataclass(slots=True)
class ChunkChain:
    """One growing token sequence's chunk hashes (a running request's), each chunk hashed once.

    Invariant: ``hashes[i] == chain_hash(parent(i), tokens of chunk i)`` with ``parent(0)`` the
    `seed` (a request's tenant/salt seed, `RequestScope.seed`; None: unseeded), so `hashes` is
    always a prefix of ``chunk_hashes(tokens, chunk_tokens, parent=seed)``. An adapter that
    follows a request holds one and extends it as the request's tokens grow; it never restates
    the chain."""

    seed: ChunkHash | None
    chunk_tokens: int
    hashes: list[ChunkHash] = field(default_factory=list)

    def extend(self, tokens: Sequence[int], chunks: int) -> list[ChunkHash]:
        """Hash chunks ``len(hashes) .. chunks - 1`` of `tokens` (the whole sequence from its first
        token; only its full chunks are hashed) and return the new hashes (none: already there)."""
        have, size = len(self.hashes), self.chunk_tokens
        if chunks <= have:
            return []
        new = chunk_hashes(list(tokens[have * size : chunks * size]), size, parent=self.parent(have))
        self.hashes.extend(new)
        return new

    def parent(self, chunk: int) -> ChunkHash | None:
        """The hash chunk `chunk` (or a tail starting there) chains from: chunk - 1's, or the seed."""
        return self.hashes[chunk - 1] if chunk else self.seed


_KEY_ROOT = "kvpack"
"""The first field of every key string (`StoreKey.as_str`, `GroupKey.as_str`)."""


def _key_string(*fields: str) -> str:
    """The one flat form of a key: ``kvpack/<field>/<field>...`` (a field never holds ``/``)."""
    return "/".join((_KEY_ROOT, *fields))


def _key_fields(text: str, count: int, what: str) -> list[str]:
    """The `count` fields of `_key_string`'s form, or ValueError naming `what` (text quoted cut)."""
    parts = text.split("/")
    if len(parts) != count + 1 or parts[0] != _KEY_ROOT:
        raise ValueError(f"not a kvpack {what}: {text[:200]!r}")
    return parts[1:]


@dataclass(frozen=True, slots=True)
class StoreKey:
    """The key of one stored object: tenant + layout fingerprint + chunk + member.

    `group` (tenant, fingerprint, chunk) is the unit of visibility and eviction;
    `member` names one object of that group (``kv``, ``draft``, ``kv@1of2``...).
    Every field is validated, so a key can be used as a file name safely.
    """

    tenant: str
    fingerprint: str
    chunk: str
    member: str
    _hash: int = field(init=False, repr=False, compare=False)
    """The fields' tuple hash, taken once when the key is built: a key is hashed about 15
    times a page in a save and a load (the tiers' and the session's dicts and sets), and a
    dataclass's own ``__hash__`` rebuilds and rehashes the tuple each time. Never pickled
    (`__reduce__`): str hashes differ between processes."""

    def __post_init__(self) -> None:
        validate_tenant(self.tenant)
        validate_chunk_hash(self.fingerprint)
        validate_chunk_hash(self.chunk)
        validate_member(self.member)
        object.__setattr__(self, "_hash", hash((self.tenant, self.fingerprint, self.chunk, self.member)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[StoreKey], tuple[str, str, str, str]]:
        return StoreKey, (self.tenant, self.fingerprint, self.chunk, self.member)

    @classmethod
    def batch(cls, tenant: str, fingerprint: str, chunks: Sequence[str], member: str) -> list[StoreKey]:
        """``[StoreKey(tenant, fingerprint, c, member) for c in chunks]``, cheaper.

        Same invariant as the constructor: every returned key is validated. The
        shared fields are validated once and each chunk once (raising the same
        ValueError as the constructor), then the keys are built without running
        `__post_init__` again (slot stores, no validation per key twice: it
        matters at hundreds of pages per engine call)."""
        validate_tenant(tenant)
        validate_chunk_hash(fingerprint)
        validate_member(member)
        validate_chunk_hashes(chunks)
        if cls.__slots__ != ("tenant", "fingerprint", "chunk", "member", "_hash"):  # the stores below set each once
            raise TypeError(f"StoreKey.batch sets tenant, fingerprint, chunk, member, _hash, not {cls.__slots__}")
        new, fields = object.__new__, cls.__dict__
        set_tenant, set_fp, set_chunk, set_member, set_hash = (
            fields[name].__set__ for name in ("tenant", "fingerprint", "chunk", "member", "_hash")
        )
        keys: list[StoreKey] = []
        append = keys.append
        for chunk in chunks:
            key = new(cls)
            set_tenant(key, tenant)
            set_fp(key, fingerprint)
            set_chunk(key, chunk)
            set_member(key, member)
            set_hash(key, hash((tenant, fingerprint, chunk, member)))
            append(key)
        return keys

    @property
    def group(self) -> GroupKey:
        return GroupKey(self.tenant, self.fingerprint, self.chunk)

    def as_str(self) -> str:
        """Flat string form used by flat key-value tiers (Mooncake)."""
        return _key_string(self.tenant, self.fingerprint, self.chunk, self.member)

    @classmethod
    def parse(cls, text: str) -> StoreKey:
        """Inverse of `as_str`; raises ValueError for anything else (each field validated)."""
        return cls(*_key_fields(text, 4, "store key"))


@dataclass(frozen=True, slots=True)
class GroupKey:
    """A logical cache entry: all members stored for one chunk of one tenant and layout."""

    tenant: str
    fingerprint: str
    chunk: str

    def member(self, name: str) -> StoreKey:
        return StoreKey(self.tenant, self.fingerprint, self.chunk, name)

    @classmethod
    def batch(cls, fields: Iterable[Sequence[str]]) -> list[GroupKey]:
        """``[GroupKey(tenant, fingerprint, chunk) for tenant, fingerprint, chunk in fields]``
        with slot stores (a frozen init sets each field through ``object.__setattr__``,
        several times slower; a full memory tier evicts a group per stored page). No field is
        validated, as the constructor validates none; equal and hashed as its keys are."""
        if cls.__slots__ != ("tenant", "fingerprint", "chunk"):  # the stores below set each once
            raise TypeError(f"GroupKey.batch sets tenant, fingerprint, chunk, not {cls.__slots__}")
        new, slots = object.__new__, cls.__dict__
        set_tenant, set_fp, set_chunk = (slots[name].__set__ for name in ("tenant", "fingerprint", "chunk"))
        out: list[GroupKey] = []
        append = out.append
        for tenant, fingerprint, chunk in fields:
            key = new(cls)
            set_tenant(key, tenant)
            set_fp(key, fingerprint)
            set_chunk(key, chunk)
            append(key)
        return out

    def as_str(self) -> str:
        return _key_string(self.tenant, self.fingerprint, self.chunk)

    @classmethod
    def parse(cls, text: str) -> GroupKey:
        """Inverse of `as_str`; raises ValueError for anything else (each field validated)."""
        tenant, fingerprint, chunk = _key_fields(text, 3, "group key")
        return StoreKey(tenant, fingerprint, chunk, "kv").group


TENANT_SIGNATURE_CONTEXT = b"kvpack-tenant\x00"


def tenant_signature(key: bytes, tenant: str) -> str:
    """Hex HMAC-SHA256 of `tenant` under `key` (domain-separated).

    What a trusted front end sends as ``kvpack_tenant_sig`` beside
    ``kvpack_tenant`` when kvpack is configured with ``tenant_signing_key``:
    a client that does not hold the key cannot name a tenant."""
    return hmac.new(key, TENANT_SIGNATURE_CONTEXT + tenant.encode(), hashlib.sha256).hexdigest()


def tenant_signature_ok(key: bytes, tenant: str, signature: object) -> bool:
    """True when `signature` is `tenant_signature(key, tenant)` (constant-time compare)."""
    if not isinstance(signature, str) or not key:
        return False
    return hmac.compare_digest(tenant_signature(key, tenant), signature.strip().lower())
