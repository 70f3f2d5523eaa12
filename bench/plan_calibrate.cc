// plan_calibrate: measures this machine's constants for the layout planner (`hetpar plan
// --estimate --cluster FILE`) and writes them as a cluster file (docs/planner.md):
//
//   peak_tflops.<dtype>        at::matmul on a 512 x 512 x 512 product, one thread, this process
//                              alone
//   encoder.compute_efficiency, llm.compute_efficiency
//                              the tiny encoder's and LLM's forward+backward at tp 1 (the models of
//                              configs/tiny.yaml; model FLOPs from common/plan/flops.h), alone, as
//                              a share of that peak; compute_efficiency: the mean of the two
//   encoder.layer_overhead_s, llm.layer_overhead_s
//                              the same models' time per layer and call beyond their FLOPs,
//                              from a large and a small batch each (t = flops / rate + layers x
//                              overhead); the efficiencies are that fit's rates over the peak;
//                              layer_overhead_s: the mean of the two
//   llm.attention_call_overhead_s
//                              per layer, forward + backward, the LLM's second attention call in
//                              a microbatch: two samples of 64 and 63 positions against two of
//                              64 (one call per run of equal lengths), paired rounds, the median
//                              difference less its FLOPs at the LLM's rate
//   concurrency                the tiny models' fitted rate with `cores` processes computing at
//                              once, summed, over the rate of one alone: how many ranks' worth of
//                              compute the cores deliver together (hyperthreads and shared vCPUs
//                              give less than cores)
//   intra_node.collective_*    the latency: the tiny models at tp = `cores` (2 or 4 processes, else
//                              a bare all-reduce of 256 bytes with a little compute between),
//                              their time less the planner's compute and byte terms, per
//                              all-reduce the planner counts (common/plan/estimate.h); the bus
//                              bandwidth: a Gloo all-reduce of 4 MiB
//   intra_node.p2p_*           Gloo send/recv ping-pong: half the round trip at 256 bytes, and the
//                              one-way rate at 4 MiB
//   shared_collective_latency_s  the same with 2 x cores processes in TP groups of 4 (or 2), all
//                              at once: colocated ranks that outnumber the cores
//   loaded_collective_latency_s  the same for one TP group of 2 while the other processes
//                              compute without pause: one module's TP group while the other
//                              module computes
//   memory_gbps                a 64 MiB memcpy (bytes read + written per second)
//   step_overhead_s            `hetpar run` of configs/tiny.yaml shrunk to 1-layer models of hidden
//                              16 on one encoder and one LLM rank, 2 waves: its median step time
//                              less those layers' overhead (the control plane's round trips, the
//                              bridge's and the data's fixed costs); 0 with --no-run
//
//   plan_calibrate [--out FILE] [--processes N] [--dtype float32|float64] [--hetpar BIN]
//                  [--no-run]
//
// The processes are this binary again (--worker), joined by a Gloo group over a file store; rank
// 0 writes its measurements as one JSON line, the parent writes the cluster file and prints the
// measurements as one JSON line on stdout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "bench/tiny_models.h"
#include "common/nn/communicator.h"
#include "common/nn/parameters.h"
#include "common/plan/estimate.h"
#include "common/plan/flops.h"
#include "common/status.h"
#include "encoder_service/encoder.h"
#include "llm_trainer/language_model.h"
#include "nlohmann/json.hpp"

extern char** environ;

namespace hetpar::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Runs `body` `iters` times between barriers (none when `comm` is null); per-iteration times.
absl::StatusOr<std::vector<double>> Timed(nn::Communicator* comm, int iters,
                                          const std::function<absl::Status()>& body) {
  std::vector<double> times;
  HETPAR_RETURN_IF_ERROR(body());  // warm-up
  for (int i = 0; i < iters; ++i) {
    if (comm != nullptr) HETPAR_RETURN_IF_ERROR(comm->Barrier());
    const auto t0 = Clock::now();
    HETPAR_RETURN_IF_ERROR(body());
    times.push_back(Seconds(t0, Clock::now()));
  }
  return times;
}

constexpr int64_t kMatmulSize = 512;

