// model_bench: forward+backward throughput of the encoder and the LLM at tp=1 and tp=2, with the
// achieved GFLOP/s as a ratio of plain at::matmul on the same GEMM shapes in the same run.
//
//   model_bench [--configs tiny,mid,gpu] [--modules encoder,llm] [--tp 1,2] [--iters N]
//               [--dtype float32|float64|bfloat16] [--sp] [--device cpu|cuda]
//
// --device cuda runs rank r on cuda:r (its TP group on NCCL) and the matmul baseline there too,
// synchronising the device around every timed loop (a tp above the visible GPUs prints a
// "skipped" line); the "gpu" config is sized for a GPU: 4
// layers of a ViT-L/14-336-shaped encoder (8 images), 4 layers of a 1B-class LLM (2 samples of
// 2048 positions).
//
// Each case starts `tp` worker processes (this binary again) joined by a Gloo group over a file
// store; one JSON object per case is printed on stdout. Per rank, the model's GEMM FLOPs per
// iteration are counted from the shapes (each forward GEMM, plus its two backward GEMMs, or one
// when its input needs no gradient). Every timed model step is followed by one round of plain
// at::matmul over exactly that rank's GEMM list, on all ranks at once, so the ratio compares
// like with like under the same background load. The LLM's causal attention products count in
// full in gemm_gflop_per_rank_per_iter (the run's accounting, docs/observability.md), but the
// causal kernels do about half of them, so the baseline runs them over half their rows and both
// rates (and the ratio) are of that work (work_gflop_per_rank_per_iter). tokens_per_s counts
// the tokens of the whole TP group (one replica) per second.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/tiny_models.h"
#include "common/nn/communicator.h"
#include "common/nn/parameters.h"
#include "common/plan/flops.h"
#include "common/status.h"
#include "encoder_service/encoder.h"
#include "llm_trainer/language_model.h"

extern char** environ;

namespace hetpar::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Gemm {
  int64_t batch, m, k, n;  // [batch] x [m, k] @ [k, n]
  int passes;              // 1: forward only; 3: forward + grad input + grad weight
  // A causal attention product: the kernel computes only the score blocks at or below the
  // diagonal, about half of the m rows' work. Counted in full, as the run's accounting counts it
  // (common/plan/flops.h); done by the baseline over ceil(m / 2) rows, the work the kernel does.
  bool causal = false;
  double Flops() const { return 2.0 * batch * m * k * n * passes; }
  int64_t WorkRows() const { return causal ? (m + 1) / 2 : m; }
  double WorkFlops() const { return 2.0 * batch * WorkRows() * k * n * passes; }
};

struct BenchCase {
  std::string module;  // encoder | llm
  std::string config;  // tiny | mid | gpu
  int tp = 1;
  bool sp = false;
  at::ScalarType dtype = at::kFloat;
  int iters = 0;               // 0: 20 for tiny, 3 for mid, 10 for gpu
  std::string device = "cpu";  // cpu | cuda
};

hetpar::v1::EncoderModel EncoderConfig(const std::string& config, int64_t* images) {
  hetpar::v1::EncoderModel m;
  if (config == "tiny") {
    m = TinyEncoder();
    *images = 8;
  } else if (config == "gpu") {
    m.set_image_size(336);
    m.set_patch(14);  // 24 x 24 = 576 patches
    m.set_hidden(1024);
    m.set_layers(4);
    m.set_heads(16);
    m.set_mlp(4096);
    m.set_out_hidden(2048);
    *images = 8;
  } else {
    m.set_image_size(64);
    m.set_patch(8);
    m.set_hidden(512);
    m.set_layers(4);
    m.set_heads(8);
    m.set_mlp(2048);
    m.set_out_hidden(512);
    *images = 4;
  }
  m.set_channels(3);
  return m;
}

hetpar::v1::LlmModel LlmConfig(const std::string& config, int64_t* samples,
                               int64_t* image_rows_per_sample) {
  hetpar::v1::LlmModel m;
  if (config == "tiny") {
    m = TinyLlm();
    *samples = 2;
    *image_rows_per_sample = 16;
  } else if (config == "gpu") {
    m.set_hidden(2048);
    m.set_layers(4);
    m.set_heads(16);
    m.set_kv_heads(8);
    m.set_ffn(8192);
    m.set_vocab(32000);
    m.set_seq_len(2048);
    *samples = 2;
    *image_rows_per_sample = 576;
  } else {
    m.set_hidden(512);
    m.set_layers(4);
    m.set_heads(8);
    m.set_kv_heads(4);
    m.set_ffn(1408);
    m.set_vocab(8192);
    m.set_seq_len(256);
    *samples = 1;
    *image_rows_per_sample = 64;
  }
  m.set_rope_theta(10000);
  m.set_norm_eps(1e-5);
  return m;
}

