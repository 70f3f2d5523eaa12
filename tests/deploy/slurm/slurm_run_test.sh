#!/usr/bin/env bash
# The batch scripts `hetpar deploy slurm` renders, run by a real Slurm: a throw-away cluster on
# this machine (local_slurm.sh: munged, slurmctld and two slurmd, in a temporary directory,
# stopped by pid) runs
#   1. the single-allocation script of a 6-step tiny run on whole nodes (--ranks-per-node 2: the
#      encoder pool's step on one node, the LLM's on the other, as each task's log says): the run
#      directory must hold the steps, the final parameters and the model, and match the
#      reference trainer under hetpar compare;
#   2. the heterogeneous-job script on whole nodes, with --memory-per-rank (checked with sbatch
#      --test-only, then run for real on the two nodes, with the same checks);
#   3. the single-allocation script of a pipelined LLM (pp 2), with the same checks;
#   4. the single-allocation script with workers that cannot start: the job must fail and its
#      log must name the failing step;
#   5. a run stopped by `hetpar stop`: the job completes and its log says the run stopped, not
#      that it is done.
#   6. a job near its time limit: the run stops after a checkpoint, and the job says so.
#   7. an encoder task killed mid-run: its replica leaves, the run trains to its end on the
#      other, and the job completes (the encoder step's failure is named, not fatal).
# Usage: slurm_run_test.sh HETPAR_BIN_DIR REPO_ROOT. Exit 77 (skipped) without Slurm or root.
set -euo pipefail

bin="$1"
repo="$2"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for tool in slurmctld slurmd munged sbatch; do
  if ! command -v "$tool" >/dev/null && [ ! -x "/usr/sbin/$tool" ]; then
    echo "skipped: $tool is not installed (deploy/install-deps.sh installs Slurm)"
    exit 77
  fi
done
if [ "$(id -u)" -ne 0 ]; then
  echo "skipped: the local Slurm cluster runs its daemons as root"
  exit 77
fi

