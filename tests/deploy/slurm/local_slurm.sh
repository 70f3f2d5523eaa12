#!/usr/bin/env bash
# local_slurm.sh — a throw-away Slurm cluster (munged + slurmctld + slurmd) on
# this one machine, living entirely inside one directory, for automated tests.
#
#   local_slurm.sh start    DIR [CPUS] [NODES]  start; write DIR/env and DIR/pids
#   local_slurm.sh stop     DIR                 cancel jobs, stop daemons (by pid)
#   local_slurm.sh wait-job DIR JOBID TIMEOUT_S wait for JOBID; exit 0 iff COMPLETED
#
# CPUS (default 8) is declared per node, whatever the machine really has.
# NODES (default 2, or $LOCAL_SLURM_NODES) slurmd daemons run on this host as
# nodes "<host>", "<host>-1", ...  Two are the default because Slurm 22.05's
# backfill scheduler reserves whole nodes for planned jobs, so the components
# of a heterogeneous job never start together on a single node.
#
# Everything (munge key and sockets, slurm.conf, state, spool, logs, pid files)
# is under DIR, so several instances can run side by side and nothing in /etc,
# /run or /var/spool is touched.  Clients find the cluster through SLURM_CONF
# (exported by DIR/env); slurm.conf carries AuthInfo=socket=..., which the
# munge plugins read in the daemons *and* in sbatch/srun/squeue/scontrol, so
# clients reach the private munged without any other variable.
#
# Daemons run in the foreground (-D / -F) as background children of this
# script, so "$!" is their real pid: no pid is guessed, nothing is killed by
# name.  Their stdio goes to files under DIR so that a caller reading our
# stdout through a pipe is not held open by them.
#
# Tested with Debian 12 packages slurm-wlm 22.05.8 and munge 0.5.15, as root,
# without systemd and without cgroups.
set -euo pipefail

PROG=$(basename "$0")
# Marker put in the environment of slurmctld and slurmd.  Their helpers
# (slurmscriptd, slurmstepd) inherit it, so "stop" can find helpers that
# outlived a killed daemon by this marker, never by process name.
MARKER_VAR=LOCAL_SLURM_INSTANCE
POLL_INTERVAL=0.2

die() { echo "$PROG: $*" >&2; exit 1; }

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Find a daemon binary: PATH first, then the sbin dirs a user PATH may miss.
find_bin() {
  local name=$1 d
  if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return 0; fi
  for d in /usr/sbin /usr/local/sbin /sbin; do
    if [ -x "$d/$name" ]; then echo "$d/$name"; return 0; fi
  done
  return 1
}

# A TCP port that is free right now (the kernel picks it).  There is a small
# race until the daemon binds it; the readiness waits below catch a loss.
free_port() {
  local py p
  py=$(command -v python3 || true)
  if [ -n "$py" ]; then
    "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
    return
  fi
  # Fallback without python: a random high port that ss does not list.
  for _ in $(seq 1 100); do
    p=$(( 20000 + RANDOM % 40000 ))
    if ! ss -Htln "sport = :$p" 2>/dev/null | grep -q .; then echo "$p"; return; fi
  done
  die "no free port found"
}

# poll DEADLINE_S DESCRIPTION COMMAND...: run COMMAND until it succeeds or the
# deadline passes.  COMMAND returns $GIVE_UP when waiting is pointless (a
# daemon died).  The short sleep only paces the polling; the order of events
# comes from the condition itself.
GIVE_UP=99
poll() {
  local limit=$1 what=$2; shift 2
  local end=$(( SECONDS + limit )) rc
  while :; do
    rc=0; "$@" >/dev/null 2>&1 || rc=$?
    (( rc == 0 )) && return 0
    if (( rc == GIVE_UP )); then
      echo "$PROG: gave up waiting for: $what (a daemon exited)" >&2
      return 1
    fi
    if (( SECONDS >= end )); then
      echo "$PROG: timed out after ${limit}s waiting for: $what" >&2
      return 1
    fi
    sleep "$POLL_INTERVAL"
  done
}