// FLOP/s of at::matmul on kMatmulSize^3, between barriers of `comm` when given.
absl::StatusOr<double> MatmulRate(nn::Communicator* comm, at::ScalarType dtype) {
  const int64_t n = kMatmulSize;
  at::Tensor a = at::randn({n, n}).to(dtype), b = at::randn({n, n}).to(dtype);
  HETPAR_ASSIGN_OR_RETURN(std::vector<double> times, Timed(comm, 8, [&] {
                            at::Tensor c = at::matmul(a, b);
                            return c.numel() == n * n ? absl::OkStatus()
                                                      : absl::InternalError("matmul shape");
                          }));
  return 2.0 * n * n * n / Median(times);
}

// The tiny encoder's and LLM's forward + backward at tp 1 in this process, each at a large and a
// small batch: t = flops / rate + layers x overhead solved for the rate and the per-layer
// overhead (operator dispatch, per layer and call, which small calls feel).
struct ModelFit {
  double encoder_rate = 0, encoder_overhead_s = 0;
  double llm_rate = 0, llm_overhead_s = 0;
  // Per layer, forward + backward: what an LLM microbatch's second attention call costs (two
  // samples of different lengths against two of one length); measured with `attention_calls`.
  double llm_attention_call_s = 0;
};

std::pair<double, double> Solve(double flops_big, double t_big, double flops_small, double t_small,
                                int64_t layers) {
  // t = flops / rate + layers * overhead
  const double inverse_rate = (t_big - t_small) / (flops_big - flops_small);
  const double overhead = (t_big - flops_big * inverse_rate) / static_cast<double>(layers);
  return {inverse_rate > 0 ? 1.0 / inverse_rate : 0, std::max(0.0, overhead)};
}

// Forward + backward times of the tiny encoder (8 images, and 1) and LLM (2 samples of 128
// positions, and 1 of 32) on `comm` (TP over its ranks), with the model FLOPs of each call.
struct ModelTimes {
  double encoder_big_s = 0, encoder_small_s = 0, llm_big_s = 0, llm_small_s = 0;
  double encoder_big_flops = 0, encoder_small_flops = 0, llm_big_flops = 0, llm_small_flops = 0;
  // With `attention_calls`: the median over paired rounds of two samples of 64 and 63 positions
  // less two of 64 (two attention calls per layer against one), and the FLOPs between them.
  double llm_second_call_s = 0, llm_second_call_flops = 0;
};

