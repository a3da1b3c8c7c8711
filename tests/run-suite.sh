#!/usr/bin/env bash
# The whole suite as `make test` runs it, in three parts, one after the other:
#
#   1. everything but the Slurm and `alone` tests, on two xdist workers (work stealing: a long
#      job test at the end no longer leaves the other worker idle);
#   2. the Slurm tests, one pytest session: one cluster per host;
#   3. the `alone` tests, each with the machine to itself (which node judges a hang first is a
#      matter of tens of milliseconds).
#
# Running part 2 beside part 1 saved about a minute and a half on this VM's 2 cores, but the
# load it added made timing-bound tests of both flaky: the suite is CPU-bound (about 16 CPU
# minutes), so it runs them in turn. Exit status: non-zero if any part failed (pytest's 5,
# "no tests collected", counts as a pass for a part, e.g. a run narrowed with PYTEST_ADDOPTS).
#
#   bash tests/run-suite.sh .venv/bin/python
set -uo pipefail

python=${1:?usage: run-suite.sh PYTHON}
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/ftrun-suite.XXXXXX)

passed() { [[ $1 -eq 0 || $1 -eq 5 ]]; }

"$python" -m pytest -q -n 2 --dist worksteal -m "not slurm and not alone"
parallel=$?

"$python" -m pytest -q -m slurm --basetemp="$work/slurm" -p no:cacheprovider
slurm=$?

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