std::vector<Gemm> EncoderGemms(const hetpar::v1::EncoderModel& m, int64_t images, int tp) {
  const int64_t tokens = (m.image_size() / m.patch()) * (m.image_size() / m.patch());
  const int64_t rows = images * tokens;
  const int64_t d = m.hidden() / m.heads();
  const int64_t heads = m.heads() / tp;
  const int64_t patch_features = m.channels() * m.patch() * m.patch();
  std::vector<Gemm> g;
  g.push_back({1, rows, patch_features, m.hidden(), 2});  // images need no gradient
  for (int64_t l = 0; l < m.layers(); ++l) {
    g.push_back({1, rows, m.hidden(), 3 * m.hidden() / tp, 3});
    g.push_back({images * heads, tokens, d, tokens, 3});  // scores
    g.push_back({images * heads, tokens, tokens, d, 3});  // probs @ v
    g.push_back({1, rows, m.hidden() / tp, m.hidden(), 3});
    g.push_back({1, rows, m.hidden(), m.mlp() / tp, 3});
    g.push_back({1, rows, m.mlp() / tp, m.hidden(), 3});
  }
  g.push_back({1, rows, m.hidden(), m.out_hidden() / tp, 3});
  g.push_back({1, rows, m.out_hidden() / tp, m.out_hidden(), 3});
  return g;
}

std::vector<Gemm> LlmGemms(const hetpar::v1::LlmModel& m, const std::vector<int64_t>& lengths,
                           int64_t loss_rows, int tp) {
  int64_t rows = 0;
  for (int64_t l : lengths) rows += l;
  const int64_t d = m.hidden() / m.heads();
  const int64_t heads = m.heads() / tp;
  const int64_t kv = m.kv_heads() / tp;
  std::vector<Gemm> g;
  for (int64_t l = 0; l < m.layers(); ++l) {
    g.push_back({1, rows, m.hidden(), (heads + 2 * kv) * d, 3});
    for (int64_t length : lengths) {
      g.push_back({heads, length, d, length, 3, /*causal=*/true});
      g.push_back({heads, length, length, d, 3, /*causal=*/true});
    }
    g.push_back({1, rows, heads * d, m.hidden(), 3});
    g.push_back({1, rows, m.hidden(), m.ffn() / tp, 3});
    g.push_back({1, rows, m.hidden(), m.ffn() / tp, 3});
    g.push_back({1, rows, m.ffn() / tp, m.hidden(), 3});
  }
  g.push_back({1, loss_rows, m.hidden(), m.vocab() / tp, 3});
  return g;
}

