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
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples

test: $(STAMP) lint
	$(VPY) -m pytest -q

demo: $(STAMP)
	$(VPY) examples/demo.py

bench: $(STAMP)
	$(VPY) bench/heartbeat.py

faults: $(STAMP)
	$(VPY) -m pytest -q tests/faults --count-repeats=$(FAULT_REPEATS)

clean:
	rm -rf $(VENV) build src/*.egg-info
