// `hetpar deploy slurm`: batch scripts of one run (see deploy.h and docs/deploy.md).
#include <algorithm>
#include <cctype>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/control/security.h"
#include "coordinator/deploy/deploy.h"

namespace hetpar::deploy {
namespace {

// Single quotes for the shell.
std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out.push_back(c);
    }
  }
  return out + "'";
}

// Seconds of a Slurm time limit (sbatch --time): "M", "M:S", "H:M:S", "D-H", "D-H:M" or
// "D-H:M:S"; nullopt for anything else ("UNLIMITED" included).
std::optional<int64_t> TimeLimitSeconds(const std::string& text) {
  int64_t days = 0;
  std::string rest = text;
  const size_t dash = text.find('-');
  if (dash != std::string::npos) {
    if (!absl::SimpleAtoi(text.substr(0, dash), &days) || days < 0) return std::nullopt;
    rest = text.substr(dash + 1);
  }
  std::vector<int64_t> parts;
  for (absl::string_view part : absl::StrSplit(rest, ':')) {
    int64_t value = 0;
    if (part.empty() || !absl::SimpleAtoi(part, &value) || value < 0) return std::nullopt;
    parts.push_back(value);
  }
  if (parts.empty() || parts.size() > 3) return std::nullopt;
  if (dash != std::string::npos) {  // D-H, D-H:M, D-H:M:S
    while (parts.size() < 3) parts.push_back(0);
    return ((days * 24 + parts[0]) * 60 + parts[1]) * 60 + parts[2];
  }
  switch (parts.size()) {
    case 1:
      return parts[0] * 60;  // minutes
    case 2:
      return parts[0] * 60 + parts[1];  // minutes:seconds
    default:
      return (parts[0] * 60 + parts[1]) * 60 + parts[2];  // hours:minutes:seconds
  }
}

// MiB of a Slurm memory size (sbatch --mem: a number with an optional K, M, G or T suffix, in
// either case and optionally followed by B, powers of 1024, M by default); nullopt for anything
// else, 0 for zero.
std::optional<int64_t> MemoryMiB(std::string text) {
  if (!text.empty() && (text.back() == 'B' || text.back() == 'b') && text.size() > 1 &&
      std::isalpha(static_cast<unsigned char>(text[text.size() - 2]))) {
    text.pop_back();  // 96GB, 96gb
  }
  if (text.empty()) return std::nullopt;
  int64_t per_unit_kib = 1024;  // M
  switch (std::toupper(static_cast<unsigned char>(text.back()))) {
    case 'K': per_unit_kib = 1; break;
    case 'M': per_unit_kib = 1024; break;
    case 'G': per_unit_kib = 1024 * 1024; break;
    case 'T': per_unit_kib = int64_t{1024} * 1024 * 1024; break;
    default:
      if (!std::isdigit(static_cast<unsigned char>(text.back()))) return std::nullopt;
  }
  if (!std::isdigit(static_cast<unsigned char>(text.back()))) text.pop_back();
  int64_t value = 0;
  if (text.empty() || text[0] == '-' || text[0] == '+' || !absl::SimpleAtoi(text, &value) ||
      value < 0 || value > (int64_t{1} << 40) / per_unit_kib) {
    return std::nullopt;
  }
  return (value * per_unit_kib + 1023) / 1024;
}

// How a module's tasks lie on whole nodes (DeployOptions::ranks_per_node): as many whole
// replicas per node as fit, so that none straddles two nodes.
struct NodeTiling {
  int64_t tasks_per_node = 0;  // 0: not tiled (Slurm places the tasks)
  int64_t nodes = 0;
};

NodeTiling Tile(const ModuleShape& shape, int64_t ranks_per_node) {
  if (ranks_per_node <= 0 || shape.replicas == 0) return {};
  // >= 1: PlacementProblems refuses a replica larger than a node.
  const int64_t replicas_per_node =
      std::min(shape.replicas, ranks_per_node / shape.ranks_per_replica);
  return {replicas_per_node * shape.ranks_per_replica,
          (shape.replicas + replicas_per_node - 1) / replicas_per_node};
}

struct Job {
  std::string name;
  int64_t encoder_ranks = 0;  // 0 when colocated
  int64_t llm_ranks = 0;      // colocated: the shared ranks
  bool colocated = false;
  ModuleShape llm;  // the LLM's (colocated: the shared ranks') replicas and stages
  NodeTiling encoder_nodes;  // whole nodes (ranks_per_node > 0), else unset
  NodeTiling llm_nodes;
  bool tiled() const { return llm_nodes.tasks_per_node > 0; }
  int64_t mem_per_cpu_mib = 0;  // 0: no memory request
};

