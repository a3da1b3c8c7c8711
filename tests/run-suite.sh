#!/usr/bin/env bash
# The whole suite as `make test` runs it, in three parts:
#
#   1. the Slurm tests, one pytest session in the background: one cluster per host, and a job
#      there is mostly the scheduler's waiting, not CPU;
#   2. meanwhile everything else but the `alone` tests, on two xdist workers (work stealing: a
#      long job test at the end no longer leaves the other worker idle);
#   3. once both are done, the `alone` tests, each with the machine to itself (which node judges
#      a hang first is a matter of tens of milliseconds).
#
# The Slurm session's output is kept in a file and printed when it ends, after part 2's, so the
# two do not interleave. Exit status: non-zero if any part failed (pytest's 5, "no tests
# collected", counts as a pass for a part, e.g. a run narrowed with PYTEST_ADDOPTS).
#
#   bash tests/run-suite.sh .venv/bin/python
set -uo pipefail

python=${1:?usage: run-suite.sh PYTHON}
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/ftrun-suite.XXXXXX)
slurm_log=$work/slurm.log

passed() { [[ $1 -eq 0 || $1 -eq 5 ]]; }

"$python" -m pytest -q -m slurm --basetemp="$work/slurm" -p no:cacheprovider \
  >"$slurm_log" 2>&1 &
slurm_pid=$!
# A stopped make (Ctrl-C, CI's timeout) takes the background session with it; its fixtures then
# bring the cluster down.
trap 'kill -INT "$slurm_pid" 2>/dev/null; wait "$slurm_pid"; exit 130' INT TERM

"$python" -m pytest -q -n 2 --dist worksteal -m "not slurm and not alone"
parallel=$?

wait "$slurm_pid"
slurm=$?
trap - INT TERM
echo "--- the Slurm tests (run beside the above) ---"
cat "$slurm_log"

"$python" -m pytest -q -m "alone and not slurm" -p no:cacheprovider
alone=$?
rm -rf "$work"

status=0
for part in "parallel:$parallel" "slurm:$slurm" "alone:$alone"; do
  if ! passed "${part#*:}"; then
    echo "run-suite.sh: the ${part%%:*} part failed (pytest exit ${part#*:})" >&2
    status=1
  fi
done
exit $status
