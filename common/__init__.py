"""kvpack: one correct, fast, multi-tenant KV-cache reuse layer for vLLM and SGLang.

The engine-neutral core. It never imports vllm or sglang; the adapters
(`kvpack.vllm_plugin`, `kvpack.sglang_plugin`) translate engine calls into
the types below.

    from kvpack import KVPackConfig, KVStore
    store = KVStore.from_config(KVPackConfig.from_dict({"disk": {"path": "/tmp/kv"}}))
"""

from .config import ChecksumPolicy, DraftPolicy, KVPackConfig
from .errors import ConfigError, KVPackError, LayoutError
from .groups import DraftPlacement, GroupLookup, MemberRole, MemberSpec
from .keys import ChunkHash, GroupKey, StoreKey, chain_hash, chunk_hashes
from .layout import KVLayoutSpec
from .metrics import Metrics
from .objects import Expectation, ObjectHeader, RejectReason
from .store import KVStore, LoadItem, TailMatch, tail_chunk
from .tiers.base import GetResult, PutItem, TierStatus

__version__ = "0.1.0"

__all__ = [
    "ChecksumPolicy",
    "ChunkHash",
    "ConfigError",
    "DraftPlacement",
    "DraftPolicy",
    "Expectation",
    "GetResult",
    "GroupKey",
    "GroupLookup",
    "KVLayoutSpec",
    "KVPackConfig",
    "KVPackError",
    "KVStore",
    "LayoutError",
    "LoadItem",
    "MemberRole",
    "MemberSpec",
    "Metrics",
    "ObjectHeader",
    "PutItem",
    "RejectReason",
    "StoreKey",
    "TailMatch",
    "TierStatus",
    "chain_hash",
    "chunk_hashes",
    "tail_chunk",
]