// at::matmul over a GEMM list: each GEMM `passes` times, with the operand shapes of the forward
// and of the two backward products, over the GEMM's work rows (half of a causal product's).
// Unbatched GEMMs (the linear layers, which the model runs as mm/addmm) are 2-D products laid out
// as at::linear's are: x @ W^T with W stored [n, k], the weight gradient dY^T @ x, the input
// gradient dY @ W (cuBLAS's speed depends on which operand is transposed).
class MatmulBaseline {
 public:
  MatmulBaseline(const std::vector<Gemm>& gemms, at::ScalarType dtype, c10::Device device) {
    const auto o = at::TensorOptions().dtype(dtype).device(device);
    for (const Gemm& g : gemms) {
      const int64_t m = g.WorkRows();
      if (g.batch == 1) {
        const at::Tensor x = at::randn({m, g.k}, o), w = at::randn({g.n, g.k}, o);
        const at::Tensor dy = at::randn({m, g.n}, o);
        operands_.push_back({x, w.t()});
        if (g.passes >= 2) operands_.push_back({dy.t(), x});
        if (g.passes >= 3) operands_.push_back({dy, w});
        continue;
      }
      auto operand = [&](int64_t rows, int64_t cols) {
        return at::randn({g.batch, rows, cols}, o);
      };
      operands_.push_back({operand(m, g.k), operand(g.k, g.n)});
      if (g.passes >= 2) operands_.push_back({operand(g.k, m), operand(m, g.n)});
      if (g.passes >= 3) operands_.push_back({operand(m, g.n), operand(g.n, g.k)});
    }
  }
  void Round() const {
    for (const auto& [a, b] : operands_) at::matmul(a, b);
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> operands_;
};

std::string Json(const BenchCase& c, int64_t tokens, double step_s, double flops, double work_flops,
                 double matmul_s, int iters, double accounting_flops) {
  // Rates of the work both sides do (causal attention at half), so that the ratio is the
  // baseline's time over the model's for the same products.
  const double model_gflops = work_flops / step_s / 1e9;
  const double matmul_gflops = work_flops * iters / matmul_s / 1e9;
  std::ostringstream out;
  out.precision(6);
  out << "{\"bench\":\"model_bench\",\"module\":\"" << c.module << "\",\"config\":\"" << c.config
      << "\",\"device\":\"" << c.device << "\",\"tp\":" << c.tp
      << ",\"sp\":" << (c.sp ? "true" : "false") << ",\"dtype\":\"" << nn::DtypeName(c.dtype)
      << "\",\"tokens_per_iter\":" << tokens << ",\"iters\":" << iters
      << ",\"step_ms\":" << step_s * 1e3 << ",\"tokens_per_s\":" << tokens / step_s
      << ",\"gemm_gflop_per_rank_per_iter\":" << flops / 1e9
      << ",\"work_gflop_per_rank_per_iter\":" << work_flops / 1e9
      << ",\"model_gflops_per_rank\":" << model_gflops
      << ",\"matmul_gflops_per_rank\":" << matmul_gflops << ",\"ratio_vs_matmul\":"
      << model_gflops / matmul_gflops
      // The run's accounting for the whole replica: its FLOPs per iteration, the replica's
      // achieved GFLOP/s, and its ratio to this bench's GEMM list times the TP size: 1 when the
      // two independent counts agree, below 1 where TP ranks repeat work the model does once
      // (the encoder's patch embedding at tp > 1: 0.913 for tiny at tp 2).
      << ",\"accounting_gflop_per_iter\":" << accounting_flops / 1e9
      << ",\"accounting_gflops\":" << accounting_flops / step_s / 1e9
      << ",\"accounting_vs_gemm_list\":" << accounting_flops / (flops * c.tp) << "}";
  return out.str();
}

absl::Status RunWorker(const BenchCase& c, const std::string& store_path, int rank,
                       const std::string& out_path) {
  at::set_num_threads(1);
  const bool cuda = c.device == "cuda";
  if (cuda && rank >= static_cast<int>(torch::cuda::device_count())) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device cuda: rank ", rank, " needs cuda:", rank, "; this machine shows ",
                     static_cast<int>(torch::cuda::device_count()), " CUDA device(s)"));
  }
  const c10::Device device =
      cuda ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank)) : c10::Device(c10::kCPU);
  // The rank's GPU as the current device: NCCL's group and the tensors the communicator moves to
  // "the current GPU" are there, not on GPU 0.
  if (cuda) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
  // Waits for the device's queued work, so that host clocks time it.
  const auto sync = [&] {
    if (cuda) torch::cuda::synchronize(rank);
  };
  std::unique_ptr<nn::Communicator> comm;
  if (c.tp == 1) {
    comm = nn::Communicator::CreateSingle();
  } else {
    HETPAR_ASSIGN_OR_RETURN(auto store, nn::OpenFileStore(store_path, c.tp));
    nn::CommunicatorOptions options;
    options.prefix = "model_bench/tp";
    options.rank = rank;
    options.size = c.tp;
    options.backend = cuda ? nn::Backend::kNccl : nn::Backend::kGloo;
    options.timeout = absl::Seconds(300);
    HETPAR_ASSIGN_OR_RETURN(comm, nn::Communicator::Create(store, options));
  }
  std::function<absl::Status()> step;
  std::vector<Gemm> gemms;
  // The replica's model FLOPs per iteration as the coordinator counts them (common/plan/flops.h),
  // against which the per-rank GEMM list (counted here, independently) is cross-checked.
  double accounting_flops = 0;
  int64_t tokens = 0;
  std::unique_ptr<encoder::VisionEncoder> vit;
  std::unique_ptr<llm::LanguageModel> lm;
  at::Tensor images, grad_output, image_rows;
  std::vector<llm::LlmSample> samples;
  if (c.module == "encoder") {
    int64_t n = 0;
    const auto model = EncoderConfig(c.config, &n);
    encoder::EncoderOptions options;
    options.dtype = c.dtype;
    options.sequence_parallel = c.sp;
    options.device = device;
    HETPAR_ASSIGN_OR_RETURN(vit, encoder::VisionEncoder::Create(model, options, *comm));
    // On the device already: the step times the model, not the loader's host-to-device copy.
    images = at::randn({n, model.channels(), model.image_size(), model.image_size()}).to(device);
    tokens = n * vit->tokens_per_image();
    grad_output = at::randn({tokens, model.out_hidden()}).to(device, c.dtype);
    gemms = EncoderGemms(model, n, c.tp);
    accounting_flops = static_cast<double>(n) * plan::EncoderImageFlops(model).total();
    step = [&]() -> absl::Status {
      HETPAR_ASSIGN_OR_RETURN(at::Tensor out, vit->Forward(images));
      HETPAR_RETURN_IF_ERROR(vit->Backward(out, grad_output));
      HETPAR_RETURN_IF_ERROR(vit->FinishGradients());
      vit->parameters().ZeroGrad();
      return absl::OkStatus();
    };
  } else {
    int64_t n = 0, rows_per_sample = 0;
    const auto model = LlmConfig(c.config, &n, &rows_per_sample);
    llm::LlmOptions options;
    options.dtype = c.dtype;
    options.sequence_parallel = c.sp;
    options.device = device;
    HETPAR_ASSIGN_OR_RETURN(lm, llm::LanguageModel::Create(model, options, *comm));
    std::vector<int64_t> lengths;
    int64_t loss_rows = 0;
    for (int64_t s = 0; s < n; ++s) {
      llm::LlmSample sample;
      sample.id = absl::StrCat("bench-", s);
      const int64_t length = model.seq_len();
      for (int64_t i = 0; i < length; ++i) {
        sample.tokens.push_back((i * 31 + s * 17) % model.vocab());
      }
      sample.labels.assign(length, 0);
      sample.loss_mask.assign(length, 0);
      for (int64_t i = 0; i + 1 < length; ++i) {
        sample.labels[i] = sample.tokens[i + 1];
        sample.loss_mask[i] = i >= 1 + rows_per_sample ? 1 : 0;
      }
      for (int64_t i = 0; i < rows_per_sample; ++i) sample.image_positions.push_back(1 + i);
      sample.image_rows = rows_per_sample;
      int64_t sample_loss_rows = 0;
      for (uint8_t m : sample.loss_mask) sample_loss_rows += m;
      loss_rows += sample_loss_rows;
      accounting_flops += plan::LlmSampleFlops(model, length, sample_loss_rows).total();
      lengths.push_back(length);
      tokens += length;
      samples.push_back(std::move(sample));
    }
    image_rows =
        at::randn({n * rows_per_sample, model.hidden()}).to(device, c.dtype).requires_grad_(true);
    gemms = LlmGemms(model, lengths, loss_rows, c.tp);
    step = [&, loss_rows]() -> absl::Status {
      HETPAR_ASSIGN_OR_RETURN(auto result, lm->Forward(samples, image_rows, loss_rows));
      HETPAR_RETURN_IF_ERROR(lm->Backward(result.loss));
      HETPAR_RETURN_IF_ERROR(lm->FinishGradients());
      lm->parameters().ZeroGrad();
      image_rows.mutable_grad() = at::Tensor();
      return absl::OkStatus();
    };
  }
  // Model steps and matmul rounds alternate, each between barriers, so that both see the same
  // background load on a shared machine.
  const MatmulBaseline baseline(gemms, c.dtype, device);
  // Warm-up: one round on the CPU; three on a GPU, whose first rounds also pick kernels (cuBLAS
  // heuristics, attention kernels) and whose clocks rise under load. A count, not a time: every
  // rank must run the same steps.
  for (int i = 0; i < (device.is_cuda() ? 3 : 1); ++i) {
    HETPAR_RETURN_IF_ERROR(step());
    baseline.Round();
  }
  sync();
  double step_s = 0, matmul_s = 0;
  for (int i = 0; i < c.iters; ++i) {
    HETPAR_RETURN_IF_ERROR(comm->Barrier());
    const auto t0 = Clock::now();
    HETPAR_RETURN_IF_ERROR(step());
    sync();
    HETPAR_RETURN_IF_ERROR(comm->Barrier());
    const auto t1 = Clock::now();
    baseline.Round();
    sync();
    HETPAR_RETURN_IF_ERROR(comm->Barrier());
    const auto t2 = Clock::now();
    step_s += std::chrono::duration<double>(t1 - t0).count();
    matmul_s += std::chrono::duration<double>(t2 - t1).count();
  }
  double flops = 0, work_flops = 0;
  for (const Gemm& g : gemms) {
    flops += g.Flops();
    work_flops += g.WorkFlops();
  }
  if (rank == 0) {
    std::ofstream out(out_path);
    out << Json(c, tokens, step_s / c.iters, flops, work_flops, matmul_s, c.iters, accounting_flops)
        << "\n";
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", out_path));
  }
  return absl::OkStatus();
}

