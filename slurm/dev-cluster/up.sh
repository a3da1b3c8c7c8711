#!/usr/bin/env bash
# Bring up the ftrun dev Slurm cluster on this machine: a private munged, one slurmctld and
# three slurmd (n1..n3, all on 127.0.0.1, `slurmd -N nX`). Idempotent: daemons already
# running from this state dir (per their pid files) are left alone, the rest are started.
#
#   eval "$(slurm/dev-cluster/up.sh)"    # exports FTRUN_SLURM_STATE and SLURM_CONF
#
# stdout carries only eval-able lines; progress and diagnostics go to stderr.
# Exit status 77 means "cannot run here" (not root, or slurm/munge cannot be installed):
# the test fixture turns it into a skip. Needs root: daemons run as root, /etc/hosts edit.
# Environment: FTRUN_SLURM_STATE (state dir, default /tmp/ftrun-slurm),
# FTRUN_SLURM_CTLD_PORT (6817), FTRUN_SLURM_NODE_PORT (first slurmd port, 17001),
# FTRUN_SLURM_NODE_CPUS (4), FTRUN_SLURM_CRED_EXPIRE (10), FTRUN_SLURM_UP_TIMEOUT (60).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
state=${FTRUN_SLURM_STATE:-/tmp/ftrun-slurm}
ctld_port=${FTRUN_SLURM_CTLD_PORT:-6817}
node_port=${FTRUN_SLURM_NODE_PORT:-17001}
node_cpus=${FTRUN_SLURM_NODE_CPUS:-4}
cred_expire=${FTRUN_SLURM_CRED_EXPIRE:-10}
timeout=${FTRUN_SLURM_UP_TIMEOUT:-60}
nodes=(n1 n2 n3)
conf=$state/slurm.conf
start_s=$SECONDS

log() { printf 'up.sh: %s\n' "$*" >&2; }
skip() { log "SKIP: $*"; exit 77; }
die() { log "ERROR: $*"; exit 1; }

