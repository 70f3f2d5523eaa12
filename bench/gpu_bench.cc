// gpu_bench: the GPU baselines that hetpar's GPU figures are measured against, and one
// transformer layer written with ATen ops measured against them. JSON lines on stdout.
//
//   gpu_bench [--hidden 2048] [--mlp 8192] [--heads 16] [--kv-heads 8] [--tokens 4096]
//             [--seq-len 2048] [--iters 20] [--repeats 5] [--copy-mib 32] [--device cuda|cpu]
//
// The default sizes are one layer of a ~1B-parameter LLM. Lines (each names its figure and
// units; "value" is the figure):
//
//   figure "device"             the GPU, its multiprocessors and memory, libtorch's version
//   figure "matmul_bf16"        TFLOP/s of at::matmul in bfloat16 on the GEMMs of one layer (QKV,
//                               output projection, gate, up, down), each in its forward,
//                               input-gradient and weight-gradient shape: the baseline
//   figure "sdpa_bf16"          TFLOP/s of causal GQA at::scaled_dot_product_attention forward +
//                               backward (causal FLOPs: half the full score matrix), its kernel
//   figure "layer_bf16"         TFLOP/s of one layer forward + backward (RMSNorm, QKV, causal GQA
//                               attention, output projection, SwiGLU MLP, residuals; no RoPE)
//                               written with ATen ops here, and layer_vs_matmul, its ratio to
//                               matmul_bf16: the ATen-only ceiling for hetpar's LLM layer on CUDA.
//                               hetpar's own models run on CUDA (run.device: cuda trains them);
//                               their figure is model_bench --device cuda (ratio_vs_matmul)
//   figure "d2d_copy"           GB/s of at::Tensor::copy_ between two CUDA tensors of --copy-mib
//                               MiB (bytes copied per second; each byte is read once and written
//                               once): the baseline of a device-to-device boundary transfer. The
//                               boundary figure itself is transport_bw --memory cuda: two
//                               processes on one GPU over hetpar's CUDA UCX transport against the
//                               same copy of the same bytes, in one run (hetpar_vs_d2d)
//
// FLOPs are counted from the shapes (2 m k n per GEMM; the layer's backward as twice its forward
// GEMMs and 2.5 times its forward attention, FlashAttention's convention); elementwise work is
// not counted. Timing: torch::cuda::synchronize() around loops of --iters iterations after a
// warm-up of at least half a second (clocks ramp up), --repeats loops, the median loop reported.
//
// Without a CUDA device it prints {"bench":"gpu","skipped":"no CUDA device: ..."} and exits 0.
// --device cpu runs the same code on the CPU: a check of the bench itself on a machine without a
// GPU, with the shapes given (the defaults are a GPU's; give small ones, e.g. --hidden 64 --mlp
// 128 --heads 4 --kv-heads 2 --tokens 64 --iters 2 --repeats 1). Its figures say nothing about
// GPUs.
// A figure that fails prints {"bench":"gpu","figure":...,"error":...} and the exit status is 1.
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/nn/sdp_backend.h"
#include "nlohmann/json.hpp"

#if HETPAR_GPU_BENCH_HAS_CUDA_HEADERS
#include <ATen/cuda/CUDAContext.h>
#endif

namespace hetpar::bench {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;

constexpr int64_t kDefaultSeqLen = 2048;

struct LayerShape {
  int64_t hidden = 2048;
  int64_t mlp = 8192;
  int64_t heads = 16;
  int64_t kv_heads = 8;
  int64_t tokens = 4096;   // rows of the packed microbatch
  int64_t seq_len = kDefaultSeqLen;  // tokens per sample (attention runs per sample)

  int64_t head_dim() const { return hidden / heads; }
  int64_t samples() const { return tokens / seq_len; }
};

struct Timing {
  int iters = 20;
  int repeats = 5;
};

// Where the bench computes: CUDA, or the CPU for --device cpu.
at::Device g_device(at::kCUDA);

// Waits for the device's queued work.
void Synchronize() {
  if (g_device.is_cuda()) torch::cuda::synchronize();
}

// Why there is nothing to measure here; empty when a CUDA device is visible.
std::string NoCudaReason() {
  if (torch::cuda::is_available()) return "";
  std::string reason = "no CUDA device: torch::cuda::is_available() is false, device_count() = " +
                       std::to_string(static_cast<int>(torch::cuda::device_count()));
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    reason += " (CUDA_VISIBLE_DEVICES=\"" + std::string(visible) + "\")";
  }
  return reason;
}

json Line(const std::string& figure) { return {{"bench", "gpu"}, {"figure", figure}}; }

void Print(const json& line) { std::cout << line.dump() << std::endl; }

