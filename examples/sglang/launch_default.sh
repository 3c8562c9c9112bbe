python -m sglang.launch_server --model-path "${MODEL:?set MODEL}" --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name":"kvpack","module_path":"kvpack.sglang_plugin","class_name":"KVPackStorage","interface_v1":1}'
# ^ kvpack's embedded default: host-memory tier (4 GiB) + local-disk tier
#   ($XDG_CACHE_HOME/kvpack/store, 32 GiB), tenant "default".
#
# Every key besides backend_name/module_path/class_name/interface_v1 is kvpack
# configuration (kvpack.KVPackConfig); a wrong key or value stops start-up with
# an error naming the field. "interface_v1":1 selects SGLang's zero-copy path
# (without it SGLang uses its slower generic page path, which kvpack also serves).
# Speculative decoding (EAGLE draft sidecars, MTP packed layers) needs nothing
# extra: the draft pool becomes a member of the same kvpack group, and a page
# whose draft state is missing is not reported as a hit (draft_policy "recompute").