// The part both scripts share after the #SBATCH lines: paths, the token, the coordinator's
// address, and the function that starts a step and the loop that waits for them.
std::string Prologue(const DeployOptions& options, const std::string& config,
                     const std::string& head_nodes, bool tiled) {
  std::string s = absl::StrCat(
      "set -euo pipefail\n\n", "BIN=", Quote(options.bin_dir), "\n",
      "RUN_DIR=", Quote(options.run_dir), "\n", "CONFIG=", Quote(config), "\n",
      "PORT=", options.coordinator_port, "\n\n", "mkdir -p \"$RUN_DIR/log\"\n",
      "# A fresh run token for every job, readable by its user only; the steps read the file\n",
      "# (never a command-line argument that ps would show).\n",
      "export HETPAR_TOKEN_FILE=\"$RUN_DIR/token\"\n",
      "(umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \\n' > \"$HETPAR_TOKEN_FILE\")\n",
      "# The coordinator runs on the first node; HETPAR_COORDINATOR_HOST overrides the address\n",
      "# the workers dial (e.g. an IP when node names do not resolve).\n",
      "head_node=$(scontrol show hostnames \"", head_nodes, "\" | head -n 1)\n",
      "export HETPAR_COORDINATOR=\"${HETPAR_COORDINATOR_HOST:-$head_node}:$PORT\"\n",
      "export HETPAR_OUT=\"$RUN_DIR\"\n", "export HETPAR_THREADS=\"${SLURM_CPUS_PER_TASK:-",
      options.cpus_per_rank, "}\"\n",
      "# The job's own GPU request (#SBATCH --gpus) is exported to every srun, which would read "
      "it\n",
      "# as its step's: each step asks for its own GPUs (or none) instead.\n",
      "unset SLURM_GPUS SLURM_GPUS_PER_NODE SLURM_GPUS_PER_TASK SLURM_TRES_PER_TASK\n",
      "# The same for the job's task shape (#SBATCH --ntasks-per-node): each step gives its own.\n",
      "unset SLURM_NTASKS_PER_NODE\n");
  if (!options.interface.empty()) {
    absl::StrAppend(&s, "# Workers advertise this interface's address to their peers.\n",
                    "export HETPAR_INTERFACE=", Quote(options.interface), "\n");
  }
  // One line of the script per string.
  // clang-format off
  absl::StrAppend(
      &s, "\n",
      "# Every step in the background; the job ends when all are done, or when the coordinator's\n",
      "# step fails or a worker step refuses its flags or config (exit 2), naming it. A worker\n",
      "# step whose tasks fail otherwise (a lost DP replica) is named, and the coordinator\n",
      "# decides whether the run goes on without them (--kill-on-bad-exit=0: one task's failure\n",
      "# does not end its step's other tasks).\n",
      "declare -A step_names=()\n",
      "start_step() {  # NAME SRUN-ARGS...\n",
      "  local name=$1\n",
      "  shift\n",
      "  srun --job-name=\"$name\" --output=\"$RUN_DIR/log/$name-%t.log\" \\\n",
      "    --cpus-per-task=\"${SLURM_CPUS_PER_TASK:-", options.cpus_per_rank, "}\" \"$@\" &\n",
      "  step_names[$!]=$name\n",
      "  echo \"hetpar: started job step '$name' (pid $!)\"\n",
      "}\n",
      "# The run stops by itself near the job's time limit: STOP_BEFORE seconds before the end\n",
      "# time squeue gives, the coordinator's step alone gets SIGTERM (scancel --signal), so that\n",
      "# the step in flight commits with a checkpoint and the run stops; submitting the script\n",
      "# again continues it. (Slurm's own --signal would reach every srun too, and srun ends its\n",
      "# step on SIGTERM.)\n",
      "STOP_BEFORE=", options.stop_before_limit_s, "\n",
      "stop_before_time_limit() {\n",
      "  local end step\n",
      "  # (A heterogeneous job lists a line per component; they end together.)\n",
      "  # (squeue fails while slurmctld is busy: tried again, not left to end this function.)\n",
      "  for _ in 1 2 3 4 5; do\n",
      "    end=$(squeue -h -j \"$SLURM_JOB_ID\" -o %e 2>/dev/null | head -n 1 || true)\n",
      "    if [ -n \"$end\" ]; then break; fi\n",
      "    sleep 5\n",
      "  done\n",
      "  case \"$end\" in  # 2026-12-06T17:00:00; N/A, Unknown or nothing: no limit to stop before\n",
      "    [0-9][0-9][0-9][0-9]-*T*) end=$(date -d \"$end\" +%s) || return 0 ;;\n",
      "    *) return 0 ;;\n",
      "  esac\n",
      "  sleep $((end - STOP_BEFORE > $(date +%s) ? end - STOP_BEFORE - $(date +%s) : 0))\n",
      "  echo \"hetpar: the job is near its time limit: stopping the run after a checkpoint\"\n",
      "  for _ in 1 2 3 4 5 6 7 8 9 10; do\n",
      "    step=$(squeue -h --steps -j \"$SLURM_JOB_ID\" -o '%i %j' 2>/dev/null |\n",
      "      awk '$2 == \"coordinator\" { print $1; exit }' || true)\n",
      "    if [ -n \"$step\" ] && scancel --signal=TERM \"$step\"; then return 0; fi\n",
      "    sleep 3\n",
      "  done\n",
      "  echo \"hetpar: found no coordinator step to stop before the time limit\" >&2\n",
      "}\n");
  // clang-format on
  if (tiled) {
    absl::StrAppend(
        &s,
        "# Whole nodes: a step's tasks go to the nodes its host file lists, one line per task\n",
        "# in rank order (srun --distribution=arbitrary), so that each node holds whole\n",
        "# replicas and no replica straddles two nodes.\n",
        "write_hosts() {  # FILE NODELIST TASKS-PER-NODE TASKS\n",
        "  local file=$1 per=$3 tasks=$4 node t n=0\n", "  : > \"$file\"\n",
        "  for node in $(scontrol show hostnames \"$2\"); do\n",
        "    for ((t = 0; t < per && n < tasks; t++, n++)); do echo \"$node\" >> \"$file\"; done\n",
        "  done\n", "  if [ \"$n\" -lt \"$tasks\" ]; then\n",
        "    echo \"hetpar: the job's nodes ($2) hold $n of the $tasks tasks of $file\" >&2\n",
        "    exit 1\n", "  fi\n", "}\n");
  }
  return s;
}