absl::StatusOr<ModelTimes> TimeModels(nn::Communicator& comm, at::ScalarType dtype,
                                      const v1::LlmModel& lm_model, bool small_too,
                                      bool attention_calls = false) {
  ModelTimes times;
  const v1::EncoderModel em = TinyEncoder();
  encoder::EncoderOptions eo;
  eo.dtype = dtype;
  HETPAR_ASSIGN_OR_RETURN(auto vit, encoder::VisionEncoder::Create(em, eo, comm));
  nn::Communicator* sync = comm.size() > 1 ? &comm : nullptr;
  auto encoder_time = [&](int64_t images) -> absl::StatusOr<double> {
    at::Tensor pixels =
        at::randn({images, em.channels(), em.image_size(), em.image_size()}).to(dtype);
    at::Tensor grad_rows = at::randn({images * vit->tokens_per_image(), em.out_hidden()}).to(dtype);
    HETPAR_ASSIGN_OR_RETURN(std::vector<double> t, Timed(sync, 12, [&]() -> absl::Status {
                              HETPAR_ASSIGN_OR_RETURN(at::Tensor y, vit->Forward(pixels));
                              HETPAR_RETURN_IF_ERROR(vit->Backward(y, grad_rows));
                              HETPAR_RETURN_IF_ERROR(vit->FinishGradients());
                              vit->parameters().ZeroGrad();
                              return absl::OkStatus();
                            }));
    return Median(t);
  };
  const double image_flops = plan::EncoderImageFlops(em).total();
  HETPAR_ASSIGN_OR_RETURN(times.encoder_big_s, encoder_time(8));
  times.encoder_big_flops = 8 * image_flops;
  if (small_too) {
    HETPAR_ASSIGN_OR_RETURN(times.encoder_small_s, encoder_time(1));
    times.encoder_small_flops = image_flops;
  }

  llm::LlmOptions lo;
  lo.dtype = dtype;
  HETPAR_ASSIGN_OR_RETURN(auto lm, llm::LanguageModel::Create(lm_model, lo, comm));
  const int64_t rows_per_sample = 16;
  // One forward + backward over samples of `lengths` positions, and its model FLOPs.
  struct LlmCall {
    std::vector<llm::LlmSample> samples;
    at::Tensor image_rows;
    int64_t loss_rows = 0;
    double flops = 0;
  };
  auto llm_call = [&](const std::vector<int64_t>& lengths) {
    LlmCall call;
    const int64_t count = static_cast<int64_t>(lengths.size());
    for (int64_t s = 0; s < count; ++s) {
      const int64_t length = lengths[s];
      llm::LlmSample sample;
      sample.id = absl::StrCat("calibrate-", s);
      for (int64_t i = 0; i < length; ++i) {
        sample.tokens.push_back((i * 31 + s * 17) % lm_model.vocab());
      }
      sample.labels.assign(length, 0);
      sample.loss_mask.assign(length, 0);
      int64_t sample_loss = 0;
      for (int64_t i = 0; i + 1 < length; ++i) {
        sample.labels[i] = sample.tokens[i + 1];
        sample.loss_mask[i] = i >= 1 + rows_per_sample ? 1 : 0;
        sample_loss += sample.loss_mask[i];
      }
      for (int64_t i = 0; i < rows_per_sample; ++i) sample.image_positions.push_back(1 + i);
      sample.image_rows = rows_per_sample;
      call.flops += plan::LlmSampleFlops(lm_model, length, sample_loss).total();
      call.loss_rows += sample_loss;
      call.samples.push_back(std::move(sample));
    }
    call.image_rows =
        at::randn({count * rows_per_sample, lm_model.hidden()}).to(dtype).requires_grad_(true);
    return call;
  };
  auto run = [&](LlmCall& call) -> absl::Status {
    HETPAR_ASSIGN_OR_RETURN(auto result,
                            lm->Forward(call.samples, call.image_rows, call.loss_rows));
    HETPAR_RETURN_IF_ERROR(lm->Backward(result.loss));
    HETPAR_RETURN_IF_ERROR(lm->FinishGradients());
    lm->parameters().ZeroGrad();
    call.image_rows.mutable_grad() = at::Tensor();
    return absl::OkStatus();
  };
  auto llm_time = [&](int64_t count, int64_t length, double* flops) -> absl::StatusOr<double> {
    LlmCall call = llm_call(std::vector<int64_t>(count, length));
    *flops = call.flops;
    HETPAR_ASSIGN_OR_RETURN(std::vector<double> t, Timed(sync, 12, [&] { return run(call); }));
    return Median(t);
  };
  HETPAR_ASSIGN_OR_RETURN(times.llm_big_s, llm_time(2, lm_model.seq_len(), &times.llm_big_flops));
  if (small_too) {
    HETPAR_ASSIGN_OR_RETURN(times.llm_small_s, llm_time(1, 32, &times.llm_small_flops));
  }
  if (attention_calls) {
    // Paired rounds, so that the machine's drift cancels in each difference.
    LlmCall one = llm_call({64, 64}), two = llm_call({64, 63});
    HETPAR_RETURN_IF_ERROR(run(one));  // warm-up
    HETPAR_RETURN_IF_ERROR(run(two));
    std::vector<double> differences;
    for (int i = 0; i < 16; ++i) {
      auto t0 = Clock::now();
      HETPAR_RETURN_IF_ERROR(run(one));
      const double t_one = Seconds(t0, Clock::now());
      t0 = Clock::now();
      HETPAR_RETURN_IF_ERROR(run(two));
      differences.push_back(Seconds(t0, Clock::now()) - t_one);
    }
    times.llm_second_call_s = Median(differences);
    times.llm_second_call_flops = two.flops - one.flops;
  }
  return times;
}

absl::StatusOr<ModelFit> FitModels(at::ScalarType dtype, bool attention_calls = false) {
  auto single = nn::Communicator::CreateSingle();
  HETPAR_ASSIGN_OR_RETURN(ModelTimes t,
                          TimeModels(*single, dtype, TinyLlm(), true, attention_calls));
  ModelFit fit;
  std::tie(fit.encoder_rate, fit.encoder_overhead_s) =
      Solve(t.encoder_big_flops, t.encoder_big_s, t.encoder_small_flops, t.encoder_small_s,
            TinyEncoder().layers());
  std::tie(fit.llm_rate, fit.llm_overhead_s) =
      Solve(t.llm_big_flops, t.llm_big_s, t.llm_small_flops, t.llm_small_s, TinyLlm().layers());
  if (attention_calls && fit.llm_rate > 0) {
    fit.llm_attention_call_s =
        std::max(0.0, (t.llm_second_call_s - t.llm_second_call_flops / fit.llm_rate) /
                          static_cast<double>(TinyLlm().layers()));
  }
  return fit;
}

