"""Where each local rank runs: its NUMA node and CPUs, decided once per launch from NVML and
the machine's topology (`numa`), applied by each worker to itself (`binding`); and the GPU
each rank sees, with its `LOCAL_RANK` (`rank_env`, as torchrun sets them).

This package's import stays empty: a worker forked by the fork server imports `binding`, and
whatever this file imported would come with it."""
