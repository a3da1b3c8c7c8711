"""Where each local rank runs: its NUMA node and CPUs, decided once per launch from NVML and
the machine's topology (`numa`), applied by each worker to itself (`binding`).

This package's import stays empty: a worker forked by the fork server imports `binding`, and
whatever this file imported would come with it."""