// One group of `size` processes. Full: the matmul rate all at once, all-reduce and send/recv
// figures. Shared (more processes than cores): the all-reduce latency with a matmul between
// all-reduces, as TP ranks that share cores compute between their collectives.
absl::Status RunWorker(int rank, int size, bool shared, const std::string& store_path,
                       const std::string& out_path, at::ScalarType dtype) {
  at::set_num_threads(1);
  HETPAR_ASSIGN_OR_RETURN(auto store, nn::OpenFileStore(store_path, size));
  nn::CommunicatorOptions options;
  options.prefix = "plan_calibrate";
  options.rank = rank;
  options.size = size;
  options.timeout = absl::Seconds(300);
  HETPAR_ASSIGN_OR_RETURN(auto comm, nn::Communicator::Create(store, options));
  nlohmann::ordered_json out;
  if (shared) {
    // More processes than cores. First all of them at once in TP groups of `tp` (every rank
    // computing, as colocated ranks do); then ranks 0 and 1 as one TP group of 2 while the others
    // compute without pause (one module's TP group while the other module computes).
    const int tp = size % 4 == 0 ? 4 : 2;
    nn::CommunicatorOptions sub = options;
    sub.prefix = absl::StrCat("plan_calibrate/tp", rank / tp);
    sub.rank = rank % tp;
    sub.size = tp;
    HETPAR_ASSIGN_OR_RETURN(auto group, nn::Communicator::Create(store, sub));
    v1::LlmModel lm = TinyLlm();
    lm.set_kv_heads(4);  // divisible by tp 4
    HETPAR_RETURN_IF_ERROR(comm->Barrier());
    HETPAR_ASSIGN_OR_RETURN(ModelTimes all, TimeModels(*group, dtype, lm, false));
    out["shared_processes"] = size;
    out["shared_tp"] = tp;
    out["shared_encoder_s"] = all.encoder_big_s;
    out["shared_llm_s"] = all.llm_big_s;
    out["shared_llm_kv_heads"] = 4;
    HETPAR_RETURN_IF_ERROR(comm->Barrier());
    const std::string done_key = "plan_calibrate/loaded_done";
    if (rank < 2) {
      nn::CommunicatorOptions pair = options;
      pair.prefix = "plan_calibrate/loaded";
      pair.size = 2;
      HETPAR_ASSIGN_OR_RETURN(auto loaded_group, nn::Communicator::Create(store, pair));
      HETPAR_ASSIGN_OR_RETURN(ModelTimes loaded,
                              TimeModels(*loaded_group, dtype, TinyLlm(), false));
      out["loaded_encoder_s"] = loaded.encoder_big_s;
      out["loaded_llm_s"] = loaded.llm_big_s;
      if (rank == 0) store->set(done_key, std::vector<uint8_t>{1});
    } else {
      // Compute until the pair is done (the store says so); bounded by a deadline.
      at::Tensor a = at::randn({96, 96}).to(dtype);
      const auto deadline = Clock::now() + std::chrono::seconds(300);
      while (!store->check({done_key})) {
        if (Clock::now() > deadline) {
          return absl::DeadlineExceededError("the loaded pair never finished");
        }
        for (int i = 0; i < 8; ++i) at::Tensor c = at::matmul(a, a);
      }
    }
  } else {
    HETPAR_ASSIGN_OR_RETURN(const double rate, MatmulRate(comm.get(), dtype));
    out["concurrent_matmul_gflops"] = rate / 1e9;
    // The tiny models' fit with every process computing at once.
    HETPAR_RETURN_IF_ERROR(comm->Barrier());
    HETPAR_ASSIGN_OR_RETURN(const ModelFit fit, FitModels(dtype));
    out["concurrent_encoder_gflops"] = fit.encoder_rate / 1e9;
    out["concurrent_llm_gflops"] = fit.llm_rate / 1e9;
    // The tiny models at tp = the group (2 or more processes, no other load).
    if (size == 2 || size == 4) {
      HETPAR_RETURN_IF_ERROR(comm->Barrier());
      v1::LlmModel lm = TinyLlm();
      if (size == 4) lm.set_kv_heads(4);
      HETPAR_ASSIGN_OR_RETURN(ModelTimes grouped, TimeModels(*comm, dtype, lm, false));
      out["tp_encoder_s"] = grouped.encoder_big_s;
      out["tp_llm_s"] = grouped.llm_big_s;
    }
    auto all_reduce = [&](int64_t bytes, int iters) -> absl::StatusOr<double> {
      at::Tensor t = at::ones({bytes / 4}, at::kFloat);
      HETPAR_ASSIGN_OR_RETURN(std::vector<double> times,
                              Timed(comm.get(), iters, [&] { return comm->AllReduce(t); }));
      return Median(times);
    };
    HETPAR_ASSIGN_OR_RETURN(const double ar_small, all_reduce(256, 200));
    // Latency as a model meets it: a little compute between all-reduces, so ranks arrive apart
    // and the waiting one has gone to sleep.
    {
      at::Tensor t = at::ones({64}, at::kFloat);
      at::Tensor a = at::randn({96, 96}).to(dtype);
      std::vector<double> times;
      for (int i = 0; i < 100; ++i) {
        at::Tensor c = at::matmul(a, a);
        const auto t0 = Clock::now();
        HETPAR_RETURN_IF_ERROR(comm->AllReduce(t));
        times.push_back(Seconds(t0, Clock::now()));
      }
      out["collective_latency_s"] = Median(times);
    }
    HETPAR_ASSIGN_OR_RETURN(const double ar_large, all_reduce(4 << 20, 10));
    const double bus = 2.0 * (size - 1) / size;
    out["allreduce_256b_s"] = ar_small;
    out["allreduce_4mib_s"] = ar_large;
    out["collective_gbps"] = bus * (4 << 20) / std::max(ar_large - ar_small, 1e-9) / 1e9;
    auto ping_pong = [&](int64_t bytes, int iters) -> absl::StatusOr<double> {
      at::Tensor t = at::ones({bytes / 4}, at::kFloat);
      const auto& pg = comm->group()->c10d_backend();
      std::vector<at::Tensor> buffers = {t};
      HETPAR_ASSIGN_OR_RETURN(std::vector<double> times,
                              Timed(comm.get(), iters, [&]() -> absl::Status {
                                if (rank == 0) {
                                  pg->send(buffers, 1, 0)->wait();
                                  pg->recv(buffers, 1, 0)->wait();
                                } else if (rank == 1) {
                                  pg->recv(buffers, 0, 0)->wait();
                                  pg->send(buffers, 0, 0)->wait();
                                }
                                return absl::OkStatus();
                              }));
      return Median(times) / 2;
    };
    HETPAR_ASSIGN_OR_RETURN(const double p2p_small, ping_pong(256, 200));
    HETPAR_ASSIGN_OR_RETURN(const double p2p_large, ping_pong(4 << 20, 10));
    out["p2p_latency_s"] = p2p_small;
    out["p2p_gbps"] = (4 << 20) / std::max(p2p_large - p2p_small, 1e-9) / 1e9;
  }
  HETPAR_RETURN_IF_ERROR(comm->Barrier());
  if (rank == 0) {
    std::ofstream file(out_path);
    file << out.dump() << "\n";
    if (!file) return absl::UnavailableError(absl::StrCat("cannot write ", out_path));
  }
  return absl::OkStatus();
}