work="$(mktemp -d /tmp/hetpar-slurm-test.XXXXXX)"
cleanup() {
  "$here/local_slurm.sh" stop "$work/slurm" >/dev/null 2>&1 || true
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
fail() {
  echo "slurm_run_test: FAIL: $*" >&2
  for f in "$work"/run*/slurm-*.out "$work"/run*/log/*.log; do
    [ -f "$f" ] && { echo "== $f" >&2; tail -n 15 "$f" >&2; }
  done
  exit 1
}

"$here/local_slurm.sh" start "$work/slurm" 8 2 >/dev/null
# shellcheck disable=SC1091
source "$work/slurm/env"

# A port for the coordinator: not the default 50051, which lies in the kernel's ephemeral
# range (another test's connection or listener can hold it), but one below that range that
# nothing listens on now.
coordinator_port() {
  local lo hi p
  read -r lo hi < /proc/sys/net/ipv4/ip_local_port_range
  for _ in $(seq 1 200); do
    p=$(( 20000 + RANDOM % 10000 ))
    if (( p >= lo && p <= hi )); then continue; fi
    if ! ss -Htln "sport = :$p" 2>/dev/null | grep -q .; then echo "$p"; return; fi
  done
  echo 50051
}

# Renders NAME's scripts: a 6-step float64 tiny run on a small synthetic set in this test's
# directory; workers advertise the loopback interface (the nodes share this host). The --set
# flags given win over these; the coordinator's port is left in $port.
render() {  # NAME [--set KEY=VALUE ...]
  local name=$1
  shift
  port=$(coordinator_port)
  "$bin/hetpar" deploy slurm --config "$repo/configs/tiny.yaml" --out "$work/$name" \
    --interface lo --cpus-per-rank 1 --bin-dir "$bin" --port "$port" \
    --set run.steps=6 --set run.dtype=float64 \
    --set data.manifest="$work/data/train.jsonl" --set data.val_manifest="$work/data/val.jsonl" \
    --set data.tokenizer="$work/data/tokenizer.model" \
    --set data.synth.samples=64 --set data.synth.val_samples=4 "$@" >/dev/null
}

# Submits SCRIPT with extra exported variables; prints the job id.
submit() {
  local script=$1
  shift
  local exports="ALL,HETPAR_COORDINATOR_HOST=127.0.0.1"
  for e in "$@"; do exports="$exports,$e"; done
  sbatch --parsable --export="$exports" "$script" | cut -d';' -f1
}

check_run() {  # RUN_DIR [REFERENCE_DIR]
  local dir=$1 reference=${2:-$work/reference}
  grep -q '"step":5' "$dir/metrics.jsonl" || fail "$dir/metrics.jsonl has no step 5"
  grep -q '"final_params"' "$dir/metrics.jsonl" || fail "$dir/metrics.jsonl has no final_params"
  [ -f "$dir/model/encoder.hpar" ] && [ -f "$dir/model/llm.hpar" ] || fail "no model files in $dir"
  "$bin/hetpar" compare "$dir" "$reference" >"$dir/compare.txt" 2>&1 ||
    fail "hetpar compare $dir against the reference: $(cat "$dir/compare.txt")"
}

# Waits (at most 5 minutes) until JOB's run in RUN_DIR has committed its second step (step 1);
# fails, naming WHAT, when the job ends first.
await_second_step() {  # JOB RUN_DIR WHAT
  local job=$1 dir=$2 what=$3
  for _ in $(seq 1 600); do
    grep -q '"step":1' "$dir/metrics.jsonl" 2>/dev/null && return 0
    squeue -h -j "$job" 2>/dev/null | grep -q . || fail "$what job $job ended before its second step"
    sleep 0.5
  done
  fail "$what job $job committed no second step"
}

# The nodes the tasks of RUN_DIR's step NAME ran on, one per line: each task's log begins with
# "hetpar: task T of step S on node N".
task_nodes() {  # RUN_DIR NAME
  cat "$1/log/$2"-*.log 2>/dev/null | sed -n 's/^hetpar: task [0-9]* of step .* on node //p' |
    sort -u
}

# With --ranks-per-node 2 each worker step runs on exactly one node (the encoder pool's 2 ranks,
# the LLM's replica of tp 2); in one allocation (DISTINCT=1) the two are the job's two nodes.
# (Slurm may put both components of a heterogeneous job on one node.)
check_whole_nodes() {  # RUN_DIR DISTINCT
  local enc llm distinct=$2
  enc=$(task_nodes "$1" encoder)
  llm=$(task_nodes "$1" llm)
  [ -n "$enc" ] && [ -n "$llm" ] ||
    fail "no task log names its node (encoder: '$enc', llm: '$llm')"
  [ "$(printf '%s\n' "$enc" | wc -l)" -eq 1 ] && [ "$(printf '%s\n' "$llm" | wc -l)" -eq 1 ] ||
    fail "a step's tasks ran on more than one node: encoder on $enc; llm on $llm"
  [ "$distinct" = 0 ] || [ "$enc" != "$llm" ] ||
    fail "the encoder's and the LLM's steps both ran on $enc; expected a node each"
}

# 1. One allocation, on whole nodes.
render run --ranks-per-node 2
grep -q '^#SBATCH --nodes=2$' "$work/run/hetpar.sbatch" || fail "no --nodes=2 in hetpar.sbatch"
job=$(submit "$work/run/hetpar.sbatch")
"$here/local_slurm.sh" wait-job "$work/slurm" "$job" 600 || fail "job $job did not complete"
check_whole_nodes "$work/run" 1
grep -q "hetpar: run done" "$work/run/slurm-$job.out" || fail "no 'run done' in the job's log"
"$bin/hetpar" run --reference --config "$work/run/run.yaml" --out "$work/reference" \
  >"$work/reference.log" 2>&1 || fail "reference run: $(tail -n 5 "$work/reference.log")"
check_run "$work/run"
echo "slurm_run_test: single allocation: job $job completed and matches the reference"

# 2. The heterogeneous job, on whole nodes, each rank asking for memory.
render run-het --ranks-per-node 2 --memory-per-rank 256M
grep -q '^#SBATCH --mem-per-cpu=256M$' "$work/run-het/hetpar-het.sbatch" ||
  fail "no --mem-per-cpu=256M in hetpar-het.sbatch"
sbatch --test-only "$work/run-het/hetpar-het.sbatch" >"$work/het-test-only.txt" 2>&1 ||
  fail "sbatch --test-only refused the heterogeneous script: $(cat "$work/het-test-only.txt")"
job=$(submit "$work/run-het/hetpar-het.sbatch")
"$here/local_slurm.sh" wait-job "$work/slurm" "$job" 600 || fail "het job $job did not complete"
check_whole_nodes "$work/run-het" 0
check_run "$work/run-het"
echo "slurm_run_test: heterogeneous job: job $job completed and matches the reference"

# 3. Pipeline stages: an LLM task takes its rank from its replica and local rank (a node holds
# one DP replica's ranks of every stage); the ranks are the layout's, and the run matches.
render run-pp --set llm.layout.dp=2 --set llm.layout.tp=1 --set llm.layout.pp=2
job=$(submit "$work/run-pp/hetpar.sbatch")
"$here/local_slurm.sh" wait-job "$work/slurm" "$job" 600 || fail "pp job $job did not complete"
"$bin/hetpar" run --reference --config "$work/run-pp/run.yaml" --out "$work/reference-pp" \
  >"$work/reference-pp.log" 2>&1 || fail "pp reference run: $(tail -n 5 "$work/reference-pp.log")"
check_run "$work/run-pp" "$work/reference-pp"
echo "slurm_run_test: pipeline stages: job $job completed and matches the reference"

# 4. A failing step ends the job and is named.
render run-fail
job=$(submit "$work/run-fail/hetpar.sbatch" HETPAR_TIMEOUT=not-a-number)
if "$here/local_slurm.sh" wait-job "$work/slurm" "$job" 300 >/dev/null; then
  fail "job $job with failing workers completed"
fi
grep -Eq "hetpar: job step '(encoder|llm)' failed with exit code 2" "$work/run-fail/slurm-$job.out" ||
  fail "the failed job's log does not name the failing step"
echo "slurm_run_test: failing workers: job $job failed, naming the step"

# 5. A run stopped early: the coordinator exits 0, and the job's log says stopped, not done.
render run-stop --set run.steps=100000
job=$(submit "$work/run-stop/hetpar.sbatch")
await_second_step "$job" "$work/run-stop" stop
"$bin/hetpar" stop --coordinator "127.0.0.1:$port" --token-file "$work/run-stop/token" \
  --reason "slurm_run_test" --timeout 30 >"$work/stop.log" 2>&1 ||
  fail "hetpar stop: $(cat "$work/stop.log")"
"$here/local_slurm.sh" wait-job "$work/slurm" "$job" 300 || fail "stopped job $job did not complete"
grep -Eq "hetpar: run stopped after [0-9]+ of 100000 steps" "$work/run-stop/slurm-$job.out" ||
  fail "the stopped job's log does not say the run stopped"
if grep -q "hetpar: run done" "$work/run-stop/slurm-$job.out"; then
  fail "the stopped job's log says the run is done"
fi
echo "slurm_run_test: stopped run: job $job completed, saying the run stopped"

# 6. Near its time limit the run stops by itself: --stop-before-limit 90 of a 2-minute job, so
# about 30 s in the script has the coordinator stop the run after a checkpoint of the step in
# flight, and the job completes saying the run stopped. A stop that does not fit the limit is
# refused at rendering.
if "$bin/hetpar" deploy slurm --config "$repo/configs/tiny.yaml" --out "$work/limit-refused" \
  --bin-dir "$bin" --time 00:01:00 --stop-before-limit 60 >"$work/limit-refused.log" 2>&1; then
  fail "a stop before the limit as long as the limit was rendered"
fi
grep -q "stop-before-limit 60 s is not shorter than the job's time limit (--time 00:01:00, 60 s)" \
  "$work/limit-refused.log" || fail "the refusal of --stop-before-limit: $(cat "$work/limit-refused.log")"
render run-limit --time 00:02:00 --stop-before-limit 90 --set run.steps=100000 \
  --set checkpoint.dir="$work/run-limit/checkpoints"
job=$(submit "$work/run-limit/hetpar.sbatch")
"$here/local_slurm.sh" wait-job "$work/slurm" "$job" 300 || fail "time-limit job $job did not complete"
out="$work/run-limit/slurm-$job.out"
grep -q "hetpar: the job is near its time limit: stopping the run after a checkpoint" "$out" ||
  fail "the job's log does not say it stops for its time limit"
grep -Eq "hetpar: run stopped after [0-9]+ of 100000 steps" "$out" ||
  fail "the time-limited job's log does not say the run stopped"
ls "$work"/run-limit/checkpoints/step-*/manifest.json >/dev/null 2>&1 ||
  fail "the run stopped for the time limit wrote no checkpoint"
echo "slurm_run_test: time limit: job $job stopped the run after a checkpoint before its limit"

# 7. An encoder task killed mid-run (as the kernel's OOM killer would): encoder replica 1 leaves,
# the run goes on over replica 0 to its last step, and the job completes: the encoder step's
# failure is named in the job's log but does not end the job (--kill-on-bad-exit=0 keeps the
# step's other task, and the coordinator decides).
render run-loss --set run.steps=60
job=$(submit "$work/run-loss/hetpar.sbatch")
await_second_step "$job" "$work/run-loss" loss
# Encoder rank 1 of this job: its command line, and the run directory in its environment (other
# tests may run encoders of their own meanwhile).
victim=""
for pid in $(pgrep -f "hetpar-encoder --rank 1$" || true); do
  if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "HETPAR_OUT=$work/run-loss"; then
    victim=$pid
  fi
done
[ -n "$victim" ] || fail "no encoder task of rank 1 to kill in job $job"
kill -KILL "$victim"
"$here/local_slurm.sh" wait-job "$work/slurm" "$job" 600 ||
  fail "job $job failed after losing an encoder task: $(tail -n 5 "$work/run-loss/slurm-$job.out")"
out="$work/run-loss/slurm-$job.out"
grep -q "hetpar: job step 'encoder' ended with exit code" "$out" ||
  fail "the job's log does not name the encoder step's failure"
grep -q "hetpar: run done" "$out" || fail "the job with a lost encoder task did not finish the run"
grep -q '"step":59' "$work/run-loss/metrics.jsonl" || fail "the run lost its last steps"
grep -q '"pool_change"' "$work/run-loss/metrics.jsonl" ||
  fail "the run's metrics record no pool change for the lost replica"
echo "slurm_run_test: lost encoder task: job $job completed over the other replica"
