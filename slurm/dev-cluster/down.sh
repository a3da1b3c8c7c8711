#!/usr/bin/env bash
# Tear down what up.sh started from this state dir, and nothing else:
#   1. cancel every job (scancel) and wait for the queue to drain,
#   2. SIGKILL any process still left in those jobs (slurmstepd and its tasks survive a
#      slurmd shutdown by design, and a task may have escaped its process group),
#   3. stop slurmd n1..n3, slurmctld, then munged, by the pid files in the state dir:
#      SIGTERM, then SIGKILL after a grace period, waiting with deadlines until gone;
#      then the reaper processes up.sh runs the daemons under (they exit by themselves).
# Idempotent: with nothing running it does nothing and exits 0. Exits 1 if something it
# started is still alive at the end. The state dir (config, logs, saved state) is kept;
# FTRUN_SLURM_PURGE=1 removes it as well.
set -euo pipefail

state=${FTRUN_SLURM_STATE:-/tmp/ftrun-slurm}
conf=$state/slurm.conf
nodes=(n1 n2 n3)
grace=${FTRUN_SLURM_DOWN_GRACE:-10}
start_s=$SECONDS

log() { printf 'down.sh: %s\n' "$*" >&2; }

if [[ ! -f $conf ]]; then
  log "no cluster state in $state; nothing to do"
  exit 0
fi
export SLURM_CONF=$conf
# Not while an up.sh on this state dir is half-way (same lock as up.sh).
exec 9>"$state/.lock"
flock -w 120 9 || { log "ERROR: another up.sh/down.sh holds $state/.lock"; exit 1; }

# Alive = exists and is not a zombie: exited daemons re-parented to a subreaper (pytest)
# stay zombies until it reaps them, which it cannot do while it waits for us.
alive() { # pid
  local st
  st=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null) || return 1
  [[ -n $st && $st != Z && $st != X ]]
}

# The pid in a pid file, if that process is alive and still the expected program.
pid_of() { # pidfile comm
  local pid
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  alive "$pid" || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
  echo "$pid"
}