// Starts `size` workers of this binary and waits for them (600 s); rank 0's JSON line.
absl::StatusOr<nlohmann::json> RunGroup(int size, bool shared, const std::string& dtype_name,
                                        const fs::path& dir) {
  const std::string tag = shared ? "shared" : "full";
  const std::string store_path = (dir / (tag + ".store")).string();
  const std::string result_path = (dir / (tag + ".json")).string();
  const std::string log = (dir / (tag + ".log")).string();
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> args = {"plan_calibrate",  "--worker",    "--rank",
                                     std::to_string(r), "--processes", std::to_string(size),
                                     "--store",         store_path,    "--result",
                                     result_path,       "--dtype",     dtype_name};
    if (shared) args.push_back("--shared");
    std::vector<char*> argv_c;
    for (auto& a : args) argv_c.push_back(a.data());
    argv_c.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv_c.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      return absl::InternalError(absl::StrCat("cannot start worker ", r));
    }
    pids.push_back(pid);
  }
  const auto deadline = Clock::now() + std::chrono::seconds(600);
  bool failed = false;
  for (pid_t pid : pids) {
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) != pid) {
      if (Clock::now() > deadline) {
        for (pid_t p : pids) ::kill(p, SIGKILL);
        ::waitpid(pid, &status, 0);
        failed = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // polls the children
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = true;
  }
  std::ifstream result_in(result_path);
  std::string line;
  if (failed || !std::getline(result_in, line)) {
    std::ifstream log_in(log);
    std::stringstream text;
    text << log_in.rdbuf();
    return absl::InternalError(
        absl::StrCat("a worker of the ", tag, " group failed or ran past 600 s:\n", text.str()));
  }
  return nlohmann::json::parse(line);
}