# Tail of every log under DIR, for diagnosing a failed start.
dump_logs() {
  local dir=$1 f
  for f in "$dir"/log/*; do
    [ -s "$f" ] || continue
    # slurmctld/slurmd in -D mode print to stderr what they also write to
    # their log file; show the .out only when there is no log file.
    case $f in *.out) [ -s "${f%.out}.log" ] && continue ;; esac
    echo "----- tail of $f -----" >&2
    tail -n 25 "$f" >&2 || true
  done
}

# Is PID alive and still one of ours?  Every daemon of this instance has a
# path under DIR in its command line, which guards against a recycled pid.
# (A zombie has an empty cmdline and counts as gone.)
ours() {
  local pid=$1 dir=$2
  [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline" | grep -qF -- "$dir/"
}

# Pids of processes whose environment holds MARKER_VAR=DIR:ROLE (ROLE is ctld
# or slurmd).  One grep over /proc keeps this cheap enough to poll.
marked_pids() {
  local dir=$1 role=$2
  grep -lzxF -- "$MARKER_VAR=$dir:$role" /proc/[0-9]*/environ 2>/dev/null |
    cut -d/ -f3 | grep -vx -- "$$" || true
}

# Pids of job processes of this instance (batch scripts, srun, tasks): their
# environment has SLURM_JOB_ID and a SLURM_CONF of this instance (slurmstepd
# sets the one its slurmd read).  Our own pid and ancestors are left out, in
# case stop is run from inside a job.
job_pids() {
  local dir=$1 f p ancestors=" " a=$$
  while [ -n "$a" ] && [ "$a" != 0 ] && [ "$a" != 1 ]; do
    ancestors+="$a "
    a=$(awk '{print $4}' "/proc/$a/stat" 2>/dev/null || true)
  done
  local pats=(-e "SLURM_CONF=$dir/slurm.conf")
  for f in "$dir"/slurmd.*.conf; do [ -e "$f" ] && pats+=(-e "SLURM_CONF=$f"); done
  while read -r f; do
    p=$(cut -d/ -f3 <<<"$f")
    [[ "$ancestors" == *" $p "* ]] && continue
    if grep -qz '^SLURM_JOB_ID=' "$f" 2>/dev/null; then echo "$p"; fi
  done < <(grep -lzxF "${pats[@]}" /proc/[0-9]*/environ 2>/dev/null || true)
}

