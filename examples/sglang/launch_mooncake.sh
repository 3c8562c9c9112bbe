python -m sglang.launch_server --model-path "${MODEL:?set MODEL}" --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name":"kvpack","module_path":"kvpack.sglang_plugin","class_name":"KVPackStorage","interface_v1":1,"tenant":"team-a","memory":{"capacity":"4GiB"},"disk":{"enabled":false},"mooncake":{"enabled":true,"master_server_address":"127.0.0.1:50051","metadata_server":"P2PHANDSHAKE","protocol":"tcp","tenant_id":"team-a","global_segment_size":"4GiB"}}'
# ^ memory + a Mooncake cluster shared with other SGLang and vLLM instances.
#   Start the master first, e.g.:
#     mooncake_master --rpc_address=127.0.0.1 --rpc_port=50051 --logtostderr
#   (with --enable_multi_tenants=true and a quota file, Mooncake enforces
#   tenant_id namespaces too). Every Mooncake call is bounded (mooncake.timeout_ms);
#   a down master degrades to recompute with a warning, never a hung step.
