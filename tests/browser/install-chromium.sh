#!/usr/bin/env bash
# Install Debian's chromium for tests/test_status_browser.py (the status page in a real,
# headless browser), as slurm/dev-cluster/up.sh installs slurm: apt-get, quiet, the log's tail
# on failure. Idempotent: when a chromium binary is there already it does nothing (fast).
#
#   bash tests/browser/install-chromium.sh
#
# Never fails the build: when it cannot install (not root, no apt-get, apt-get failed) it prints
# one line saying why and exits 0; the test then skips with its own reason (no chromium found).
# The test looks for FTRUN_CHROMIUM, then /usr/bin/chromium, then /usr/bin/chromium-browser.
set -uo pipefail

log() { printf 'install-chromium.sh: %s\n' "$*" >&2; }
give_up() { log "chromium not installed: $* (the browser test will skip)"; exit 0; }

for bin in "${FTRUN_CHROMIUM:-}" /usr/bin/chromium /usr/bin/chromium-browser; do
  [[ -n $bin && -x $bin ]] && exit 0
done

[[ $(id -u) -eq 0 ]] || give_up "not root (apt-get needs root)"
command -v apt-get >/dev/null || give_up "no apt-get on this machine"

log "installing chromium with apt-get"
start_s=$SECONDS
apt_log=/tmp/ftrun-chromium-apt.$$.log
rc=0
{
  apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium fonts-dejavu-core
} >"$apt_log" 2>&1 || rc=$?
if ((rc)); then
  tail -n 20 "$apt_log" >&2
  rm -f "$apt_log"
  give_up "apt-get could not install chromium (exit $rc)"
fi
rm -f "$apt_log"
[[ -x /usr/bin/chromium ]] || give_up "/usr/bin/chromium still missing after apt-get"
log "installed in $((SECONDS - start_s))s"