// The median step time of a run with almost no model (see the header), or an error.
absl::StatusOr<double> NullStepTime(const std::string& hetpar, const fs::path& dir,
                                    const std::string& dtype_name) {
  const std::string out = (dir / "null-run").string();
  const std::string data = (dir / "null-data").string();
  std::string command = hetpar + " run --config " + std::string(HETPAR_SOURCE_DIR) +
                        "/configs/tiny.yaml --steps 14 --out '" + out + "'";
  for (const char* set :
       {"encoder.model.hidden=16", "encoder.model.layers=1", "encoder.model.heads=1",
        "encoder.model.mlp=16", "encoder.model.out_hidden=16", "llm.model.hidden=16",
        "llm.model.layers=1", "llm.model.heads=1", "llm.model.kv_heads=1", "llm.model.ffn=16",
        "run.global_batch=2", "run.micro_batch=1", "encoder.layout.dp=1", "llm.layout.tp=1",
        "data.synth.samples=64", "data.synth.val_samples=4"}) {
    command += std::string(" --set ") + set;
  }
  command += " --set run.dtype=" + dtype_name + " --set data.manifest='" + data +
             "/train.jsonl' --set data.val_manifest='" + data +
             "/val.jsonl' --set data.tokenizer='" + data + "/tokenizer.model' > '" + out +
             ".log' 2>&1";
  if (std::system(command.c_str()) != 0) {
    std::ifstream log(out + ".log");
    std::stringstream text;
    text << log.rdbuf();
    return absl::InternalError(absl::StrCat("the null run failed: ", command, "\n", text.str()));
  }
  std::ifstream metrics(out + "/metrics.jsonl");
  std::vector<double> times;
  std::string line;
  while (std::getline(metrics, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step_time_s") || j["step"].get<int>() < 2) continue;
    times.push_back(j["step_time_s"].get<double>());
  }
  if (times.empty()) return absl::InternalError("the null run reported no steps");
  return Median(times);
}

}  // namespace
}  // namespace hetpar::bench

