# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
FAULT_REPEATS ?= 3

.PHONY: install test check lint demo bench bench-more bench-gpu faults clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build.
	$(VPY) -m pip install -q $(TORCH_PIN)
	$(VPY) -m pip install -q -e '.[test,lightning,etcd]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples slurm

# tests/run-suite.sh: the Slurm tests in the background (one cluster per host; its jobs are
# mostly the scheduler's waiting), everything else meanwhile on two xdist workers, then the
# tests marked `alone` (an outcome that rests on tens of milliseconds between nodes).
test: $(STAMP) lint
	bash tests/browser/install-chromium.sh
	bash tests/etcd/install-etcd.sh
	bash tests/run-suite.sh $(VPY)

# The suite without whole-job process tests, the Slurm cluster and the fault matrix: < 90 s.
check: $(STAMP) lint
	$(VPY) -m pytest -q -n 2 -m "not process and not slurm and not faults"

demo: $(STAMP)
	$(VPY) examples/demo.py

# bench/README.md says which question each bench answers, where its results are and on what
# machine. `bench`: the CPU benches of this VM's tables; `bench-more`: the rest that runs here
# (NVRX_EXAMPLES: NVRx's examples/ folder); `bench-gpu`: on the GPU device (`. bench/device_setup.sh`).
bench: $(STAMP)
	$(VPY) bench/monitor/heartbeat.py
	$(VPY) bench/restart/compare.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/restart/spares.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/checkpoint/checkpoint.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/checkpoint/restore_floor.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/checkpoint/replication.py --runs $(or $(BENCH_RUNS),3)
	$(VPY) bench/checkpoint/async_global.py --runs $(or $(BENCH_RUNS),3)
	$(VPY) bench/checkpoint/ettr.py --runs $(or $(BENCH_RUNS),1)
	$(VPY) bench/monitor/straggler.py
	$(VPY) bench/rendezvous/rendezvous_scale.py --repeats $(or $(BENCH_RUNS),3)

bench-more: $(STAMP)
	$(VPY) bench/restart/forkserver.py
	$(VPY) bench/checkpoint/peer_throughput.py
	$(VPY) bench/monitor/lightning_overhead.py
	$(VPY) bench/monitor/rerun.py
	$(VPY) bench/monitor/live_view.py
	$(VPY) bench/compat/nvrx_examples.py --set cpu --skip-basic --examples $(or $(NVRX_EXAMPLES),.nvrx/examples)

bench-gpu:
	python3 bench/restart/gpu_compare.py --runs $(or $(BENCH_RUNS),3)
	python3 bench/checkpoint/checkpoint_gpu.py
	python3 bench/monitor/straggler_gpu.py
	python3 bench/monitor/health_watch.py
	python3 bench/monitor/flight_recorder.py
	python3 bench/placement/numa_check.py
	python3 bench/monitor/live_view.py --parts scrape page
	python3 bench/monitor/live_view.py --parts steps --device cuda --nproc 1 --width 8192 --steps 1500 --pairs 5
	python3 bench/compat/nvrx_examples.py --set cuda --examples $(or $(NVRX_EXAMPLES),.nvrx/examples)

faults: $(STAMP)
	$(VPY) tests/faults/run_matrix.py --repeats $(FAULT_REPEATS)

clean:
	rm -rf $(VENV) build src/*.egg-info