// Starts `argv` with stdout and stderr appended to `log` (this process's stdout carries only its
// JSON lines); returns the pid or -1.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

// Runs one case in `tp` processes; returns rank 0's JSON line.
absl::StatusOr<std::string> RunCase(const BenchCase& c, const fs::path& dir, double timeout_s) {
  const std::string tag = absl::StrCat(c.module, "_", c.config, "_tp", c.tp);
  const std::string store = (dir / (tag + ".store")).string();
  const std::string out = (dir / (tag + ".json")).string();
  const std::string log = (dir / (tag + ".log")).string();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < c.tp; ++rank) {
    pid_t pid = Spawn({"model_bench",
                       "--worker",
                       "--module",
                       c.module,
                       "--config",
                       c.config,
                       "--tp",
                       std::to_string(c.tp),
                       "--rank",
                       std::to_string(rank),
                       "--store",
                       store,
                       "--out",
                       out,
                       "--iters",
                       std::to_string(c.iters),
                       "--dtype",
                       nn::DtypeName(c.dtype),
                       c.sp ? "--sp" : "--no-sp",
                       "--device",
                       c.device},
                      log);
    if (pid < 0) return absl::InternalError(absl::StrCat(tag, ": cannot start a worker"));
    pids.push_back(pid);
  }
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  bool failed = false;
  for (pid_t pid : pids) {
    int status = 0;
    while (true) {
      const pid_t done = waitpid(pid, &status, WNOHANG);
      if (done == pid) break;
      if (Clock::now() > deadline) {
        for (pid_t p : pids) kill(p, SIGKILL);
        waitpid(pid, &status, 0);
        failed = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = true;
  }
  std::ifstream log_in(log);
  std::stringstream log_text;
  log_text << log_in.rdbuf();
  if (failed) {
    return absl::InternalError(
        absl::StrCat(tag, ": a worker failed or ran past ", timeout_s, " s:\n", log_text.str()));
  }
  std::ifstream json(out);
  std::string line;
  if (!std::getline(json, line)) {
    return absl::InternalError(absl::StrCat(tag, ": no result in ", out));
  }
  return line;
}

constexpr char kUsage[] =
    "usage: model_bench [--configs tiny,mid,gpu] [--modules encoder,llm] [--tp 1,2] [--iters N] "
    "[--dtype float32|float64|bfloat16] [--sp] [--device cpu|cuda]\n"
    "Forward+backward throughput of hetpar's encoder and LLM against at::matmul on the same GEMM "
    "shapes in the same run; one JSON line per case (see the comment at the top of "
    "bench/model_bench.cc).\n";

int Main(int argc, char** argv) {
  BenchCase worker;
  bool is_worker = false;
  std::string store, out;
  int rank = 0;
  std::vector<std::string> configs = {"tiny", "mid"};
  std::vector<std::string> modules = {"encoder", "llm"};
  std::vector<int> tps = {1, 2};
  bool ok = true;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      return 0;
    } else if (flag == "--worker") {
      is_worker = true;
    } else if (flag == "--sp") {
      worker.sp = true;
    } else if (flag == "--no-sp") {
      worker.sp = false;
    } else if (flag == "--module") {
      worker.module = value();
    } else if (flag == "--config") {
      worker.config = value();
    } else if (flag == "--store") {
      store = value();
    } else if (flag == "--out") {
      out = value();
    } else if (flag == "--rank") {
      ok &= absl::SimpleAtoi(value(), &rank);
    } else if (flag == "--tp" && is_worker) {
      ok &= absl::SimpleAtoi(value(), &worker.tp) && worker.tp >= 1;
    } else if (flag == "--tp") {
      tps.clear();
      for (auto part : absl::StrSplit(value(), ',')) {
        int tp = 0;
        ok &= absl::SimpleAtoi(part, &tp) && tp >= 1;
        tps.push_back(tp);
      }
    } else if (flag == "--iters") {
      ok &= absl::SimpleAtoi(value(), &worker.iters) && worker.iters >= 1;
    } else if (flag == "--configs") {
      configs = absl::StrSplit(value(), ',');
    } else if (flag == "--modules") {
      modules = absl::StrSplit(value(), ',');
    } else if (flag == "--device") {
      worker.device = value();
      if (worker.device != "cpu" && worker.device != "cuda") {
        std::cerr << "model_bench: --device " << worker.device << ": expected cpu or cuda\n";
        return 2;
      }
    } else if (flag == "--dtype") {
      const std::string name = value();
      if (name == "float64") {
        worker.dtype = at::kDouble;
      } else if (name == "bfloat16") {
        worker.dtype = at::kBFloat16;
      } else if (name == "float32") {
        worker.dtype = at::kFloat;
      } else {
        std::cerr << "model_bench: --dtype " << name << ": expected float32, float64, bfloat16\n";
        return 2;
      }
    } else {
      std::cerr << "model_bench: unknown flag " << flag << "\n" << kUsage;
      return 2;
    }
  }
  if (!ok) {
    std::cerr << "model_bench: --tp, --rank and --iters take positive integers\n";
    return 2;
  }
  for (const std::string& config : is_worker ? std::vector<std::string>{worker.config} : configs) {
    if (config != "tiny" && config != "mid" && config != "gpu") {
      std::cerr << "model_bench: config '" << config << "': expected tiny, mid or gpu\n";
      return 2;
    }
  }
  for (const std::string& module : is_worker ? std::vector<std::string>{worker.module} : modules) {
    if (module != "encoder" && module != "llm") {
      std::cerr << "model_bench: module '" << module << "': expected encoder or llm\n";
      return 2;
    }
  }
  if (is_worker) {
    absl::Status status = RunWorker(worker, store, rank, out);
    if (!status.ok()) {
      std::cerr << "model_bench worker " << rank << ": " << status << "\n";
      return 1;
    }
    return 0;
  }
  const fs::path dir =
      fs::temp_directory_path() / ("hetpar_model_bench_" + std::to_string(getpid()));
  fs::create_directories(dir);
  int exit_code = 0;
  for (const std::string& config : configs) {
    for (const std::string& module : modules) {
      for (int tp : tps) {
        BenchCase c = worker;
        c.module = module;
        c.config = config;
        c.tp = tp;
        if (c.iters == 0) c.iters = config == "tiny" ? 20 : config == "gpu" ? 10 : 3;
        // A rank per GPU: a tp the machine cannot hold is skipped, saying so, rather than left
        // to wait for ranks that cannot start.
        if (c.device == "cuda" && tp > static_cast<int>(torch::cuda::device_count())) {
          std::cout << "{\"bench\":\"model_bench\",\"module\":\"" << module << "\",\"config\":\""
                    << config << "\",\"device\":\"cuda\",\"tp\":" << tp << ",\"skipped\":\"tp "
                    << tp << " runs a rank per GPU; this machine shows "
                    << static_cast<int>(torch::cuda::device_count()) << " CUDA device(s)\"}"
                    << std::endl;
          continue;
        }
        auto line = RunCase(c, dir, 600);
        if (!line.ok()) {
          std::cerr << "model_bench: " << line.status().message() << "\n";
          exit_code = 1;
          continue;
        }
        std::cout << *line << std::endl;
      }
    }
  }
  fs::remove_all(dir);
  return exit_code;
}

}  // namespace
}  // namespace hetpar::bench

int main(int argc, char** argv) { return hetpar::bench::Main(argc, argv); }
