"""Split SGLang's ``--hicache-storage-backend-extra-config`` into SGLang's keys and kvpack's.

SGLang hands the dynamic backend the whole extra-config dict. It has already
removed the keys it consumes itself (``prefetch_threshold``,
``prefetch_timeout_*``, ``hicache_storage_pass_prefix_keys``, ``tp_lcm_size``);
what is left are the dynamic-loading keys below plus kvpack's own
configuration, which is parsed strictly: an unknown key or a bad value raises
`kvpack.ConfigError` naming the field, at backend construction (server
start-up), never on the data path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import ConfigError, KVPackConfig

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        # Consumed by SGLang before the backend is built; tolerated if a
        # caller passes the dict through unchanged.
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
"""Keys of the extra config that belong to SGLang, not to kvpack."""


def split_extra_config(extra: Mapping[str, Any] | None) -> tuple[KVPackConfig, dict[str, Any]]:
    """(kvpack config, SGLang's own keys) from SGLang's extra config.

    With no kvpack keys the result is kvpack's embedded default (memory and
    disk tiers). Raises ConfigError naming the offending field.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError("<extra_config>", f"expected a JSON object, got {type(extra).__name__}")
    engine = {k: v for k, v in extra.items() if k in SGLANG_KEYS}
    ours = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
    return KVPackConfig.from_dict(ours), engine