// Seconds per call of `fn`: warm-up (at least 3 calls and half a second), then `repeats` timed
// loops of `iters` calls, each between two device synchronisations; the median loop.
double SecondsPerCall(const std::function<void()>& fn, const Timing& timing) {
  const auto warm_until = Clock::now() + std::chrono::milliseconds(500);
  for (int i = 0; i < 3 || Clock::now() < warm_until; ++i) {
    fn();
    Synchronize();
  }
  std::vector<double> loops;
  for (int r = 0; r < timing.repeats; ++r) {
    Synchronize();
    const auto start = Clock::now();
    for (int i = 0; i < timing.iters; ++i) fn();
    Synchronize();
    loops.push_back(std::chrono::duration<double>(Clock::now() - start).count() / timing.iters);
  }
  std::sort(loops.begin(), loops.end());
  return loops[loops.size() / 2];
}

at::TensorOptions Bf16() { return at::TensorOptions().dtype(at::kBFloat16).device(g_device); }

// One linear layer y = x W^T of the LLM layer: x [tokens, in], W [out, in].
struct Linear {
  std::string name;
  int64_t in = 0;
  int64_t out = 0;
};

std::vector<Linear> LayerLinears(const LayerShape& s) {
  const int64_t d = s.head_dim();
  return {{"qkv", s.hidden, (s.heads + 2 * s.kv_heads) * d},
          {"proj", s.hidden, s.hidden},
          {"gate", s.hidden, s.mlp},
          {"up", s.hidden, s.mlp},
          {"down", s.mlp, s.hidden}};
}

// FLOPs of the layer's forward GEMMs.
double ForwardGemmFlops(const LayerShape& s) {
  double flops = 0;
  for (const Linear& l : LayerLinears(s)) flops += 2.0 * s.tokens * l.in * l.out;
  return flops;
}

// FLOPs of causal attention forward: QK^T and PV over half the score matrix.
double ForwardAttentionFlops(const LayerShape& s) {
  return 2.0 * 2.0 * s.samples() * s.heads * s.seq_len * s.seq_len * s.head_dim() / 2.0;
}

// (a) at::matmul on every GEMM of the layer in its three shapes: forward x W^T, input gradient
// dY W, weight gradient dY^T x.
json MatmulBaseline(const LayerShape& s, const Timing& timing) {
  struct Operands {
    at::Tensor x, w, dy;
  };
  std::vector<Operands> operands;
  for (const Linear& l : LayerLinears(s)) {
    operands.push_back({at::randn({s.tokens, l.in}, Bf16()), at::randn({l.out, l.in}, Bf16()),
                        at::randn({s.tokens, l.out}, Bf16())});
  }
  const double seconds = SecondsPerCall(
      [&] {
        for (const Operands& o : operands) {
          at::matmul(o.x, o.w.t());
          at::matmul(o.dy, o.w);
          at::matmul(o.dy.t(), o.x);
        }
      },
      timing);
  const double flops = 3.0 * ForwardGemmFlops(s);
  json line = Line("matmul_bf16");
  line["value"] = flops / seconds / 1e12;
  line["units"] = "TFLOP/s";
  line["ms_per_iter"] = seconds * 1e3;
  line["flops_per_iter"] = flops;
  line["gemms"] = 3 * operands.size();
  json shapes = json::array();
  for (const Linear& l : LayerLinears(s)) {
    shapes.push_back({{"name", l.name}, {"tokens", s.tokens}, {"in", l.in}, {"out", l.out}});
  }
  line["linears"] = shapes;
  return line;
}

struct LayerWeights {
  at::Tensor attn_norm, qkv, proj, mlp_norm, gate, up, down;

  std::vector<at::Tensor> All() const { return {attn_norm, qkv, proj, mlp_norm, gate, up, down}; }
};

LayerWeights MakeWeights(const LayerShape& s) {
  const double std = 0.02;
  auto weight = [&](int64_t out, int64_t in) {
    return (at::randn({out, in}, Bf16()) * std).requires_grad_(true);
  };
  LayerWeights w;
  w.attn_norm = at::ones({s.hidden}, Bf16()).requires_grad_(true);
  w.qkv = weight((s.heads + 2 * s.kv_heads) * s.head_dim(), s.hidden);
  w.proj = weight(s.hidden, s.hidden);
  w.mlp_norm = at::ones({s.hidden}, Bf16()).requires_grad_(true);
  w.gate = weight(s.mlp, s.hidden);
  w.up = weight(s.mlp, s.hidden);
  w.down = weight(s.hidden, s.mlp);
  return w;
}

// [tokens, n * d] columns [first * d, (first + n) * d) -> [samples, n, seq_len, d].
at::Tensor Heads(const at::Tensor& qkv, int64_t first, int64_t n, const LayerShape& s) {
  const int64_t d = s.head_dim();
  return qkv.narrow(1, first * d, n * d).view({s.samples(), s.seq_len, n, d}).transpose(1, 2);
}

