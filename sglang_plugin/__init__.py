"""kvpack.sglang_plugin: kvpack as an SGLang HiCache storage backend.

    python -m sglang.launch_server --model-path M --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name":"kvpack",
         "module_path":"kvpack.sglang_plugin","class_name":"KVPackStorage",
         "interface_v1":1, "disk":{"path":"/var/cache/kvpack"}}'

Every key besides SGLang's four dynamic-loading keys is kvpack configuration
(`kvpack.KVPackConfig`); none gives the embedded default (memory + disk).
See `kvpack.sglang_plugin.storage` for the contract and ../examples/sglang/.
Importing this package imports SGLang.
"""

from .config import split_extra_config
from .storage import KVPackStorage

__all__ = ["KVPackStorage", "split_extra_config"]
