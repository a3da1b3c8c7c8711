"""The agent's own node services (`ftrun.services.NodeService`): the node's health before each
rendezvous and while training (`health`, `health_watch`, `gpu_memory`; NVML and InfiniBand are
read through `ftrun.nvml` and `ftrun.infiniband`), the per-cycle info file (`cycle_info`), the
rank monitor's hosting (`monitoring`), the peer channel (`peering`), the workers' compile caches
(`compile_cache`) and their store (`worker_store`). The subsystems' services (checkpoints,
stragglers, ...) live with their code and are handed in by the builder."""
