python -m sglang.launch_server --model-path "${MODEL:?set MODEL}" --enable-hierarchical-cache --hicache-mem-layout page_first --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name":"kvpack","module_path":"kvpack.sglang_plugin","class_name":"KVPackStorage","interface_v1":1,"tenant":"team-a","memory":{"capacity":"8GiB"},"disk":{"path":"/var/cache/kvpack","capacity":"200GiB"},"eviction":{"policy":"arc"},"draft_policy":"recompute"}'
# ^ memory + a chosen disk folder; several SGLang (or vLLM) instances on this
#   host may share /var/cache/kvpack: pages one writes, the others find.
#   Entries are scoped by tenant and by the layout fingerprint (model, dtype,
#   page size, host layout, TP/PP), so another model or layout never hits them.
