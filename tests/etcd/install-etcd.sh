#!/usr/bin/env bash
# Install Debian's etcd-server (3.4) for the etcd store tests (tests/test_etcd_store.py,
# tests/test_etcd_jobs.py, the fault matrix on etcd), through tests/apt-install.sh. Does
# nothing when an etcd binary is there already: the tests look for FTRUN_ETCD, then `etcd` on
# PATH, then /usr/bin/etcd. Never fails the build (the tests then skip, saying why).
#
#   bash tests/etcd/install-etcd.sh
set -uo pipefail

for bin in "${FTRUN_ETCD:-}" "$(command -v etcd 2>/dev/null)"; do
  [[ -n $bin && -x $bin ]] && exit 0
done
exec bash "$(dirname "$0")/../apt-install.sh" etcd /usr/bin/etcd etcd-server