// The flags of a worker step on whole nodes: its tasks' host file (SLURM_HOSTFILE, written
// from `nodes`, a node list expression of the script), or nothing when not tiled.
std::string TiledStep(const std::string& name, const NodeTiling& tiling, int64_t tasks,
                      const std::string& nodes) {
  if (tiling.tasks_per_node == 0) return "";
  return absl::StrCat("write_hosts \"$RUN_DIR/hosts-", name, "\" \"", nodes, "\" ",
                      tiling.tasks_per_node, " ", tasks, "\n", "SLURM_HOSTFILE=\"$RUN_DIR/hosts-",
                      name, "\" ");
}

// A worker step's command: its rank is the task's SLURM_PROCID within the step. With pipeline
// stages (`staged`), consecutive tasks (a node's, in Slurm's block distribution) are one DP
// replica's ranks of every stage instead (worker::RankRequest), as a Kubernetes pod's are. Each
// task's log begins with the node it runs on.
std::string WorkerCommand(const std::string& binary, bool colocated, const DeployOptions& options,
                          const ModuleShape* staged = nullptr) {
  std::string host = options.interface.empty() ? " --host \"$SLURMD_NODENAME\"" : "";
  std::string rank = "--rank \"$SLURM_PROCID\"";
  if (staged != nullptr && staged->pipeline_stages > 1) {
    const int64_t r = staged->ranks_per_replica;
    rank = absl::StrCat("--replica $((SLURM_PROCID / ", r, ")) --ranks-per-replica ", r,
                        " --local-rank $((SLURM_PROCID % ", r, ")) --replicas ", staged->replicas,
                        " --pipeline-stages ", staged->pipeline_stages);
  }
  return absl::StrCat(
      "bash -c 'echo \"hetpar: task $SLURM_PROCID of step $SLURM_STEP_ID on node "
      "$SLURMD_NODENAME\" >&2; exec \"$0\" ",
      rank, host, " \"$@\"' \"$BIN/", binary, "\"", colocated ? " --colocated" : "");
}

