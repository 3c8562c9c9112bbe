"""Layout fingerprints: what a stored object must match before it is loaded.

Two digests come from one `KVLayoutSpec`:

- `group_fingerprint` scopes keys. It covers what every member of a group
  shares (engine, model, dtype, tokens per chunk, parallel sizes, the kvpack
  format), so every TP/PP shard and the draft of one chunk land in one group.
- `member_fingerprint` goes into each object's header. It adds what is
  specific to one member (its rank, its layer set, its per-layer shape), so a
  shard restored on the wrong rank, or draft state of another draft model, is
  a miss with reason FINGERPRINT, never a load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from .objects import FORMAT_VERSION


@dataclass(frozen=True)
class KVLayoutSpec:
    """Everything that must agree between a writer and a reader of one member.

    Attributes:
        engine: engine and its memory layout family, e.g. ``"vllm:cpu"``,
            ``"sglang:page_first"``.
        model: model identity (name or path as the engine names it).
        dtype: KV cache dtype as a string (``"bfloat16"``, ``"fp8_e4m3"``).
        chunk_tokens: tokens per chunk (the engine's block / page size).
        tp_size, pp_size: parallel sizes (shared by the group).
        tp_rank, pp_rank: this member's position (member-only).
        layer_names: layers this member holds, in copy order (member-only).
        layer_shape: per-layer shape of one block/page (member-only), e.g.
            ``(kv_heads, block_size, 2 * head_size)``.
        extra: engine-specific facts that must match (MLA, is_storage_writer...).
    """

    engine: str
    model: str
    dtype: str
    chunk_tokens: int
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    layer_names: tuple[str, ...] = ()
    layer_shape: tuple[int, ...] = ()
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def _digest(self, payload: dict[str, object]) -> str:
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def group_fingerprint(self) -> str:
        """32 hex chars; shared by every member of a group."""
        return self._digest(
            {
                "format": FORMAT_VERSION,
                "engine": self.engine,
                "model": self.model,
                "dtype": self.dtype,
                "chunk_tokens": self.chunk_tokens,
                "tp_size": self.tp_size,
                "pp_size": self.pp_size,
            }
        )

    def describe(self, model_name: str = "") -> str:
        """What `group_fingerprint` covers, for people (``kvpack usage``): the engine's name for the
        model (`model_name`, a path or hub name), its identity, engine, dtype, tokens per chunk and
        parallel sizes."""
        base, _, weights = self.model.partition("|weights=")
        ident = base if len(base) <= 48 else base[:45] + "..."
        if weights:  # changed in place since start-up (`kvpack.with_weights`)
            ident += f" weights={weights[:24]}"
        head = f"{model_name} [{ident}]" if model_name and model_name != self.model else ident
        return (
            f"{head} ({self.engine}, {self.dtype}, {self.chunk_tokens} tokens/chunk, tp{self.tp_size} pp{self.pp_size})"
        )

    @property
    def member_fingerprint(self) -> str:
        """32 hex chars; identifies this member's exact layout."""
        return self._digest({"group": self.group_fingerprint, **asdict(self)})