# ---------------------------------------------------------------------------
# write_conf FILE MUNGE_SOCKET: slurm.conf for this instance.  Uses the
# variables set in cmd_start (dir, host, ctld_port, nodes, names, ports, cpus).
write_conf() {
  local file=$1 sock=$2 j
  {
    cat <<EOF
# Generated by $PROG for a throw-away test cluster in $dir.
ClusterName=localtest
# slurmctld checks that it runs on SlurmctldHost, so the short hostname is
# used; the address is loopback so nothing leaves the machine.
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
# The private munged of this instance.  auth/munge and cred/munge read the
# socket from here, in the daemons and in the client commands alike.
AuthType=auth/munge
AuthInfo=socket=$sock
CredType=cred/munge
# slurmd of nodes 1.. read a copy of this file that differs only in AuthInfo
# (each has its own munged, see cmd_start); do not log the differing hash.
DebugFlags=NO_CONF_HASH

StateSaveLocation=$dir/ctld_state
SlurmdSpoolDir=$dir/slurmd_spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true

# No cgroups (none usable here): track processes through /proc, no binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none

# CPUs are the only consumable resource; memory is not tracked, so the small
# RealMemory below never blocks a job.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Heterogeneous jobs are started only by the backfill scheduler; run it every
# second so a het job does not wait for the default 30 s cycle.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
# Believe the CPU count declared below even though the machine has fewer
# cores (tests want more task slots than a small VM has).
SlurmdParameters=config_overrides
ReturnToService=2

# Keep finished jobs in "scontrol show job" for an hour: without accounting
# that is where wait-job reads the final state.
MinJobAge=3600
KillWait=5
InactiveLimit=0
Waittime=0
SlurmctldTimeout=60
SlurmdTimeout=300
MessageTimeout=10

# Several slurmd on one host: each node has its own Port and a distinct
# NodeHostname (Slurm rejects duplicate NodeHostnames unless built with
# --enable-multiple-slurmd); each slurmd is started with -N NODENAME.
EOF
    for (( j=0; j<nodes; j++ )); do
      echo "NodeName=${names[$j]} NodeHostname=${names[$j]} NodeAddr=127.0.0.1 Port=${ports[$j]} CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=1024 State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$file"
  # No cgroup.conf: with proctrack/linuxproc and task/none no cgroup plugin
  # is loaded, and only cgroup plugins read it.
}

# ---------------------------------------------------------------------------
cmd_start() {
  dir=${1:-}
  cpus=${2:-8}
  nodes=${3:-${LOCAL_SLURM_NODES:-2}}
  [ -n "$dir" ] || usage
  [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || die "CPUS must be a positive integer, got '$cpus'"
  [[ "$nodes" =~ ^[1-9]$ ]] || die "NODES must be 1..9, got '$nodes'"

  local munged slurmctld slurmd
  munged=$(find_bin munged) || die "munged not found (apt-get install munge)"
  slurmctld=$(find_bin slurmctld) || die "slurmctld not found (apt-get install slurm-wlm)"
  slurmd=$(find_bin slurmd) || die "slurmd not found (apt-get install slurm-wlm)"
  command -v sinfo >/dev/null || die "sinfo not found (apt-get install slurm-client)"
  command -v munge >/dev/null || die "munge client not found (apt-get install munge)"

  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd -P)   # absolute: it ends up in slurm.conf and env
  [ ! -e "$dir/pids" ] || die "$dir/pids exists: a cluster may already run there"
  # A unix socket path must fit in sun_path (108 bytes incl. NUL).
  (( ${#dir} < 80 )) || die "DIR too long for unix socket paths under it: $dir"
  # munged refuses socket/key directories that others can write to.
  chmod 0700 "$dir"
  mkdir -p "$dir/munge" "$dir/log" "$dir/ctld_state" "$dir/slurmd_spool" "$dir/run"
  chmod 0700 "$dir/munge"

  # munge key: 1 KiB random, owner-only, as munged requires.  All munged
  # instances share it, so any of them decodes what another encoded.
  ( umask 077; head -c 1024 /dev/urandom > "$dir/munge/munge.key" )
  chmod 0400 "$dir/munge/munge.key"

  # Node names and ports.  Node 0 is named after the host, so a nodelist entry
  # naming it resolves; nodes 1.. are "<host>-<i>", names only Slurm knows
  # (they all have NodeAddr=127.0.0.1).
  local i p
  host=$(hostname -s)
  ctld_port=$(free_port)
  names=(); ports=()
  for (( i=0; i<nodes; i++ )); do
    if (( i == 0 )); then names+=("$host"); else names+=("$host-$i"); fi
    p=$(free_port)
    while [ "$p" = "$ctld_port" ] || [[ " ${ports[*]:-} " == *" $p "* ]]; do p=$(free_port); done
    ports+=("$p")
  done

  export SLURM_CONF="$dir/slurm.conf"
  : > "$dir/pids"
  # From here on a failure must not leave daemons behind.
  START_DIR=$dir   # global: the EXIT trap may run outside this function
  trap 'rc=$?; if [ $rc -ne 0 ]; then echo "$PROG: start failed; logs follow" >&2; dump_logs "$START_DIR"; cmd_stop "$START_DIR" >&2 || true; fi' EXIT

  # munged: one for slurmctld, the clients and node 0, plus one per further
  # node, as on a real cluster.  Why not one for all: munged refuses a
  # credential it has decoded before ("Replayed credential"), and Slurm built
  # without --enable-multiple-slurmd (Debian's) treats that as a failed
  # check; a credential forwarded from one slurmd to another, or the job-step
  # credential of a step spanning several nodes, would meet the same munged
  # twice.  (A shared munged did log a replay in a trial here.)
  local socks=() mpids=() sock
  for (( i=0; i<nodes; i++ )); do
    sock="$dir/munge/munge.socket.$i"
    "$munged" -F --force \
        --socket="$sock" \
        --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/run/munged.$i.pid" \
        --seed-file="$dir/munge/munged.$i.seed" \
        --num-threads=2 \
        </dev/null >"$dir/log/munged.$i.out" 2>&1 &
    echo "munged.$i $!" >> "$dir/pids"
    mpids+=("$!"); socks+=("$sock")
  done
  # Ready when a credential round-trips through every socket.
  munge_ok() {
    local k
    for (( k=0; k<nodes; k++ )); do
      kill -0 "${mpids[$k]}" || return $GIVE_UP
      munge -S "${socks[$k]}" -n </dev/null | unmunge -S "${socks[$k]}" || return 1
    done
  }
  poll 20 "munged on ${socks[*]}" munge_ok

  write_conf "$dir/slurm.conf" "${socks[0]}"
  for (( i=1; i<nodes; i++ )); do write_conf "$dir/slurmd.$i.conf" "${socks[$i]}"; done

  # slurmctld (-i: ignore missing state files; the state dir is fresh).
  env "$MARKER_VAR=$dir:ctld" "$slurmctld" -D -i -f "$dir/slurm.conf" \
      </dev/null >"$dir/log/slurmctld.out" 2>&1 &
  local ctld_pid=$!
  echo "slurmctld $ctld_pid" >> "$dir/pids"
  ctld_ok() { kill -0 "$ctld_pid" || return $GIVE_UP; scontrol ping | grep -q 'is UP'; }
  poll 30 "slurmctld to answer scontrol ping" ctld_ok

  # slurmd, one per node; -N names the node instead of guessing from hostname.
  local dpids=() conf
  for (( i=0; i<nodes; i++ )); do
    if (( i == 0 )); then conf="$dir/slurm.conf"; else conf="$dir/slurmd.$i.conf"; fi
    mkdir -p "$dir/slurmd_spool/${names[$i]}"
    env "$MARKER_VAR=$dir:slurmd" "$slurmd" -D -N "${names[$i]}" -f "$conf" \
        </dev/null >"$dir/log/slurmd.${names[$i]}.out" 2>&1 &
    dpids+=("$!")
    echo "slurmd.${names[$i]} $!" >> "$dir/pids"
  done
  nodes_idle() {
    local d
    kill -0 "$ctld_pid" || return $GIVE_UP
    for d in "${dpids[@]}"; do kill -0 "$d" || return $GIVE_UP; done
    [ "$(sinfo -h -N -o '%N %T' | grep -c ' idle$')" -eq "$nodes" ]
  }
  poll 60 "$nodes node(s) to become idle" nodes_idle

  # What a caller sources to talk to this cluster.
  cat > "$dir/env" <<EOF
# Source this file to use sbatch/srun/squeue/scontrol with the cluster in $dir.
export SLURM_CONF=$dir/slurm.conf
# The munge/unmunge tools take the socket only via -S; kept for convenience.
export LOCAL_SLURM_MUNGE_SOCKET=${socks[0]}
export LOCAL_SLURM_NODES="${names[*]}"
export LOCAL_SLURM_CPUS_PER_NODE=$cpus
export LOCAL_SLURM_DIR=$dir
EOF
  trap - EXIT
  echo "$PROG: cluster up in $dir (nodes: ${names[*]}; $cpus CPUs each; slurmctld port $ctld_port; slurmd ports ${ports[*]})"
}

# ---------------------------------------------------------------------------
cmd_stop() {
  local dir=${1:-}
  [ -n "$dir" ] || usage
  [ -d "$dir" ] || die "no such directory: $dir"
  dir=$(cd "$dir" && pwd -P)
  [ -f "$dir/pids" ] || { echo "$PROG: no $dir/pids, nothing to stop"; return 0; }
  export SLURM_CONF="$dir/slurm.conf"

  local name pid ctld_pid="" pids=()
  while read -r name pid; do
    [ -n "${pid:-}" ] || continue
    [ "$name" = slurmctld ] && ctld_pid=$pid
    pids+=("$pid")
  done < "$dir/pids"

  # 1. Cancel what still runs while slurmctld is up, so that slurmstepd ends
  #    the jobs' processes itself (linuxproc tracks them); give the step
  #    daemons a bounded time to leave.
  if [ -n "$ctld_pid" ] && ours "$ctld_pid" "$dir"; then
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      # shellcheck disable=SC2086  # word splitting wanted: a list of ids
      scancel $jobs 2>/dev/null || true
      no_steps() {
        local s
        for s in $(marked_pids "$dir" slurmd); do
          # slurmd itself carries the marker too; only other processes count
          [[ " ${pids[*]} " == *" $s "* ]] || return 1
        done
      }
      poll 20 "job steps to end after scancel" no_steps || true
    fi
  fi

  # 2. TERM the daemons in reverse start order, KILL what outlives a deadline.
  local i
  for (( i=${#pids[@]}-1; i>=0; i-- )); do
    pid=${pids[$i]}
    if ours "$pid" "$dir"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  all_gone() {
    local q
    for q in "${pids[@]}"; do ours "$q" "$dir" && return 1; done
    return 0
  }
  if ! poll 15 "daemons to exit after SIGTERM" all_gone; then
    for pid in "${pids[@]}"; do
      if ours "$pid" "$dir"; then kill -KILL "$pid" 2>/dev/null || true; fi
    done
    poll 5 "daemons to exit after SIGKILL" all_gone || true
  fi

  # 3. Helpers still carrying our marker (an orphaned slurmstepd or
  #    slurmscriptd) go too, and then job processes that outlived their
  #    slurmstepd (only when scancel could not run: slurmctld was gone).
  for pid in $(marked_pids "$dir" slurmd) $(marked_pids "$dir" ctld); do
    kill -KILL "$pid" 2>/dev/null || true
  done
  for pid in $(job_pids "$dir"); do
    echo "$PROG: killing leftover job process $pid" >&2
    kill -KILL "$pid" 2>/dev/null || true
  done

  mv "$dir/pids" "$dir/pids.stopped"
  echo "$PROG: stopped cluster in $dir"
}

# ---------------------------------------------------------------------------
# States after which a job does not run again.
TERMINAL_RE='^(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|PREEMPTED|BOOT_FAIL|DEADLINE|OUT_OF_MEMORY|SPECIAL_EXIT|REVOKED)$'

cmd_wait_job() {
  local dir=${1:-} job=${2:-} timeout=${3:-}
  if [ -z "$dir" ] || [ -z "$job" ] || [ -z "$timeout" ]; then usage; fi
  dir=$(cd "$dir" && pwd -P)
  export SLURM_CONF="$dir/slurm.conf"
  POLL_INTERVAL=0.5   # two RPCs per poll; no need to hurry slurmctld

  # A het job has one record per component (JobId=N, N+1, ... with
  # HetJobOffset 0, 1, ...); all of them must be terminal.  "scontrol show
  # job" keeps finished jobs for MinJobAge seconds (an hour, see slurm.conf);
  # there is no accounting database, so sacct cannot be used.
  job_done() {
    local s n=0
    # Still listed by squeue (pending, running, completing)?  Not done.
    [ -z "$(squeue -h -j "$job" -o %i 2>/dev/null)" ] || return 1
    for s in $(scontrol show job -o "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2); do
      [[ "$s" =~ $TERMINAL_RE ]] || return 1
      n=$((n + 1))
    done
    (( n > 0 ))
  }
  if ! poll "$timeout" "job $job to finish" job_done; then
    scontrol show job "$job" >&2 || true
    return 1
  fi

  # One line per component: "job ID STATE ExitCode=X:Y", where ID is
  # HETJOBID+OFFSET for a het job component (as squeue shows it).
  local line id het off state exitc ok=1
  while read -r line; do
    id=$(grep -o '^JobId=[0-9]*' <<<"$line" | cut -d= -f2)
    het=$(grep -o 'HetJobId=[0-9]*' <<<"$line" | cut -d= -f2 || true)
    off=$(grep -o 'HetJobOffset=[0-9]*' <<<"$line" | cut -d= -f2 || true)
    [ -z "$het" ] || id="$het+$off"
    state=$(grep -o 'JobState=[A-Z_]*' <<<"$line" | cut -d= -f2)
    exitc=$(grep -o ' ExitCode=[0-9:]*' <<<"$line" | cut -d= -f2)
    echo "job $id $state ExitCode=$exitc"
    [ "$state" = COMPLETED ] || ok=0
  done < <(scontrol show job -o "$job")
  (( ok ))
}

# ---------------------------------------------------------------------------
case "${1:-}" in
  start)    shift; cmd_start "$@" ;;
  stop)     shift; cmd_stop "$@" ;;
  wait-job) shift; cmd_wait_job "$@" ;;
  *)        usage ;;
esac
