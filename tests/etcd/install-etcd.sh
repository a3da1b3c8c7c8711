#!/usr/bin/env bash
# Install Debian's etcd-server (3.4) for the etcd store tests (tests/test_etcd_store.py,
# tests/test_etcd_jobs.py), as slurm/dev-cluster/up.sh installs slurm: apt-get, quiet, the
# log's tail on failure. Idempotent: when an etcd binary is there already it does nothing.
#
#   bash tests/etcd/install-etcd.sh
#
# Never fails the build: when it cannot install (not root, no apt-get, apt-get failed) it prints
# one line saying why and exits 0; the tests then skip with their own reason (no etcd found).
# The tests look for FTRUN_ETCD, then `etcd` on PATH, then /usr/bin/etcd.
set -uo pipefail

log() { printf 'install-etcd.sh: %s\n' "$*" >&2; }
give_up() { log "etcd not installed: $* (the etcd tests will skip)"; exit 0; }

for bin in "${FTRUN_ETCD:-}" "$(command -v etcd 2>/dev/null)" /usr/bin/etcd; do
  [[ -n $bin && -x $bin ]] && exit 0
done

[[ $(id -u) -eq 0 ]] || give_up "not root (apt-get needs root)"
command -v apt-get >/dev/null || give_up "no apt-get on this machine"

log "installing etcd-server with apt-get"
start_s=$SECONDS
apt_log=/tmp/ftrun-etcd-apt.$$.log
# The package's postinst would start a system etcd on 2379; a policy-rc.d that answers 101
# forbids that (Docker images usually ship one already).
policy=/usr/sbin/policy-rc.d
added_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added_policy=1
fi
rc=0
{
  apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server
} >"$apt_log" 2>&1 || rc=$?
((added_policy)) && rm -f "$policy"
if ((rc)); then
  tail -n 20 "$apt_log" >&2
  rm -f "$apt_log"
  give_up "apt-get could not install etcd-server (exit $rc)"
fi
rm -f "$apt_log"
[[ -x /usr/bin/etcd ]] || give_up "/usr/bin/etcd still missing after apt-get"
log "installed in $((SECONDS - start_s))s"