# Show the end of the daemon logs when something fails, so a CI log says why.
dump_logs() {
  local f
  for f in "$state"/log/*.log "$state"/munge/munged.log; do
    [[ -s $f ]] || continue
    printf '\n==> %s (last 20 lines) <==\n' "$f" >&2
    tail -n 20 "$f" >&2
  done
}

# A pid file counts only if its process is alive, not a zombie (a subreaper such as pytest
# may hold exited daemons unreaped), and is the expected program (pids get reused).
pid_alive() { # pidfile comm
  local pid st
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
  st=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$pid/status" 2>/dev/null)
  [[ -n $st && $st != Z && $st != X ]]
}

# Poll `cmd` every 0.2 s until it succeeds or `secs` pass.
wait_until() { # secs what cmd...
  local secs=$1 what=$2 deadline
  shift 2
  deadline=$((SECONDS + secs))
  until "$@"; do
    ((SECONDS < deadline)) || { log "timed out after ${secs}s waiting for $what"; return 1; }
    sleep 0.2
  done
}

[[ $(id -u) -eq 0 ]] || skip "must run as root (daemons run as root, /etc/hosts is edited)"
[[ $state == /* && $state != *[[:space:]\|\&]* ]] ||
  die "FTRUN_SLURM_STATE must be an absolute path without spaces, '|' or '&': $state"

# --- 1. packages: Debian's slurm-wlm 22.05 (built with multiple-slurmd support) and munge.
need=(slurmctld slurmd sbatch srun squeue scontrol sinfo scancel munged munge unmunge)
missing=""
for c in "${need[@]}"; do command -v "$c" >/dev/null || { missing=$c && break; }; done
if [[ -n $missing ]]; then
  # tests/apt-install.sh: quiet apt-get, no service started by a postinst; it exits 0 when it
  # cannot install, and the check below turns what is still missing into a skip.
  bash "$here/../../tests/apt-install.sh" "slurm-wlm and munge" "$missing" slurm-wlm munge
  for c in "${need[@]}"; do command -v "$c" >/dev/null || skip "$c still missing after install"; done
fi

# --- 2. state dir and generated config.
mkdir -p "$state"/{ctld,log,run,munge} "${nodes[@]/#/$state/spool/}"
# One up.sh/down.sh at a time per state dir (e.g. two pytest sessions starting at once).
# Fd 9 holds the lock; daemons are started with it closed, or they would hold it forever.
exec 9>"$state/.lock"
flock -w 120 9 || die "another up.sh/down.sh holds $state/.lock"
chmod 700 "$state/munge" # munged refuses a socket/key dir others can write to
sed -e "s|@STATE_DIR@|$state|g" -e "s|@CTLD_PORT@|$ctld_port|g" \
  -e "s|@NODE_PORT_LO@|$node_port|g" -e "s|@NODE_PORT_HI@|$((node_port + ${#nodes[@]} - 1))|g" \
  -e "s|@NODE_CPUS@|$node_cpus|g" -e "s|@CRED_EXPIRE@|$cred_expire|g" \
  "$here/slurm.conf.in" >"$conf.new"
if [[ -f $conf ]] && cmp -s "$conf" "$conf.new"; then
  rm -f "$conf.new"
else
  # Running daemons keep the config they read at start; say so rather than guess.
  if [[ -f $conf ]] && pid_alive "$state/run/slurmctld.pid" slurmctld; then
    log "WARNING: slurm.conf changed while daemons run; run down.sh then up.sh to apply"
  fi
  mv -f "$conf.new" "$conf"
fi
# Clients (sbatch, squeue, scontrol, srun inside jobs) find the config through SLURM_CONF;
# daemons get it both as -f and in their environment, so job steps inherit it too.
export SLURM_CONF=$conf

# --- 3. node names resolve to this host, so a job can use them as rendezvous addresses.
for n in "${nodes[@]}"; do
  if ! getent hosts "$n" >/dev/null; then
    log "adding '127.0.0.1 ${nodes[*]}' to /etc/hosts"
    # Not fatal (a read-only /etc/hosts in some containers): only jobs that use node names
    # as addresses need it; NodeAddr in `scontrol show node` is always 127.0.0.1.
    echo "127.0.0.1 ${nodes[*]}" >>/etc/hosts || log "WARNING: cannot edit /etc/hosts"
    break
  fi
done

# --- 4. how daemons are started. Each runs under its own small reaper process: a child
# subreaper (PR_SET_CHILD_SUBREAPER) that starts the daemon and reaps everything orphaned
# below it until nothing is left, then exits. Why: pytest (tests/conftest.py) is itself a
# subreaper and reaps only between tests, so without this, processes that jobs orphan (srun
# forks a helper) would sit as zombies in the job's process group and proctrack/pgid would
# wait for them forever: the batch step never completes. The reaper is setsid'd, and takes
# </dev/null and a log file, so that no caller's terminal or output pipe is held open.
reaper_py='
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()}\n")
if os.fork() == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
'
python=$(command -v python3 || true)
[[ -n $python ]] || skip "python3 is needed for the daemons' reaper processes"

# Start `cmd` (which daemonizes and writes `pidfile`) under a reaper; wait until it runs.
launch() { # name pidfile comm cmd...
  local name=$1 pidfile=$2 comm=$3 reaper deadline
  shift 3
  rm -f "$pidfile"
  setsid "$python" -c "$reaper_py" "$state/run/reaper-$name.pid" "$@" \
    </dev/null >>"$state/log/$name.out" 2>&1 9>&- &
  reaper=$!
  deadline=$((SECONDS + 15))
  until pid_alive "$pidfile" "$comm"; do
    if [[ ! -d /proc/$reaper ]] || [[ $(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' \
      "/proc/$reaper/status" 2>/dev/null) == Z ]]; then
      dump_logs
      die "$name exited at start (see $state/log/$name.out)"
    fi
    ((SECONDS < deadline)) || { dump_logs; die "$name wrote no pid file in 15s"; }
    sleep 0.05
  done
  log "started $name (pid $(<"$pidfile"))"
}

# --- 5. munged (private to this cluster), slurmctld, slurmd n1..n3: those not running yet.
mkey=$state/munge/munge.key
msock=$state/munge/munge.socket
if [[ ! -s $mkey ]]; then
  if command -v mungekey >/dev/null; then
    mungekey --create --keyfile="$mkey"
  else
    dd if=/dev/urandom of="$mkey" bs=1024 count=1 status=none
  fi
fi
chmod 600 "$mkey"
munge_ok() { munge -n --socket="$msock" 2>/dev/null | unmunge --socket="$msock" >/dev/null 2>&1; }
if pid_alive "$state/munge/munged.pid" munged; then
  log "munged already running (pid $(<"$state/munge/munged.pid"))"
else
  # --force: munged as root with a key not owned by a 'munge' user is what we want here.
  launch munged "$state/munge/munged.pid" munged \
    munged --force --socket="$msock" --key-file="$mkey" --pid-file="$state/munge/munged.pid" \
    --log-file="$state/munge/munged.log" --seed-file="$state/munge/munged.seed"
fi
wait_until 15 "munged to answer on $msock" munge_ok || { dump_logs; die "munge not working"; }

if pid_alive "$state/run/slurmctld.pid" slurmctld; then
  log "slurmctld already running (pid $(<"$state/run/slurmctld.pid"))"
else
  # -i: ignore unreadable state from an older run instead of refusing to start. Saved jobs
  # are kept (down.sh cancels them), so job ids keep growing across runs.
  launch slurmctld "$state/run/slurmctld.pid" slurmctld slurmctld -i -f "$conf"
fi
ctld_ok() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
wait_until 20 "slurmctld to answer" ctld_ok ||
  { dump_logs; die "slurmctld not answering (port $ctld_port taken by another cluster?)"; }

declare -A fresh=() # nodes whose slurmd we (re)started: must register anew, see below
launch_s=$(date +%s)
for n in "${nodes[@]}"; do
  if pid_alive "$state/run/slurmd-$n.pid" slurmd; then
    log "slurmd $n already running (pid $(<"$state/run/slurmd-$n.pid"))"
  else
    launch "slurmd-$n" "$state/run/slurmd-$n.pid" slurmd slurmd -N "$n" -f "$conf"
    fresh[$n]=1
  fi
done

# --- 6. wait until every node is usable. Busy nodes (alloc/mix) count, so that re-running
# up.sh while jobs run succeeds; a node left drained/down by an earlier run is resumed once.
# A running slurmctld still shows a restarted node's old state (idle) until SlurmdTimeout,
# so a node whose slurmd we started counts only once that slurmd has registered (its
# SlurmdStartTime is not older than our launch).
registered() { # node
  local t
  t=$(scontrol show node -o "$1" 2>/dev/null | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p')
  [[ -n $t && $t != None ]] && (($(date -d "$t" +%s 2>/dev/null || echo 0) >= launch_s))
}
declare -A resumed=()
nodes_ready() {
  local name st ready=0
  while read -r name st; do
    if [[ -n ${fresh[$name]:-} ]]; then
      registered "$name" || continue
      unset "fresh[$name]"
    fi
    case $st in
      idle | alloc | mix) ready=$((ready + 1)) ;;
      drain | drng | down | fail)
        if [[ -z ${resumed[$name]:-} ]]; then
          resumed[$name]=1
          log "resuming node $name (state $st)"
          scontrol update NodeName="$name" State=RESUME >&2 || true
        fi
        ;;
    esac
  done < <(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u)
  ((ready == ${#nodes[@]}))
}
if ! wait_until "$timeout" "nodes ${nodes[*]} to be idle" nodes_ready; then
  sinfo -N -l >&2 || true
  dump_logs
  die "cluster not ready"
fi
sinfo -N >&2
log "cluster up in $((SECONDS - start_s))s; state dir $state"

# For `eval "$(up.sh)"`; the test fixture derives the same values from FTRUN_SLURM_STATE.
printf '# ftrun dev Slurm cluster, state dir %s\n' "$state"
printf 'export FTRUN_SLURM_STATE=%q\n' "$state"
printf 'export SLURM_CONF=%q\n' "$conf"
