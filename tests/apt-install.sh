#!/usr/bin/env bash
# Install Debian packages a test needs (and the dev cluster's slurm-wlm and munge, for up.sh):
# quiet, the log's tail on failure, no service started by a package's postinst.
#
#   bash tests/apt-install.sh WHAT BINARY PACKAGE...
#
# Idempotent: nothing happens when BINARY (a path, or a command on PATH) is there already.
# Never fails the build: when it cannot install (not root, no apt-get, apt-get failed) it prints
# one line saying why and exits 0; the tests then skip with their own reason (up.sh checks its
# commands again). Used by tests/browser/install-chromium.sh, tests/etcd/install-etcd.sh and
# slurm/dev-cluster/up.sh.
set -uo pipefail

what=$1 binary=$2
shift 2
log() { printf 'apt-install.sh: %s\n' "$*" >&2; }
give_up() { log "$what not installed: $* (its tests will skip)"; exit 0; }

present() { if [[ $binary == */* ]]; then [[ -x $binary ]]; else command -v "$binary" >/dev/null; fi; }

present && exit 0
[[ $(id -u) -eq 0 ]] || give_up "not root (apt-get needs root)"
command -v apt-get >/dev/null || give_up "no apt-get on this machine"

log "installing $* with apt-get"
start_s=$SECONDS
apt_log=/tmp/ftrun-apt.$$.log
# A package's postinst would start its service (etcd on 2379, slurmd, munged); a policy-rc.d
# that answers 101
# forbids that (Docker images usually ship one already).
policy=/usr/sbin/policy-rc.d
added_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added_policy=1
fi
rc=0
{
  apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
} >"$apt_log" 2>&1 || rc=$?
((added_policy)) && rm -f "$policy"
if ((rc)); then
  tail -n 20 "$apt_log" >&2
  rm -f "$apt_log"
  give_up "apt-get could not install $* (exit $rc)"
fi
rm -f "$apt_log"
present || give_up "$binary still missing after apt-get"
log "installed in $((SECONDS - start_s))s"