# Send `sig` to `pids`, wait up to `secs` for them to be gone; returns 1 if some survive.
signal_and_wait() { # sig secs pid...
  local sig=$1 secs=$2 deadline p left
  shift 2
  (($#)) || return 0
  kill "-$sig" "$@" 2>/dev/null || true
  deadline=$((SECONDS + secs))
  while :; do
    left=()
    for p in "$@"; do alive "$p" && left+=("$p"); done
    ((${#left[@]})) || return 0
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}

stop() { # what pid... : SIGTERM, grace, SIGKILL
  local what=$1
  shift
  (($#)) || return 0
  log "stopping $what (pids $*)"
  signal_and_wait TERM "$grace" "$@" && return 0
  log "$what ignored SIGTERM for ${grace}s; sending SIGKILL"
  signal_and_wait KILL 5 "$@"
}

# Our own ancestors must never be matched below (e.g. down.sh run from inside a job).
declare -A ours=()
p=$$
while [[ $p =~ ^[0-9]+$ ]] && ((p > 1)); do
  ours[$p]=1
  p=$(ps -o ppid= -p "$p" 2>/dev/null | tr -d ' ') || break
done

# Processes of jobs of *this* cluster: our slurmstepds (they inherit SLURM_CONF from our
# slurmd), everything below them, and any job task (SLURM_JOB_ID and SLURMD_NODENAME set
# by slurmstepd) that carries our SLURM_CONF but escaped the tree (setsid + double fork).
job_pids() {
  local -a with_conf=()
  local -a queue=() children=()
  local -A found=() kids=()
  local f p pid ppid
  mapfile -t with_conf < <(grep -lzxF "SLURM_CONF=$conf" /proc/[0-9]*/environ 2>/dev/null || true)
  for f in "${with_conf[@]}"; do
    pid=${f#/proc/}
    pid=${pid%/environ}
    [[ -z ${ours[$pid]:-} ]] || continue
    alive "$pid" || continue
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == slurmstepd ]] ||
      { grep -qz '^SLURM_JOB_ID=' "$f" 2>/dev/null && grep -qz '^SLURMD_NODENAME=' "$f" 2>/dev/null; }; then
      found[$pid]=1
    fi
  done
  # Descendants, breadth first over a single ps snapshot.
  while read -r pid ppid; do kids[$ppid]+="$pid "; done < <(ps -e -o pid=,ppid=)
  queue=("${!found[@]}")
  while ((${#queue[@]})); do
    pid=${queue[0]}
    queue=("${queue[@]:1}")
    read -ra children <<<"${kids[$pid]:-}"
    for p in "${children[@]}"; do
      [[ -n ${found[$p]:-} || -n ${ours[$p]:-} ]] && continue
      alive "$p" || continue
      found[$p]=1
      queue+=("$p")
    done
  done
  ((${#found[@]})) && printf '%s\n' "${!found[@]}"
  return 0
}

kill_job_procs() {
  local -a pids=()
  mapfile -t pids < <(job_pids)
  ((${#pids[@]})) || return 0
  log "killing ${#pids[@]} leftover job process(es): ${pids[*]}"
  signal_and_wait KILL 5 "${pids[@]}" || log "WARNING: job processes survive SIGKILL"
}

queue_empty() { [[ -z $(squeue -h -o %A 2>/dev/null) ]]; }
wait_queue_empty() { # secs
  local deadline=$((SECONDS + $1))
  until queue_empty; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

# --- 1. cancel all jobs while slurmctld can still do it cleanly.
ctld=$(pid_of "$state/run/slurmctld.pid" slurmctld || true)
if [[ -n $ctld ]]; then
  mapfile -t jobs < <(squeue -h -o %A 2>/dev/null || true)
  if ((${#jobs[@]})); then
    log "cancelling ${#jobs[@]} job(s): ${jobs[*]}"
    scancel "${jobs[@]}" 2>/dev/null || true
    # SIGTERM, KillWait (2 s), SIGKILL, step teardown. A job stays COMPLETING longer only
    # if a task escaped its process group: step 2 deals with that.
    wait_queue_empty 8 || log "jobs still listed 8s after scancel; killing their processes"
  fi
fi

# --- 2. whatever is left of those jobs. Then give slurmctld a moment to see them end, so
# that its saved state (reused by the next up.sh) holds no half-finished job.
kill_job_procs
if [[ -n $ctld ]]; then wait_queue_empty 5 || log "WARNING: jobs still listed: $(squeue -h -o %A | tr '\n' ' ')"; fi

# --- 3. the daemons: slurmd first (they report to slurmctld), munged last (the others
# authenticate through it while shutting down). slurmctld's helper slurmscriptd goes with it.
sd=()
for n in "${nodes[@]}"; do
  pid=$(pid_of "$state/run/slurmd-$n.pid" slurmd || true)
  [[ -n $pid ]] && sd+=("$pid")
done
stop "slurmd" "${sd[@]}" || true
if [[ -n $ctld ]] && alive "$ctld"; then
  mapfile -t helpers < <(ps -o pid= --ppid "$ctld" 2>/dev/null | tr -d ' ' || true)
  stop "slurmctld" "$ctld" "${helpers[@]}" || true
fi
kill_job_procs # a step could have been launching while slurmd went away
munged=$(pid_of "$state/munge/munged.pid" munged || true)
if [[ -n $munged ]]; then stop "munged" "$munged" || true; fi

# up.sh runs each daemon under a reaper process (see there) that exits by itself once its
# daemon and everything orphaned below it are gone; end any that is still waiting.
reaper_pid() { # pidfile: the reaper's pid if alive and really ours (its cmdline names it)
  local pid
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  alive "$pid" || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$1" || return 1
  echo "$pid"
}
reapers=()
for f in "$state"/run/reaper-*.pid; do
  pid=$(reaper_pid "$f" || true)
  [[ -n $pid ]] && reapers+=("$pid")
done
if ((${#reapers[@]})); then
  # SIGCONT is a no-op signal here: this only waits (3 s) for them to finish on their own.
  signal_and_wait CONT 3 "${reapers[@]}" || stop "reaper processes" "${reapers[@]}" || true
fi

# --- 4. verify, and drop pid files so that up.sh never trusts a stale one.
left=()
checks=("$state/run/slurmctld.pid:slurmctld" "$state/munge/munged.pid:munged")
for n in "${nodes[@]}"; do checks+=("$state/run/slurmd-$n.pid:slurmd"); done
for c in "${checks[@]}"; do
  pid=$(pid_of "${c%:*}" "${c##*:}" || true)
  if [[ -n $pid ]]; then left+=("${c##*:}:$pid"); else rm -f "${c%:*}"; fi
done
for f in "$state"/run/reaper-*.pid; do
  pid=$(reaper_pid "$f" || true)
  if [[ -n $pid ]]; then left+=("reaper:$pid"); else rm -f "$f"; fi
done
if ((${#left[@]})); then
  log "ERROR: still running: ${left[*]}"
  exit 1
fi
if [[ ${FTRUN_SLURM_PURGE:-0} == 1 ]]; then
  rm -rf "$state"
  log "removed $state"
fi
log "cluster down in $((SECONDS - start_s))s"