at::Tensor Attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, /*scale=*/std::nullopt,
                                          /*enable_gqa=*/true);
}

at::Tensor LayerForward(const at::Tensor& x, const LayerWeights& w, const LayerShape& s) {
  const double eps = 1e-5;
  at::Tensor h = at::rms_norm(x, {s.hidden}, w.attn_norm, eps);
  const at::Tensor qkv = at::linear(h, w.qkv);
  const at::Tensor attention =
      Attention(Heads(qkv, 0, s.heads, s), Heads(qkv, s.heads, s.kv_heads, s),
                Heads(qkv, s.heads + s.kv_heads, s.kv_heads, s))
          .transpose(1, 2)
          .reshape({s.tokens, s.hidden});
  const at::Tensor mid = x + at::linear(attention, w.proj);
  h = at::rms_norm(mid, {s.hidden}, w.mlp_norm, eps);
  const at::Tensor inner = at::silu(at::linear(h, w.gate)) * at::linear(h, w.up);
  return mid + at::linear(inner, w.down);
}

// Attention alone, forward + backward, on the layer's shapes.
json AttentionFigure(const LayerShape& s, const Timing& timing) {
  const int64_t d = s.head_dim();
  auto leaf = [&](int64_t heads) {
    return at::randn({s.samples(), heads, s.seq_len, d}, Bf16()).requires_grad_(true);
  };
  const at::Tensor q = leaf(s.heads), k = leaf(s.kv_heads), v = leaf(s.kv_heads);
  const at::Tensor grad_out = at::randn({s.samples(), s.heads, s.seq_len, d}, Bf16());
  const int64_t choice =
      at::_fused_sdp_choice(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt, true);
  const double seconds = SecondsPerCall(
      [&] {
        Attention(q, k, v).backward(grad_out);
        for (const at::Tensor& t : {q, k, v}) t.mutable_grad().reset();
      },
      timing);
  const double flops = 3.5 * ForwardAttentionFlops(s);
  json line = Line("sdpa_bf16");
  line["value"] = flops / seconds / 1e12;
  line["units"] = "TFLOP/s";
  line["ms_per_iter"] = seconds * 1e3;
  line["flops_per_iter"] = flops;
  line["backend"] = nn::SdpBackendName(choice);
  return line;
}

// (b) one layer forward + backward.
json LayerFigure(const LayerShape& s, const Timing& timing, double matmul_tflops) {
  const LayerWeights w = MakeWeights(s);
  const at::Tensor x = at::randn({s.tokens, s.hidden}, Bf16()).requires_grad_(true);
  const at::Tensor grad_out = at::randn({s.tokens, s.hidden}, Bf16());
  std::vector<at::Tensor> leaves = w.All();
  leaves.push_back(x);
  const double seconds = SecondsPerCall(
      [&] {
        LayerForward(x, w, s).backward(grad_out);
        for (const at::Tensor& t : leaves) t.mutable_grad().reset();
      },
      timing);
  const double gemm_flops = 3.0 * ForwardGemmFlops(s);
  const double attention_flops = 3.5 * ForwardAttentionFlops(s);
  const double flops = gemm_flops + attention_flops;
  const double tflops = flops / seconds / 1e12;
  json line = Line("layer_bf16");
  line["value"] = tflops;
  line["units"] = "TFLOP/s";
  line["layer_vs_matmul"] = matmul_tflops > 0 ? json(tflops / matmul_tflops) : json(nullptr);
  line["ms_per_iter"] = seconds * 1e3;
  line["flops_per_iter"] = flops;
  line["attention_flops_share"] = attention_flops / flops;
  return line;
}

// (c) device-to-device copy.
json CopyFigure(int64_t mib, const Timing& timing) {
  const int64_t bytes = mib << 20;
  const auto options = at::TensorOptions().dtype(at::kByte).device(g_device);
  const at::Tensor src = at::full({bytes}, 7, options);
  at::Tensor dst = at::empty({bytes}, options);
  Timing copies = timing;
  copies.iters = std::max(copies.iters, 100);
  const double seconds = SecondsPerCall([&] { dst.copy_(src); }, copies);
  json line = Line("d2d_copy");
  line["value"] = static_cast<double>(bytes) / seconds / 1e9;
  line["units"] = "GB/s";
  line["bytes"] = bytes;
  line["us_per_copy"] = seconds * 1e6;
  line["checked"] = dst.equal(src);
  return line;
}

