#!/usr/bin/env bash
# The whole suite as `make test` runs it, in two parts at once:
#
#   1. everything but the Slurm tests, on three xdist workers on the VM's two cores (a job test
#      spends much of its time waiting on a deadline; a third worker fills that time; work
#      stealing: a long job test at the end no longer leaves the others idle);
#   2. the Slurm tests, one pytest session beside it (one cluster per host). Most of their time
#      is Slurm's own: scheduling, requeues, the relaunch chain, while part 1's jobs wait on
#      heartbeat deadlines; each part fills the other's idle time. Job tests that mostly wait
#      (`beside_slurm`: a real Prometheus's `for:` windows) run here too: part 2 ends well
#      before part 1.
#
# No test asserts a duration (speed lives in bench/ and `make faults`), so the load each part
# adds to the other changes how long they take, not their outcome. Part 2's output is printed
# after part 1's. Exit status: non-zero if either part failed (pytest's 5, "no tests
# collected", counts as a pass for a part, e.g. a run narrowed with PYTEST_ADDOPTS).
#
#   bash tests/run-suite.sh .venv/bin/python
set -uo pipefail

python=${1:?usage: run-suite.sh PYTHON}
# A machine that sets PYTHONDONTWRITEBYTECODE=1 (this VM and CI do) has every pytest session
# rewrite and compile each test module again, and every launcher compile the ftrun modules it
# imports (3.5 CPU-s a pytest session, about 0.1 s a launcher). The venv is compiled by `make
# install`; the tree's own bytecode goes to its __pycache__ directories (git ignores them).
unset PYTHONDONTWRITEBYTECODE
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/ftrun-suite.XXXXXX)
trap 'kill "${slurm_pid:-}" 2>/dev/null; rm -rf "$work"' EXIT

passed() { [[ $1 -eq 0 || $1 -eq 5 ]]; }

"$python" -m pytest -q -m "slurm or beside_slurm" --basetemp="$work/slurm" -p no:cacheprovider \
  >"$work/slurm.log" 2>&1 &
slurm_pid=$!

"$python" -m pytest -q -n 3 --dist worksteal -m "not slurm and not beside_slurm"
parallel=$?

wait "$slurm_pid"
slurm=$?
echo "---- the Slurm part ----"
cat "$work/slurm.log"

status=0
for part in "parallel:$parallel" "slurm:$slurm"; do
  if ! passed "${part#*:}"; then
    echo "run-suite.sh: the ${part%%:*} part failed (pytest exit ${part#*:})" >&2
    status=1
  fi
done
exit $status