std::string WaitLoop() {
  return R"sh(
stop_before_time_limit &
timer_pid=$!
status=0
while [ ${#step_names[@]} -gt 0 ]; do
  # The first step that ended (bash 4 has no wait -n -p): its pid no longer answers once bash
  # has reaped it, and wait PID then gives its exit code.
  finished=""
  for pid in "${!step_names[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then finished=$pid; break; fi
  done
  if [ -z "$finished" ]; then
    sleep 1
    continue
  fi
  code=0
  wait "$finished" || code=$?
  name=${step_names[$finished]}
  unset "step_names[$finished]"
  if [ "$code" -ne 0 ] && [ "$status" -eq 0 ] &&
    { [ "$name" = coordinator ] || [ "$code" -eq 2 ]; }; then
    # The coordinator's verdict on the run, or a worker's refusal of its flags or config (exit
    # 2): the job ends.
    echo "hetpar: job step '$name' failed with exit code $code (logs: $RUN_DIR/log/$name-*.log); ending the job" >&2
    status=1
    for pid in "${!step_names[@]}"; do kill "$pid" 2>/dev/null || true; done
  elif [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
    # A worker step whose tasks ended with a failure (a lost DP replica's ranks exit 1): the
    # coordinator decides whether the run goes on without them, and its step's end ends the job.
    echo "hetpar: job step '$name' ended with exit code $code (logs: $RUN_DIR/log/$name-*.log); the coordinator decides whether the run goes on without its failed tasks" >&2
  elif [ "$status" -ne 0 ]; then
    echo "hetpar: job step '$name' ended (exit code $code)"
  else
    echo "hetpar: job step '$name' done"
  fi
done
kill "$timer_pid" 2>/dev/null || true
if [ "$status" -eq 0 ]; then
  # The coordinator exits 0 for a run stopped early (hetpar stop) too: its journal tells them apart.
  # (|| true: under set -e a missing journal must reach the "unreadable" line, not end the job.)
  journal_field() { sed -n "s/^ *\"$1\": *\([0-9]*\).*/\1/p" "$RUN_DIR/journal.json" 2>/dev/null || true; }
  committed=$(journal_field committed_steps)
  total=$(journal_field total_steps)
  if [ -n "$committed" ] && [ "$committed" = "$total" ]; then
    echo "hetpar: run done; run directory $RUN_DIR"
  elif [ -n "$committed" ] && [ -n "$total" ]; then
    echo "hetpar: run stopped after $committed of $total steps; submitting this script again continues it from its newest checkpoint, or starts it over without checkpoint.dir (the coordinator's log says which: $RUN_DIR/log/coordinator-0.log)"
  else
    echo "hetpar: run ended; its journal ($RUN_DIR/journal.json) is unreadable, so whether it finished is unknown (see $RUN_DIR/log/coordinator-0.log)"
  fi
fi
exit "$status"
)sh";
}

std::string CommonDirectives(const Job& job, const DeployOptions& options) {
  std::string s = absl::StrCat("#SBATCH --job-name=hetpar-", job.name, "\n",
                               "#SBATCH --output=", options.run_dir, "/slurm-%j.out\n",
                               "#SBATCH --time=", options.time_limit, "\n");
  if (!options.partition.empty())
    absl::StrAppend(&s, "#SBATCH --partition=", options.partition, "\n");
  return s;
}

// A component's memory: each rank's (--memory-per-rank) spread over its CPUs, which every step
// takes from the batch environment (SLURM_MEM_PER_CPU); nothing without --memory-per-rank.
std::string MemoryDirective(const Job& job) {
  return job.mem_per_cpu_mib > 0
             ? absl::StrCat("#SBATCH --mem-per-cpu=", job.mem_per_cpu_mib, "M\n")
             : std::string();
}

// A worker step's own srun flags: its tasks' GPUs, and one task's failure not ending the step's
// other tasks (whatever the site's KillOnBadExit): whether the run goes on without a lost DP
// replica is the coordinator's to decide.
std::string WorkerStepFlags(const DeployOptions& options) {
  return absl::StrCat(" --kill-on-bad-exit=0",
                      options.device == Device::kGpu ? " --gpus-per-task=1" : "");
}

// A step that asks for no GRES is given all of the job's on its node: the coordinator would
// hold the head node's GPUs and the workers' steps there would wait for them forever.
std::string NoGpuFlag(const DeployOptions& options) {
  return options.device == Device::kGpu ? " --gres=none" : "";
}

std::string SingleAllocation(const Job& job, const DeployOptions& options,
                             const std::string& config) {
  const int64_t workers = job.encoder_ranks + job.llm_ranks;
  std::string s = absl::StrCat(
      "#!/bin/bash\n", "# hetpar run '", job.name,
      "' as one Slurm allocation, rendered by `hetpar deploy slurm`:\n", "# the coordinator, ",
      job.colocated
          ? absl::StrCat(job.llm_ranks, " colocated ranks")
          : absl::StrCat(job.encoder_ranks, " encoder ranks and ", job.llm_ranks, " LLM ranks"),
      " run as job steps. Submit with: sbatch ", options.run_dir, "/hetpar.sbatch\n",
      CommonDirectives(job, options));
  if (job.tiled()) {
    // Whole nodes, the encoder's first, then the LLM's; the coordinator shares the first.
    const int64_t per_node =
        std::max(job.encoder_nodes.tasks_per_node, job.llm_nodes.tasks_per_node);
    absl::StrAppend(&s, "#SBATCH --nodes=", job.encoder_nodes.nodes + job.llm_nodes.nodes, "\n",
                    "#SBATCH --ntasks-per-node=", per_node, "\n",
                    "#SBATCH --cpus-per-task=", options.cpus_per_rank, "\n",
                    MemoryDirective(job));
    if (options.device == Device::kGpu) {
      absl::StrAppend(&s, "#SBATCH --gpus-per-node=", per_node, "\n");
    }
  } else {
    absl::StrAppend(&s, "#SBATCH --ntasks=", workers + 1, "\n",
                    "#SBATCH --cpus-per-task=", options.cpus_per_rank, "\n",
                    MemoryDirective(job));
    if (options.device == Device::kGpu) absl::StrAppend(&s, "#SBATCH --gpus=", workers, "\n");
  }
  absl::StrAppend(&s, "\n", Prologue(options, config, "$SLURM_JOB_NODELIST", job.tiled()), "\n");
  if (job.tiled()) {
    absl::StrAppend(&s,
                    "mapfile -t job_nodes < <(scontrol show hostnames \"$SLURM_JOB_NODELIST\")\n",
                    "encoder_nodes=$(IFS=,; echo \"${job_nodes[*]:0:", job.encoder_nodes.nodes,
                    "}\")\n", "llm_nodes=$(IFS=,; echo \"${job_nodes[*]:", job.encoder_nodes.nodes,
                    ":", job.llm_nodes.nodes, "}\")\n");
  }
  absl::StrAppend(&s,
                  "start_step coordinator --exact --ntasks=1 --nodes=1 --nodelist=\"$head_node\"",
                  job.tiled() ? " --overlap" : "", NoGpuFlag(options),
                  " \"$BIN/hetpar\" coordinator --config \"$CONFIG\" --listen \"0.0.0.0:$PORT\" "
                  "--out \"$RUN_DIR\"\n");
  const std::string arbitrary = job.tiled() ? " --distribution=arbitrary" : "";
  if (job.colocated) {
    absl::StrAppend(&s, TiledStep("colocated", job.llm_nodes, job.llm_ranks, "$llm_nodes"),
                    "start_step colocated --exact", WorkerStepFlags(options), arbitrary,
                    " --ntasks=", job.llm_ranks, " ", WorkerCommand("hetpar-llm", true, options),
                    "\n");
  } else {
    absl::StrAppend(&s,
                    TiledStep("encoder", job.encoder_nodes, job.encoder_ranks, "$encoder_nodes"),
                    "start_step encoder --exact", WorkerStepFlags(options), arbitrary,
                    " --ntasks=", job.encoder_ranks, " ",
                    WorkerCommand("hetpar-encoder", false, options), "\n");
    absl::StrAppend(&s, TiledStep("llm", job.llm_nodes, job.llm_ranks, "$llm_nodes"),
                    "start_step llm --exact", WorkerStepFlags(options), arbitrary,
                    " --ntasks=", job.llm_ranks, " ",
                    WorkerCommand("hetpar-llm", false, options, &job.llm), "\n");
  }
  absl::StrAppend(&s, WaitLoop());
  return s;
}

// Component 0: the encoder nodes. Component 1: the LLM nodes, and the coordinator on the first.
std::string Heterogeneous(const Job& job, const DeployOptions& options, const std::string& config) {
  std::string s = absl::StrCat("#!/bin/bash\n", "# hetpar run '", job.name,
                               "' as a heterogeneous Slurm job, rendered by `hetpar deploy ",
                               "slurm`:\n# component 0 holds the encoder pool (", job.encoder_ranks,
                               " ranks), component 1 the LLM ranks (", job.llm_ranks,
                               ") and the coordinator. Submit with: sbatch ", options.run_dir,
                               "/hetpar-het.sbatch\n", CommonDirectives(job, options));
  // A component's tasks: whole nodes, or a task count (the LLM's, with the coordinator's); its
  // GPUs, one per worker rank (the coordinator's task takes none).
  const auto component = [&](const NodeTiling& tiling, int64_t tasks, int64_t gpus) {
    std::string c;
    if (job.tiled()) {
      absl::StrAppend(&c, "#SBATCH --nodes=", tiling.nodes, "\n",
                      "#SBATCH --ntasks-per-node=", tiling.tasks_per_node, "\n");
    } else {
      absl::StrAppend(&c, "#SBATCH --ntasks=", tasks, "\n");
    }
    absl::StrAppend(&c, "#SBATCH --cpus-per-task=", options.cpus_per_rank, "\n",
                    MemoryDirective(job));
    if (options.device == Device::kGpu) {
      absl::StrAppend(
          &c, job.tiled() ? absl::StrCat("#SBATCH --gpus-per-node=", tiling.tasks_per_node, "\n")
                          : absl::StrCat("#SBATCH --gpus=", gpus, "\n"));
    }
    return c;
  };
  absl::StrAppend(&s, component(job.encoder_nodes, job.encoder_ranks, job.encoder_ranks),
                  "#SBATCH hetjob\n", component(job.llm_nodes, job.llm_ranks + 1, job.llm_ranks));
  absl::StrAppend(&s, "\n",
                  Prologue(options, config, "$SLURM_JOB_NODELIST_HET_GROUP_1", job.tiled()), "\n");
  absl::StrAppend(&s,
                  "start_step coordinator --het-group=1 --exact --ntasks=1 --nodes=1 "
                  "--nodelist=\"$head_node\"",
                  job.tiled() ? " --overlap" : "", NoGpuFlag(options),
                  " \"$BIN/hetpar\" coordinator --config \"$CONFIG\" "
                  "--listen \"0.0.0.0:$PORT\" --out \"$RUN_DIR\"\n");
  const std::string arbitrary = job.tiled() ? " --distribution=arbitrary" : "";
  absl::StrAppend(
      &s,
      TiledStep("encoder", job.encoder_nodes, job.encoder_ranks, "$SLURM_JOB_NODELIST_HET_GROUP_0"),
      "start_step encoder --het-group=0 --exact", WorkerStepFlags(options), arbitrary,
      " --ntasks=", job.encoder_ranks, " ", WorkerCommand("hetpar-encoder", false, options), "\n");
  absl::StrAppend(&s,
                  TiledStep("llm", job.llm_nodes, job.llm_ranks, "$SLURM_JOB_NODELIST_HET_GROUP_1"),
                  "start_step llm --het-group=1 --exact", WorkerStepFlags(options), arbitrary,
                  " --ntasks=", job.llm_ranks, " ",
                  WorkerCommand("hetpar-llm", false, options, &job.llm), "\n");
  absl::StrAppend(&s, WaitLoop());
  return s;
}

}  // namespace

absl::StatusOr<std::vector<RenderedFile>> RenderSlurm(const config::LoadedRunSpec& loaded,
                                                      const DeployOptions& options) {
  if (std::vector<std::string> problems = PlacementProblems(loaded, options); !problems.empty()) {
    return absl::InvalidArgumentError(absl::StrJoin(problems, "\n"));
  }
  if (options.bin_dir.empty() || options.run_dir.empty() || options.bin_dir[0] != '/' ||
      options.run_dir[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat("the binaries' directory ('", options.bin_dir,
                                                   "') and the run directory ('", options.run_dir,
                                                   "') must be absolute paths every node sees"));
  }
  const std::optional<int64_t> limit = TimeLimitSeconds(options.time_limit);
  if (!limit.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--time '", options.time_limit,
                     "': expected minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S (e.g. 1-00:00:00)"));
  }
  if (options.stop_before_limit_s >= *limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stop-before-limit ", options.stop_before_limit_s,
                     " s is not shorter than the job's time limit (--time ", options.time_limit,
                     ", ", *limit, " s): the run would stop as it starts"));
  }
  const v1::RunSpec& spec = loaded.spec;
  if (const std::string& metrics = spec.coordinator().metrics_listen();
      !metrics.empty() && coordinator::PortOf(metrics) == options.coordinator_port) {
    return absl::InvalidArgumentError(absl::StrCat(
        "coordinator.metrics_listen: ='", metrics, "' is the coordinator's gRPC port (--port ",
        options.coordinator_port, "); expected a port of its own, e.g. 0.0.0.0:9464 (",
        loaded.source.Where("coordinator.metrics_listen"), ")"));
  }
  Job job;
  job.name = ObjectName(spec.run().name());
  job.colocated = spec.placement() == v1::PLACEMENT_COLOCATED;
  const ModuleShape encoder = EncoderShape(spec);
  const ModuleShape llm = LlmShape(spec);
  job.llm_ranks = llm.replicas * llm.ranks_per_replica;
  job.llm = llm;
  job.encoder_ranks = job.colocated ? 0 : encoder.replicas * encoder.ranks_per_replica;
  if (!options.memory_per_rank.empty()) {
    const std::optional<int64_t> mib = MemoryMiB(options.memory_per_rank);
    if (!mib.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--memory-per-rank '", options.memory_per_rank,
          "': expected a Slurm memory size, a number with K, M, G or T (powers of 1024; M when "
          "none), e.g. 96G"));
    }
    if (*mib == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--memory-per-rank '", options.memory_per_rank, "' must be more than 0"));
    }
    job.mem_per_cpu_mib = (*mib + options.cpus_per_rank - 1) / options.cpus_per_rank;
  }
  const int64_t ranks_per_node = RanksPerNode(options);
  if (ranks_per_node > 0) {
    // What must not straddle two nodes: a DP replica (an encoder's, or an LLM's with all its
    // stages, consecutive tasks). Colocated ranks run pp outermost, so there it is a TP x CP
    // group of the LLM and a TP group of the encoder (pipeline stages may span nodes).
    ModuleShape unit = llm;
    if (job.colocated) {
      const auto& l = spec.llm().layout();
      const int64_t group =
          std::lcm(l.tp() * l.cp(), std::max<int64_t>(1, encoder.ranks_per_replica));
      unit = {job.llm_ranks / group, group, 1};
    }
    std::vector<std::string> problems;
    if (unit.ranks_per_replica > ranks_per_node) {
      problems.push_back(absl::StrCat(
          "colocated ranks form groups of ", unit.ranks_per_replica,
          " (the LLM's tp x cp and the encoder's tp) that must share a node, more than a node "
          "runs (--ranks-per-node ",
          ranks_per_node, ")"));
    } else {
      job.llm_nodes = Tile(unit, ranks_per_node);
      if (!job.colocated) job.encoder_nodes = Tile(encoder, ranks_per_node);
      // The tasks a node runs, each with its CPUs (the single allocation asks every node for
      // the larger module's).
      const int64_t per_node =
          std::max(job.encoder_nodes.tasks_per_node, job.llm_nodes.tasks_per_node);
      if (options.cpus_per_node > 0 && per_node * options.cpus_per_rank > options.cpus_per_node) {
        problems.push_back(absl::StrCat(
            per_node, " ranks per node (whole replicas, --ranks-per-node ", ranks_per_node, ") x ",
            options.cpus_per_rank, " CPUs (--cpus-per-rank) is more than a node's CPUs (",
            "--cpus-per-node ", options.cpus_per_node, ")"));
      }
    }
    if (!problems.empty()) return absl::InvalidArgumentError(absl::StrJoin(problems, "\n"));
  }
  v1::RunSpec run_spec = spec;
  run_spec.mutable_run()->set_out_dir(options.run_dir);
  run_spec.mutable_coordinator()->clear_token_file();
  const std::string config = options.run_dir + "/run.yaml";

  std::vector<RenderedFile> files;
  files.push_back({"run.yaml", absl::StrCat("# The RunSpec of hetpar run '", spec.run().name(),
                                            "' (rendered by `hetpar deploy slurm`).\n",
                                            config::RunSpecToYaml(run_spec))});
  files.push_back({"hetpar.sbatch", SingleAllocation(job, options, config)});
  if (!job.colocated) files.push_back({"hetpar-het.sbatch", Heterogeneous(job, options, config)});
  return files;
}

}  // namespace hetpar::deploy
