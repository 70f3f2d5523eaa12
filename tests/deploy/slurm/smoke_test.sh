#!/usr/bin/env bash
# smoke_test.sh — proves that local_slurm.sh brings up a working Slurm cluster:
#   1. one batch job whose allocation runs 3 job steps concurrently
#      (srun --overlap ... & x3; each step waits until all 3 have started, so
#      the test fails unless they really overlap in time);
#   2. sbatch --test-only accepts a heterogeneous job script (#SBATCH hetjob);
#   3. that het job really runs, with srun --het-group=0, =1 and =0,1
#      (needs 2 nodes, the local_slurm.sh default).
# The cluster is always stopped (EXIT trap).  Exit 0: pass; 1: fail;
# 77: skipped (Slurm or munge not installed, or not root).
#
# Env: SMOKE_KEEP=1 keeps the temp dir even on success (it is kept on failure).
set -euo pipefail

# --- skip when the daemons are not installed (77 = "skipped" for ctest/automake)
for b in munged slurmctld slurmd; do
  if ! command -v "$b" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$b" ]; then
    echo "skipped: $b not installed (apt-get install slurm-wlm munge)"
    exit 77
  fi
done
for b in sbatch srun squeue scontrol sinfo munge; do
  if ! command -v "$b" >/dev/null 2>&1; then
    echo "skipped: $b not installed (apt-get install slurm-client munge)"
    exit 77
  fi
done
# slurmd must be root to start job steps (SlurmdUser=root in slurm.conf).
if [ "$(id -u)" -ne 0 ]; then
  echo "skipped: must run as root (slurmd launches the job steps)"
  exit 77
fi

here=$(cd "$(dirname "$0")" && pwd)
ls_sh="$here/local_slurm.sh"

t0=$SECONDS
dir=$(mktemp -d /tmp/lslurm.XXXXXX)   # short path: munge sockets live under it
ok=0
cleanup() {
  "$ls_sh" stop "$dir" >/dev/null 2>&1 || echo "smoke: stop failed" >&2
  if [ "$ok" = 1 ] && [ "${SMOKE_KEEP:-0}" != 1 ]; then
    rm -rf "$dir"
  else
    echo "smoke: cluster dir kept: $dir" >&2
  fi
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/log/slurmctld.log "$dir"/log/slurmd.*.log "$dir"/out/*.out; do
    [ -f "$f" ] && { echo "----- tail of $f -----" >&2; tail -n 20 "$f" >&2; }
  done
  exit 1
}

# --- start
"$ls_sh" start "$dir" 8 || fail "cluster did not start"
t_start=$(( SECONDS - t0 ))
# shellcheck source=/dev/null
source "$dir/env"
mkdir -p "$dir/out"

# --- 1. three concurrent steps in one allocation
cat > "$dir/steps.sbatch" <<'EOF'
#!/bin/bash
#SBATCH --job-name=smoke-steps
#SBATCH --nodes=1 --ntasks=3 --cpus-per-task=1 --time=5
# Each step writes "<step id> <hostname>" and then waits (deadline 60 s) until
# all three files exist: it completes only if the three steps overlap.
out=$SLURM_SUBMIT_DIR/out
for i in 1 2 3; do
  srun --overlap -n1 -N1 bash -c '
    echo "$SLURM_STEP_ID $(hostname) $SLURM_JOB_NODELIST" > '"$out"'/step.$SLURM_STEP_ID
    end=$((SECONDS + 60))
    until [ "$(ls '"$out"'/step.* | wc -l)" -ge 3 ]; do
      [ $SECONDS -lt $end ] || { echo "step $SLURM_STEP_ID: peers never started" >&2; exit 1; }
      sleep 0.1
    done' &
done
wait_rc=0
for j in $(jobs -p); do wait "$j" || wait_rc=1; done
exit $wait_rc
EOF
t1=$SECONDS
job=$(cd "$dir" && sbatch --parsable -o out/steps.out "$dir/steps.sbatch") || fail "sbatch of the step job failed"
"$ls_sh" wait-job "$dir" "$job" 120 || fail "job $job did not complete"
ids=$(cat "$dir"/out/step.* 2>/dev/null | cut -d' ' -f1 | sort -n | tr '\n' ' ')
[ "$ids" = "0 1 2 " ] || fail "expected step files for steps 0 1 2, got: '$ids'"
host=$(hostname)
while read -r _ h _; do
  [ "$h" = "$host" ] || fail "step ran on host '$h', expected '$host'"
done < <(cat "$dir"/out/step.*)
echo "ok: 3 concurrent steps of job $job ($(( SECONDS - t1 ))s)"

# --- 2. a heterogeneous job is accepted
cat > "$dir/het.sbatch" <<'EOF'
#!/bin/bash
#SBATCH --job-name=smoke-coord --ntasks=1 --cpus-per-task=1 --time=5
#SBATCH hetjob
#SBATCH --job-name=smoke-workers --ntasks=2 --cpus-per-task=1 --time=5
# Component 0 could host a coordinator, component 1 its workers.  Every step
# records what it learns from Slurm about the other component.
out=$SLURM_SUBMIT_DIR/out
rec='echo "$SLURM_HET_SIZE $SLURM_JOB_NODELIST_HET_GROUP_0 $SLURM_JOB_NODELIST_HET_GROUP_1 $SLURMD_NODENAME $SLURM_PROCID"'
srun --het-group=0 bash -c "$rec > $out/het.g0.\$SLURM_PROCID" &
srun --het-group=1 bash -c "$rec > $out/het.g1.\$SLURM_PROCID" &
wait
srun --het-group=0,1 bash -c "$rec > $out/het.g01.\$SLURM_PROCID"
EOF
( cd "$dir" && sbatch --test-only "$dir/het.sbatch" ) >"$dir/out/het-test-only.txt" 2>&1 ||
  fail "sbatch --test-only rejected the het job: $(cat "$dir/out/het-test-only.txt")"
echo "ok: sbatch --test-only accepts a het job ($(tr '\n' ' ' < "$dir/out/het-test-only.txt"))"

# --- 3. the het job really runs (needs a node per component, see local_slurm.sh)
nnodes=$(sinfo -h -N -o %N | wc -l)
if [ "$nnodes" -ge 2 ]; then
  t1=$SECONDS
  job=$(cd "$dir" && sbatch --parsable -o out/het.out "$dir/het.sbatch") || fail "sbatch of the het job failed"
  "$ls_sh" wait-job "$dir" "$job" 120 || fail "het job $job did not complete"
  for f in het.g0.0 het.g1.0 het.g1.1 het.g01.0 het.g01.1 het.g01.2; do
    [ -s "$dir/out/$f" ] || fail "het step output $f missing"
    read -r size n0 n1 _ _ < "$dir/out/$f"
    [ "$size" = 2 ] || fail "$f: SLURM_HET_SIZE='$size', expected 2"
    if [ -z "$n0" ] || [ -z "$n1" ]; then fail "$f: het group nodelists missing"; fi
  done
  echo "ok: het job $job ran srun --het-group=0, =1 and =0,1 ($(( SECONDS - t1 ))s)"
else
  echo "note: 1 node only, het job not run (components cannot share a node under backfill)"
fi

ok=1
echo "PASS (cluster start ${t_start}s, total $(( SECONDS - t0 ))s)"
