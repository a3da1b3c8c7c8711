# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
FAULT_REPEATS ?= 3
COMPILED_EARLY := torch sympy networkx mpmath

.PHONY: install test check lint demo bench bench-more bench-smoke bench-gpu faults fuzz clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build.
	$(VPY) -m pip install -q --no-compile $(TORCH_PIN)
	# Byte-compiled on every core, not by pip one file at a time (PYTHONDONTWRITEBYTECODE=1 would
	# leave every process compiling torch again): torch and the big packages only it needs while
	# pip installs the rest (pip keeps one core busy and never touches them again), then what is
	# left. A few of torch's test helpers are for newer Pythons and fail to compile: harmless,
	# hence the '-' and the background compile's status left unread.
	$(VPY) -m compileall -q -j 0 $(patsubst %,$(VENV)/lib/python3*/site-packages/%,$(COMPILED_EARLY)) >/dev/null 2>&1 & \
	  $(VPY) -m pip install -q --no-compile -e '.[test,lightning,etcd]'; \
	  status=$$?; wait; exit $$status
	-$(VPY) -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples slurm

# tests/run-suite.sh: everything but the Slurm tests on three xdist workers, and beside them the
# Slurm tests (one cluster per host).
test: $(STAMP) lint
	bash tests/browser/install-chromium.sh
	bash tests/etcd/install-etcd.sh
	bash tests/prometheus/install-prometheus.sh
	bash tests/run-suite.sh $(VPY)

# The suite without whole-job process tests, the Slurm cluster and the fault matrix: < 90 s.
check: $(STAMP) lint
	$(VPY) -m pytest -q -n 2 -m "not process and not slurm and not faults"

demo: $(STAMP)
	$(VPY) examples/demo.py

# bench/README.md says which question each bench answers, where its results are and on what
# machine. `bench`: the CPU benches of this VM's tables; `bench-more`: the rest that runs here
# (NVRX_EXAMPLES: NVRx's examples/ folder); `bench-gpu`: on the GPU device (`. bench/device_setup.sh`).
# Each is a module run from the repository root (`python -m bench.<folder>.<script>`).
# `bench-smoke`: every bench at its `--smoke` size, the ones `make test` leaves out for time too.
bench: $(STAMP)
	$(VPY) -m bench.monitor.heartbeat
	$(VPY) -m bench.restart.compare --runs $(or $(BENCH_RUNS),5)
	$(VPY) -m bench.restart.spares --runs $(or $(BENCH_RUNS),5)
	$(VPY) -m bench.checkpoint.checkpoint --runs $(or $(BENCH_RUNS),5)
	$(VPY) -m bench.checkpoint.restore_floor --runs $(or $(BENCH_RUNS),5)
	$(VPY) -m bench.checkpoint.replication --runs $(or $(BENCH_RUNS),3)
	$(VPY) -m bench.checkpoint.async_global --runs $(or $(BENCH_RUNS),3)
	$(VPY) -m bench.checkpoint.ettr --runs $(or $(BENCH_RUNS),1)
	$(VPY) -m bench.monitor.straggler
	$(VPY) -m bench.rendezvous.rendezvous_scale --repeats $(or $(BENCH_RUNS),3)

bench-more: $(STAMP)
	$(VPY) -m bench.restart.forkserver
	$(VPY) -m bench.checkpoint.peer_throughput
	$(VPY) -m bench.monitor.lightning_overhead
	$(VPY) -m bench.monitor.rerun
	$(VPY) -m bench.monitor.live_view
	$(VPY) -m bench.compat.nvrx_examples --set cpu --skip-basic --examples $(or $(NVRX_EXAMPLES),.nvrx/examples)

bench-smoke: $(STAMP)
	FTRUN_BENCH_SMOKE=all $(VPY) -m pytest -q -n 0 tests/test_bench_smoke.py

# The GPUs present pick the layouts (`python3 -m bench.common.layouts`: 1; 2, 2x1; 4, 2x2).
bench-gpu:
	LAYOUTS=$$(python3 -m bench.common.layouts); \
	python3 -m bench.restart.gpu_compare --layouts $$LAYOUTS --runs $(or $(BENCH_RUNS),3) && \
	case ",$$LAYOUTS," in *,4,*) python3 -m bench.restart.inprocess_compare --nproc 4 \
	    --runs $(or $(BENCH_RUNS),3);; esac
	python3 -m bench.restart.inprocess_compare --nproc 1 --cases raise:plain,raise:compile --runs $(or $(BENCH_RUNS),3)
	python3 -m bench.restart.nccl_abort
	python3 -m bench.restart.cuda_standby_probe --guard
	python3 -m bench.restart.cuda_standby_probe --ranks 1,$$(nvidia-smi -L | wc -l)
	python3 -m bench.checkpoint.checkpoint_gpu
	python3 -m bench.monitor.straggler_gpu
	python3 -m bench.monitor.health_watch
	python3 -m bench.monitor.flight_recorder
	python3 -m bench.placement.numa_check
	python3 -m bench.monitor.live_view --parts scrape page
	python3 -m bench.monitor.live_view --parts steps --device cuda --nproc 1 --width 8192 --steps 1500 --pairs 5
	python3 -m bench.compat.nvrx_examples --set cuda --examples $(or $(NVRX_EXAMPLES),.nvrx/examples)

faults: $(STAMP)
	$(VPY) tests/faults/run_matrix.py --repeats $(FAULT_REPEATS)

# Every boundary's decoder fed FUZZ_EXAMPLES corrupted inputs (tests/fuzz; `make test` runs 300
# each); the table of inputs tried a target goes to bench/RESULTS.md by hand.
fuzz: $(STAMP)
	rm -f bench/out/fuzz.jsonl; mkdir -p bench/out
	FTRUN_FUZZ_EXAMPLES=$(or $(FUZZ_EXAMPLES),100000) FTRUN_FUZZ_REPORT=bench/out/fuzz.jsonl \
	  $(VPY) -m pytest -q -n 2 -p no:cacheprovider tests/fuzz; status=$$?; \
	  $(VPY) -m bench.common.fuzz_table bench/out/fuzz.jsonl; exit $$status

clean:
	rm -rf $(VENV) build src/*.egg-info