int main(int argc, char** argv) {
  using namespace hetpar::bench;
  CLI::App app{"plan_calibrate: this machine's constants for `hetpar plan --estimate`"};
  std::string out = "cluster-cpu.yaml";
  const unsigned cores = std::max(2u, std::thread::hardware_concurrency());
  int processes = static_cast<int>(cores);
  std::string dtype_name = "float32";
  bool worker = false, shared = false;
  int rank = 0;
  std::string store, result;
  app.add_option("--out", out, "Cluster file to write")->capture_default_str();
  app.add_option("--processes", processes,
                 "Processes computing at once for the full group (default: the cores, at least 2)")
      ->check(CLI::Range(2, 256));
  app.add_option("--dtype", dtype_name, "float32 or float64")
      ->check(CLI::IsMember({"float32", "float64"}))
      ->capture_default_str();
  std::string hetpar = HETPAR_BIN;
  bool no_run = false;
  app.add_option("--hetpar", hetpar, "The hetpar binary for the null run")->capture_default_str();
  app.add_flag("--no-run", no_run, "Skip the null run (step_overhead_s: 0)");
  app.add_flag("--worker", worker)->group("");
  app.add_flag("--shared", shared)->group("");
  app.add_option("--rank", rank)->group("");
  app.add_option("--store", store)->group("");
  app.add_option("--result", result)->group("");
  CLI11_PARSE(app, argc, argv);
  const at::ScalarType dtype = dtype_name == "float64" ? at::kDouble : at::kFloat;
  if (worker) {
    absl::Status status = RunWorker(rank, processes, shared, store, result, dtype);
    if (!status.ok()) {
      std::cerr << "plan_calibrate rank " << rank << ": " << status << "\n";
      return 1;
    }
    return 0;
  }
  auto fail = [](const absl::Status& status) {
    std::cerr << "plan_calibrate: " << status.message() << "\n";
    return 1;
  };
  std::cerr << "plan_calibrate: 1/4 one process alone (matmul, the tiny models)\n";
  at::set_num_threads(1);
  auto alone = MatmulRate(nullptr, dtype);
  if (!alone.ok()) return fail(alone.status());
  auto models = FitModels(dtype, /*attention_calls=*/true);
  if (!models.ok()) return fail(models.status());
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("plan_calibrate.", ::getpid());
  fs::create_directories(dir);
  std::cerr << "plan_calibrate: 2/4 " << processes
            << " processes at once (matmul, Gloo all-reduce and send/recv)\n";
  auto full = RunGroup(processes, false, dtype_name, dir);
  if (!full.ok()) return fail(full.status());
  std::cerr << "plan_calibrate: 3/4 " << 2 * processes
            << " processes sharing the cores (all-reduce latency)\n";
  auto shared_group = RunGroup(2 * processes, true, dtype_name, dir);
  if (!shared_group.ok()) return fail(shared_group.status());
  double null_step = 0;
  if (!no_run) {
    std::cerr << "plan_calibrate: 4/4 a run with 1-layer models of hidden 16 (14 steps)\n";
    auto measured = NullStepTime(hetpar, dir, dtype_name);
    if (!measured.ok()) return fail(measured.status());
    null_step = *measured;
  }
  std::error_code ignored;
  fs::remove_all(dir, ignored);

  nlohmann::ordered_json m;
  m["bench"] = "plan_calibrate";
  m["dtype"] = dtype_name;
  m["processes"] = processes;
  m["matmul_gflops"] = *alone / 1e9;
  m["encoder_gflops"] = models->encoder_rate / 1e9;
  m["llm_gflops"] = models->llm_rate / 1e9;
  m["encoder_layer_overhead_s"] = models->encoder_overhead_s;
  m["llm_layer_overhead_s"] = models->llm_overhead_s;
  m["encoder_compute_efficiency"] = std::min(1.0, models->encoder_rate / *alone);
  m["llm_compute_efficiency"] = std::min(1.0, models->llm_rate / *alone);
  m["llm_attention_call_overhead_s"] = models->llm_attention_call_s;
  // The cluster's own values (for a module without its section): the two modules' mean.
  m["compute_efficiency"] = std::min(1.0, (models->encoder_rate + models->llm_rate) / 2 / *alone);
  m["layer_overhead_s"] = (models->encoder_overhead_s + models->llm_overhead_s) / 2;
  // How many processes' worth of the models' compute the cores deliver together.
  m["concurrency"] = processes *
                     ((*full)["concurrent_encoder_gflops"].get<double>() +
                      (*full)["concurrent_llm_gflops"].get<double>()) *
                     1e9 / (models->encoder_rate + models->llm_rate);
  for (const auto& [k, v] : full->items()) m[k] = v;
  for (const auto& [k, v] : shared_group->items()) m[k] = v;
  // Single-thread memory rate: a 64 MiB copy, best of 5 (the optimizer's bound).
  std::vector<char> src(64 << 20, 1), dst(64 << 20);
  double copy_s = 1e9;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), src.size());
    copy_s = std::min(copy_s, Seconds(t0, Clock::now()));
  }
  m["memory_gbps"] = 2.0 * src.size() / copy_s / 1e9;
  // Two waves of one encoder layer and one LLM layer: four layer passes of overhead.
  m["null_step_s"] = null_step;
  m["step_overhead_s"] =
      no_run ? 0.0 : std::max(0.0, null_step - 4.0 * m["layer_overhead_s"].get<double>());
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const double memory_gib = static_cast<double>(pages) * page / (1 << 30);
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  auto number = [&](const char* key) { return m[key].get<double>(); };

  // TP collective latency as the models meet it: a TP group's forward + backward time less what
  // the planner predicts for its compute (the module's fitted rate and layer overhead, full
  // speed) and for the collectives' bytes, over the all-reduces the planner counts for it.
  {
    const double bus = number("collective_gbps") * 1e9;
    const hetpar::v1::EncoderModel em = TinyEncoder();
    auto latency = [&](double t, int64_t tp, bool llm, int64_t kv_heads) {
      double flops = 0;
      int64_t layers = 0;
      hetpar::plan::CollectiveCount c;
      const double rate = llm ? models->llm_rate : models->encoder_rate;
      const double overhead = llm ? models->llm_overhead_s : models->encoder_overhead_s;
      if (llm) {
        hetpar::v1::LlmModel lm = TinyLlm();
        lm.set_kv_heads(kv_heads);
        const int64_t loss = 110;  // positions 17..126 of 128 carry a label (TimeModels)
        flops = 2 * hetpar::plan::LlmSampleFlops(lm, lm.seq_len(), loss).total();
        layers = lm.layers();
        c = hetpar::plan::LlmTpCollectives(lm, layers, 2 * lm.seq_len(), 32, 2 * loss, 4);
      } else {
        flops = 8 * hetpar::plan::EncoderImageFlops(em).total();
        layers = em.layers();
        c = hetpar::plan::EncoderTpCollectives(em, 8, 4);
      }
      const double n = static_cast<double>(tp);
      const double rest = t - flops / n / rate - static_cast<double>(layers) * overhead -
                          c.all_reduce_bytes * 2 * (n - 1) / n / bus;
      return std::max(0.0, rest / static_cast<double>(c.all_reduces));
    };
    const double raw = number("collective_latency_s");
    if (m.contains("tp_llm_s")) {
      m["tp_collective_latency_s"] =
          std::max(raw, (latency(number("tp_encoder_s"), processes, false, 2) +
                         latency(number("tp_llm_s"), processes, true, processes == 4 ? 4 : 2)) /
                            2);
    } else {
      m["tp_collective_latency_s"] = raw;
    }
    const int64_t shared_tp = m["shared_tp"].get<int64_t>();
    m["shared_collective_latency_s"] =
        std::max(raw, (latency(number("shared_encoder_s"), shared_tp, false, 2) +
                       latency(number("shared_llm_s"), shared_tp, true, 4)) /
                          2);
    m["loaded_collective_latency_s"] =
        std::max(raw, (latency(number("loaded_encoder_s"), 2, false, 2) +
                       latency(number("loaded_llm_s"), 2, true, 2)) /
                          2);
  }

  std::ostringstream y;
  y.precision(6);
  y << "# This machine's constants for `hetpar plan --estimate --cluster " << out << "`,\n"
    << "# measured by plan_calibrate (bench/plan_calibrate.cc) on " << host << ".\n"
    << "# Measurements: " << m.dump() << "\n"
    << "name: cpu-" << host << "\n"
    << "description: \"this machine: " << cores << " cores, ranks beyond them share the cores\"\n"
    << "source: \"plan_calibrate, one thread per process\"\n"
    << "devices_per_node: " << cores << "\n"
    << "nodes: 1\n"
    << "share_devices: true\n"
    << "concurrency: " << number("concurrency") << "\n"
    << "memory_gib: " << memory_gib << "\n"
    << "reserved_gib: 0\n"
    << "memory_gbps: " << number("memory_gbps") << "\n"
    << "peak_tflops:\n"
    << "  " << dtype_name << ": " << number("matmul_gflops") / 1e3 << "\n"
    << "compute_efficiency: " << number("compute_efficiency") << "\n"
    << "tp_parallel_fraction: 1\n"
    << "layer_overhead_s: " << number("layer_overhead_s") << "\n"
    << "encoder: {compute_efficiency: " << number("encoder_compute_efficiency")
    << ", layer_overhead_s: " << number("encoder_layer_overhead_s") << "}\n"
    << "llm: {compute_efficiency: " << number("llm_compute_efficiency")
    << ", layer_overhead_s: " << number("llm_layer_overhead_s")
    << ", attention_call_overhead_s: " << number("llm_attention_call_overhead_s") << "}\n"
    << "shared_collective_latency_s: " << number("shared_collective_latency_s") << "\n"
    << "loaded_collective_latency_s: " << number("loaded_collective_latency_s") << "\n"
    << "step_overhead_s: " << number("step_overhead_s") << "\n";
  for (const char* link : {"intra_node", "inter_node"}) {
    y << link << ":\n"
      << "  collective_gbps: " << number("collective_gbps") << "\n"
      << "  collective_latency_s: " << number("tp_collective_latency_s") << "\n"
      << "  p2p_gbps: " << number("p2p_gbps") << "\n"
      << "  p2p_latency_s: " << number("p2p_latency_s") << "\n";
  }
  std::ofstream file(out);
  file << y.str();
  if (!file) return fail(absl::UnavailableError(absl::StrCat("cannot write ", out)));
  std::cout << m.dump() << "\n";
  std::cerr << "plan_calibrate: wrote " << out << "\n";
  return 0;
}