json DeviceLine() {
  json line = Line("device");
  line["device"] = g_device.str();
  line["devices"] = static_cast<int>(torch::cuda::device_count());
  line["torch"] = TORCH_VERSION;
  if (!g_device.is_cuda()) return line;
#if HETPAR_GPU_BENCH_HAS_CUDA_HEADERS
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  line["name"] = props->name;
  line["multiprocessors"] = props->multiProcessorCount;
  line["memory_gib"] = static_cast<double>(props->totalGlobalMem) / (1 << 30);
  line["compute_capability"] = std::to_string(props->major) + "." + std::to_string(props->minor);
#endif
  return line;
}

// Runs one figure; a failure becomes an error line.
bool Run(const std::string& figure, const std::function<json()>& fn, json* out = nullptr) {
  try {
    json line = fn();
    Print(line);
    if (out != nullptr) *out = line;
    return true;
  } catch (const std::exception& e) {
    json line = Line(figure);
    line["error"] = e.what();
    Print(line);
    return false;
  }
}

int Main(int argc, char** argv) {
  LayerShape shape;
  Timing timing;
  int64_t copy_mib = 32;
  CLI::App app{
      "gpu_bench: bf16 matmul, attention and one transformer layer on a CUDA device, "
      "and device-to-device copies (JSON lines on stdout)"};
  app.add_option("--hidden", shape.hidden, "hidden size")->check(CLI::PositiveNumber);
  app.add_option("--mlp", shape.mlp, "MLP inner size")->check(CLI::PositiveNumber);
  app.add_option("--heads", shape.heads, "query heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", shape.kv_heads, "key/value heads")->check(CLI::PositiveNumber);
  app.add_option("--tokens", shape.tokens, "tokens of the packed microbatch")
      ->check(CLI::PositiveNumber);
  CLI::Option* seq_len =
      app.add_option("--seq-len", shape.seq_len,
                     "tokens per sample (default: 2048 where it divides --tokens, else --tokens)")
          ->check(CLI::PositiveNumber);
  app.add_option("--iters", timing.iters, "iterations per timed loop")->check(CLI::PositiveNumber);
  app.add_option("--repeats", timing.repeats, "timed loops (the median is reported)")
      ->check(CLI::PositiveNumber);
  app.add_option("--copy-mib", copy_mib, "size of the device-to-device copy")
      ->check(CLI::PositiveNumber);
  std::string device = "cuda";
  app.add_option("--device", device, "cuda, or cpu to check the bench itself without a GPU")
      ->check(CLI::IsMember({"cuda", "cpu"}));
  CLI11_PARSE(app, argc, argv);
  g_device = device == "cpu" ? at::Device(at::kCPU) : at::Device(at::kCUDA);
  // By default two samples of 2048 in the 4096 rows, as model_bench --configs gpu packs its LLM
  // microbatch, so layer_bf16 and model_bench's LLM line attend over the same lengths.
  if (seq_len->count() == 0) {
    shape.seq_len = shape.tokens % kDefaultSeqLen == 0 ? kDefaultSeqLen : shape.tokens;
  }
  if (shape.hidden % shape.heads != 0 || shape.heads % shape.kv_heads != 0 ||
      shape.tokens % shape.seq_len != 0) {
    std::cerr << "gpu_bench: --hidden " << shape.hidden << " must divide by --heads " << shape.heads
              << ", --heads by --kv-heads " << shape.kv_heads << ", and --tokens " << shape.tokens
              << " by --seq-len " << shape.seq_len << "\n";
    return 2;
  }

  const std::string no_cuda = g_device.is_cuda() ? NoCudaReason() : "";
  if (!no_cuda.empty()) {
    Print({{"bench", "gpu"}, {"skipped", no_cuda}});
    return 0;
  }

  bool ok = Run("device", DeviceLine);
  json shape_line = Line("shape");
  shape_line["hidden"] = shape.hidden;
  shape_line["mlp"] = shape.mlp;
  shape_line["heads"] = shape.heads;
  shape_line["kv_heads"] = shape.kv_heads;
  shape_line["tokens"] = shape.tokens;
  shape_line["seq_len"] = shape.seq_len;
  shape_line["iters"] = timing.iters;
  shape_line["repeats"] = timing.repeats;
  Print(shape_line);
  json matmul;
  ok &= Run(
      "matmul_bf16", [&] { return MatmulBaseline(shape, timing); }, &matmul);
  const double matmul_tflops = matmul.contains("value") ? matmul["value"].get<double>() : 0.0;
  ok &= Run("sdpa_bf16", [&] { return AttentionFigure(shape, timing); });
  ok &= Run("layer_bf16", [&] { return LayerFigure(shape, timing, matmul_tflops); });
  ok &= Run("d2d_copy", [&] { return CopyFigure(copy_mib, timing); });
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace hetpar::bench

int main(int argc, char** argv) { return hetpar::bench::Main(argc, argv); }
