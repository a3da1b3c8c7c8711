# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
FAULT_REPEATS ?= 3

.PHONY: install test lint demo bench faults clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build.
	$(VPY) -m pip install -q $(TORCH_PIN)
	$(VPY) -m pip install -q -e '.[test,lightning]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples slurm

test: $(STAMP) lint
	$(VPY) -m pytest -q

demo: $(STAMP)
	$(VPY) examples/demo.py

bench: $(STAMP)
	$(VPY) bench/heartbeat.py
	$(VPY) bench/restart.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/compare.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/spares.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/checkpoint.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/restore_floor.py --runs $(or $(BENCH_RUNS),5)
	$(VPY) bench/replication.py --runs $(or $(BENCH_RUNS),3)
	$(VPY) bench/async_global.py --runs $(or $(BENCH_RUNS),3)
	$(VPY) bench/ettr.py --runs $(or $(BENCH_RUNS),1)
	$(VPY) bench/straggler.py
	$(VPY) bench/rendezvous_scale.py --repeats $(or $(BENCH_RUNS),3)

faults: $(STAMP)
	$(VPY) tests/faults/run_matrix.py --repeats $(FAULT_REPEATS)

clean:
	rm -rf $(VENV) build src/*.egg-info
