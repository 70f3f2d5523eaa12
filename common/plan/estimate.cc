#include "common/plan/estimate.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/plan/flops.h"

namespace hetpar::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Seconds of an all-gather or a reduce-scatter whose full result is `bytes`.
double GatherSeconds(const LinkSpec& link, int64_t ranks, double bytes) {
  if (ranks <= 1) return 0;
  const double n = static_cast<double>(ranks);
  return link.collective_latency_s + (n - 1) / n * bytes / (link.collective_gbps * 1e9);
}

double P2pSeconds(const LinkSpec& link, int64_t messages, double bytes) {
  if (messages <= 0) return 0;
  return static_cast<double>(messages) * link.p2p_latency_s + bytes / (link.p2p_gbps * 1e9);
}

// TP collectives of a count: all-reduces, or under sequence parallelism an all-gather and a
// reduce-scatter in place of each (twice the latencies, the same bytes on the wire).
double TpSeconds(const LinkSpec& link, int64_t tp, bool sp, const CollectiveCount& c) {
  if (tp <= 1) return 0;
  const double n = static_cast<double>(tp);
  const double per_byte = 2.0 * (n - 1) / n / (link.collective_gbps * 1e9);
  const double latency = link.collective_latency_s * static_cast<double>(c.all_reduces);
  return (sp ? 2.0 * latency : latency) + c.all_reduce_bytes * per_byte;
}

// The time one of `tp` ranks spends on the share of a module's work that TP does not divide
// (Amdahl): (1 - f) (1 - 1/tp) of the work at full rate.
double UndividedSeconds(double parallel_fraction, int64_t tp, double flops, double rate) {
  return (1.0 - parallel_fraction) * (1.0 - 1.0 / static_cast<double>(tp)) * flops / rate;
}

// A roofline (Williams et al. 2009): a matrix product takes the longer of its FLOPs at the rate
// and its operands' and result's bytes at the memory bandwidth. Narrow TP shards of small models
// fall under the memory bound.
struct Roofline {
  double rate = 0;        // FLOP/s
  double memory_bps = 0;  // bytes/s
  double element_bytes = 0;
};

struct PassSeconds {
  double forward = 0;
  double backward = 0;
};

// [m x k] @ [k x n], `count` times, forward once and `backward_passes` products of the same size
// backward.
void AddGemm(const Roofline& r, double m, double k, double n, double count, double backward_passes,
             PassSeconds* out) {
  const double flops = 2.0 * m * k * n;
  const double bytes = (m * k + k * n + m * n) * r.element_bytes;
  const double seconds = count * std::max(flops / r.rate, bytes / r.memory_bps);
  out->forward += seconds;
  out->backward += backward_passes * seconds;
}

// The products of flops.h for one LLM microbatch on one rank: `layers` layers of the samples'
// rows split over cp, their attention per sample, the output head at the loss tokens; TP shards.
PassSeconds LlmMicrobatchSeconds(const v1::LlmModel& model, const std::vector<double>& lengths,
                                 double loss_tokens, int64_t layers, int64_t tp, int64_t cp,
                                 const Roofline& r) {
  const double h = model.hidden(), f = model.ffn(), v = model.vocab();
  const double heads = model.heads() > 0 ? model.heads() : 1;
  const double d = h / heads;
  const double kv = model.kv_heads() > 0 ? model.kv_heads() : heads;
  const double t = static_cast<double>(tp), c = static_cast<double>(cp);
  double rows = 0;
  for (double len : lengths) rows += len / c;
  PassSeconds p;
  for (int64_t l = 0; l < layers; ++l) {
    AddGemm(r, rows, h, (h + 2 * kv * d) / t, 1, 2, &p);  // qkv
    for (double len : lengths) {
      AddGemm(r, len / c, d, len, heads / t, 2, &p);  // scores
      AddGemm(r, len / c, len, d, heads / t, 2, &p);  // weighted values
    }
    AddGemm(r, rows, h / t, h, 1, 2, &p);  // out projection
    AddGemm(r, rows, h, f / t, 2, 2, &p);  // gate, up
    AddGemm(r, rows, f / t, h, 1, 2, &p);  // down
  }
  AddGemm(r, loss_tokens / c, h, v / t, 1, 2, &p);  // output head
  return p;
}

// The products of flops.h for an encoder job of `images` images on one rank.
PassSeconds EncoderJobSeconds(const v1::EncoderModel& model, double images, int64_t tp,
                              const Roofline& r) {
  const double h = model.hidden(), mlp = model.mlp(), o = model.out_hidden();
  const double heads = model.heads() > 0 ? model.heads() : 1;
  const double d = h / heads;
  const double per_side = model.patch() > 0 ? model.image_size() / model.patch() : 0;
  const double patches = per_side * per_side;
  const double channels = model.channels() > 0 ? model.channels() : 3;
  const double rows = images * patches;
  const double t = static_cast<double>(tp);
  PassSeconds p;
  AddGemm(r, rows, channels * model.patch() * model.patch(), h, 1, 1, &p);  // patch embedding
  for (int64_t l = 0; l < model.layers(); ++l) {
    AddGemm(r, rows, h, 3 * h / t, 1, 2, &p);
    AddGemm(r, patches, d, patches, images * heads / t, 2, &p);
    AddGemm(r, patches, patches, d, images * heads / t, 2, &p);
    AddGemm(r, rows, h / t, h, 1, 2, &p);
    AddGemm(r, rows, h, mlp / t, 1, 2, &p);
    AddGemm(r, rows, mlp / t, h, 1, 2, &p);
  }
  AddGemm(r, rows, h, o / t, 1, 2, &p);  // projector
  AddGemm(r, rows, o / t, o, 1, 2, &p);
  return p;
}

const LinkSpec& LinkFor(const ClusterSpec& cluster, int64_t span) {
  return span <= cluster.devices_per_node ? cluster.intra_node : cluster.inter_node;
}

// Activation bytes of one transformer layer for s positions x b sequences (Korthikanti et al.
// 2022, eq. 2-4), scaled from 16-bit to the run's dtype. Without their 5 a s / h term: the models'
// attention is at::scaled_dot_product_attention, whose flash and memory-efficient kernels (the
// ones it picks for hetpar's calls, on the CPU and on GPUs) keep only the output and the
// log-sum-exp for backward, not the s x s scores and softmax.
double LayerActivationBytes(double s, double b, double h, int64_t tp, bool sp,
                            int64_t dtype_bytes) {
  const double t = static_cast<double>(tp);
  double per = 0;
  if (tp <= 1) {
    per = 34.0;
  } else if (sp) {
    per = 34.0 / t;
  } else {
    per = 10.0 + 24.0 / t;
  }
  return s * b * h * per * static_cast<double>(dtype_bytes) / 2.0;
}

// Bytes per parameter of weights, gradients and AdamW state.
double StateBytesPerParameter(int64_t dtype_bytes, v1::Dtype dtype) {
  const double moments = dtype == v1::DTYPE_FLOAT64 ? 16.0 : 8.0;
  const double master = dtype == v1::DTYPE_BFLOAT16 ? 4.0 : 0.0;
  return 2.0 * static_cast<double>(dtype_bytes) + moments + master;
}

double OptimizerSeconds(const ClusterSpec& cluster, double parameters, v1::Dtype dtype) {
  const double value_bytes = dtype == v1::DTYPE_FLOAT64 ? 8.0 : 4.0;
  return parameters * 7.0 * value_bytes / (cluster.memory_gbps * 1e9);
}

}  // namespace

CollectiveCount LlmTpCollectives(const v1::LlmModel& model, int64_t layers, int64_t tokens,
                                 int64_t image_rows, int64_t loss_tokens, int64_t dtype_bytes) {
  const double h = static_cast<double>(model.hidden());
  const double row = h * static_cast<double>(dtype_bytes);
  CollectiveCount c;
  // Per layer: two row-parallel outputs forward, two column-parallel inputs backward.
  c.all_reduces = 4 * layers;
  c.all_reduce_bytes = 4.0 * static_cast<double>(layers) * static_cast<double>(tokens) * row;
  // Embedding (forward), final norm (backward), image rows and their gradient.
  c.all_reduces += 4;
  c.all_reduce_bytes +=
      2.0 * static_cast<double>(tokens) * row + 2.0 * static_cast<double>(image_rows) * row;
  // Vocabulary-parallel cross-entropy: max, sum of exponentials, target logit.
  c.all_reduces += 3;
  c.all_reduce_bytes += 3.0 * static_cast<double>(loss_tokens) * 4.0;
  return c;
}

CollectiveCount EncoderTpCollectives(const v1::EncoderModel& model, int64_t images,
                                     int64_t dtype_bytes) {
  const int64_t per_side = model.patch() > 0 ? model.image_size() / model.patch() : 0;
  const double rows = static_cast<double>(images * per_side * per_side);
  const double layers = static_cast<double>(model.layers());
  CollectiveCount c;
  // Per layer two forward, two backward; the projector one each way; the output gradient one.
  c.all_reduces = 4 * model.layers() + 3;
  c.all_reduce_bytes =
      rows * static_cast<double>(dtype_bytes) *
      (4.0 * layers * static_cast<double>(model.hidden()) +
       2.0 * static_cast<double>(model.out_hidden()) + static_cast<double>(model.out_hidden()));
  return c;
}

double AllReduceSeconds(const LinkSpec& link, int64_t ranks, double bytes) {
  if (ranks <= 1) return 0;
  const double n = static_cast<double>(ranks);
  return link.collective_latency_s + 2.0 * (n - 1) / n * bytes / (link.collective_gbps * 1e9);
}

double EncoderParameters(const v1::EncoderModel& m) {
  const double h = m.hidden(), mlp = m.mlp();
  const double channels = m.channels() > 0 ? m.channels() : 3;
  const double per_side = m.patch() > 0 ? m.image_size() / m.patch() : 0;
  const double patches = per_side * per_side;
  const double embed = channels * m.patch() * m.patch() * h + h + patches * h;
  const double layer = 3 * h * h + 3 * h + h * h + h + h * mlp + mlp + mlp * h + h + 4 * h;
  const double final_norm = m.no_final_norm() ? 0 : 2 * h;
  return embed + m.layers() * layer + final_norm + EncoderProjectorParameters(m);
}

double EncoderProjectorParameters(const v1::EncoderModel& m) {
  const double h = m.hidden(), o = m.out_hidden();
  return h * o + o + o * o + o;
}

double LlmParameters(const v1::LlmModel& m) {
  const double h = m.hidden(), f = m.ffn(), v = m.vocab();
  const double heads = m.heads() > 0 ? m.heads() : 1;
  const double kv = m.kv_heads() > 0 ? m.kv_heads() : heads;
  const double d = h / heads;
  const double layer = h * (h + 2 * kv * d) + h * h + 3 * h * f + 2 * h;
  return 2 * v * h + m.layers() * layer + h;
}

namespace {

// The share of the step during which the other module computes, for TP groups on shared devices
// (non-colocated): their collectives' latency moves from the idle figure towards the loaded one
// in proportion.
struct OtherLoad {
  double on_encoder = 0;
  double on_llm = 0;
};

absl::StatusOr<StepEstimate> EstimateWith(const v1::RunSpec& spec, const StepPlan& plan,
                                          const ClusterSpec& cluster, const OtherLoad& load) {
  const Placement& pl = plan.placement;
  const Layout& el = pl.encoder;
  const Layout& ll = pl.llm;
  const bool colocated = pl.kind == PlacementKind::kColocated;
  StepEstimate out;
  out.placement = colocated ? "colocated" : "non_colocated";
  out.encoder = el;
  out.llm = ll;
  out.devices = pl.world_size;
  if (cluster.devices() > 0 && out.devices > cluster.devices() && !cluster.share_devices) {
    return absl::InvalidArgumentError(absl::StrCat("the placement needs ", out.devices,
                                                   " devices; cluster ", cluster.name, " has ",
                                                   cluster.devices()));
  }
  if (cluster.devices() > 0 && out.devices > cluster.devices()) {
    out.notes.push_back(
        absl::StrCat(out.devices, " ranks share the cluster's ", cluster.devices(), " devices"));
  }
  for (const auto& [group, size] :
       {std::pair<const char*, int64_t>{"encoder tp", el.tp},
        std::pair<const char*, int64_t>{"llm tp x cp", ll.tp * ll.cp}}) {
    if (size > cluster.devices_per_node && !cluster.share_devices) {
      return absl::InvalidArgumentError(
          absl::StrCat(group, " = ", size, " spans more than a node of ", cluster.devices_per_node,
                       " devices; TP and CP groups stay inside a node"));
    }
  }
  const v1::Dtype dtype = spec.run().dtype();
  auto peak_or = cluster.PeakFlops(dtype);
  if (!peak_or.ok()) return peak_or.status();
  // Each module's achieved rate and overhead per layer (its own, where the cluster has them).
  const ComputeConstants enc_constants = cluster.EncoderCompute();
  const ComputeConstants llm_constants = cluster.LlmCompute();
  const double enc_rate = *peak_or * enc_constants.compute_efficiency;
  const double llm_rate = *peak_or * llm_constants.compute_efficiency;
  const int64_t dtype_bytes = DtypeBytes(dtype);
  const Roofline enc_roofline{enc_rate, cluster.memory_gbps * 1e9,
                              static_cast<double>(dtype_bytes)};
  const Roofline llm_roofline{llm_rate, cluster.memory_gbps * 1e9,
                              static_cast<double>(dtype_bytes)};
  const v1::EncoderModel& em = spec.encoder().model();
  const v1::LlmModel& lm = spec.llm().model();
  const bool enc_sp = el.sequence_parallel && el.tp > 1;
  const bool llm_sp = ll.sequence_parallel && ll.tp > 1;
  const int64_t max_inflight = std::max<int64_t>(1, spec.run().max_inflight());
  const int64_t waves = plan.llm.waves;
  // A frozen encoder (encoder.frozen) has no backward, no gradients back over the boundary, no
  // DP all-reduce and no optimizer; with train_projector the projector keeps all of them.
  const EncoderTraining training = EncoderTrainingOf(spec.encoder());
  const bool image_gradients = training != EncoderTraining::kNone;

  // Links: a group stays in a node while its span of consecutive ranks fits one.
  const LinkSpec& enc_tp_link = LinkFor(cluster, el.tp);
  const LinkSpec& enc_dp_link = LinkFor(cluster, el.size());
  const LinkSpec& llm_tp_link = LinkFor(cluster, ll.tp);
  const LinkSpec& llm_cp_link = LinkFor(cluster, ll.tp * ll.cp);
  const LinkSpec& llm_dp_link = LinkFor(cluster, ll.tp * ll.cp * ll.dp);
  const LinkSpec& llm_pp_link = LinkFor(cluster, ll.size());
  const LinkSpec& boundary_link = LinkFor(cluster, pl.world_size);

  // Where ranks outnumber the devices, TP groups wait on ranks the scheduler has parked.
  // Colocated, every rank computes at once: the shared latency. Non-colocated, a module's TP
  // collectives pay the loaded latency while the other module computes (its share of the step).
  const bool oversubscribed = cluster.share_devices && cluster.devices() > 0 &&
                              static_cast<double>(pl.world_size) > cluster.Concurrency();
  LinkSpec enc_tp_shared = enc_tp_link, llm_tp_shared = llm_tp_link;
  if (oversubscribed && colocated && cluster.shared_collective_latency_s > 0) {
    enc_tp_shared.collective_latency_s = cluster.shared_collective_latency_s;
    llm_tp_shared.collective_latency_s = cluster.shared_collective_latency_s;
  } else if (oversubscribed && !colocated && cluster.loaded_collective_latency_s > 0) {
    auto blend = [&](LinkSpec* link, double share) {
      link->collective_latency_s +=
          std::clamp(share, 0.0, 1.0) *
          std::max(0.0, cluster.loaded_collective_latency_s - link->collective_latency_s);
    };
    blend(&enc_tp_shared, load.on_encoder);
    blend(&llm_tp_shared, load.on_llm);
  }

  // --- LLM waves: per replica and wave, the time of its forward + backward on a stage.
  const FlopCount image_flops = EncoderImageFlops(em, training);
  const FlopCount trained_image_flops = EncoderImageFlops(em);
  // The share of a fully trained encoder's backward that this one runs.
  const double backward_share =
      trained_image_flops.backward > 0 ? image_flops.backward / trained_image_flops.backward : 0.0;
  std::vector<std::vector<double>> llm_wave(ll.dp, std::vector<double>(waves, 0));
  std::vector<double> llm_compute(ll.dp, 0), llm_tp(ll.dp, 0), llm_cp(ll.dp, 0), llm_pp(ll.dp, 0);
  const int64_t stage_layers = (lm.layers() + ll.pp - 1) / ll.pp;
  const double h = lm.hidden();
  const double heads = lm.heads() > 0 ? lm.heads() : 1;
  const double kv_dim = h * (lm.kv_heads() > 0 ? lm.kv_heads() : heads) / heads;
  for (int64_t d = 0; d < ll.dp; ++d) {
    for (int64_t m = 0; m < waves; ++m) {
      const LlmMicrobatch& mb = plan.llm.At(d, m);
      if (mb.samples.empty()) continue;  // a replica taking one wave fewer: no time
      double flops = 0;
      std::vector<double> lengths;
      // The model's attention calls per layer: one per run of consecutive samples of one length,
      // one per sample under CP.
      int64_t calls = 0;
      for (int64_t s : mb.samples) {
        const SampleDescriptor& sample = plan.samples[s];
        flops += LlmSampleFlops(lm, sample.sequence_length(), sample.loss_tokens).total();
        const double length = static_cast<double>(sample.sequence_length());
        if (ll.cp > 1 || lengths.empty() || lengths.back() != length) ++calls;
        lengths.push_back(length);
      }
      out.llm_module.flops += flops;
      const PassSeconds gemms =
          LlmMicrobatchSeconds(lm, lengths, static_cast<double>(mb.loss_tokens), stage_layers,
                               ll.tp, ll.cp, llm_roofline);
      const double compute =
          gemms.forward + gemms.backward +
          UndividedSeconds(cluster.tp_parallel_fraction, ll.tp,
                           flops / static_cast<double>(ll.cp * ll.pp), llm_rate) +
          static_cast<double>(stage_layers) *
              (llm_constants.layer_overhead_s +
               static_cast<double>(std::max<int64_t>(0, calls - 1)) *
                   llm_constants.attention_call_overhead_s);
      const int64_t local_tokens = (mb.tokens + ll.cp - 1) / ll.cp;
      const double tp = TpSeconds(llm_tp_shared, ll.tp, llm_sp,
                                  LlmTpCollectives(lm, stage_layers, local_tokens, mb.image_rows,
                                                   mb.loss_tokens, dtype_bytes));
      double cp = 0;
      if (ll.cp > 1) {
        const double kv_bytes = static_cast<double>(mb.tokens) * 2.0 * kv_dim / ll.tp *
                                static_cast<double>(dtype_bytes);
        cp = 2.0 * static_cast<double>(stage_layers) * GatherSeconds(llm_cp_link, ll.cp, kv_bytes);
      }
      double pp = 0;
      if (ll.pp > 1) {
        const double bytes = static_cast<double>(local_tokens) * h / (llm_sp ? ll.tp : 1) *
                             static_cast<double>(dtype_bytes);
        pp = 2.0 * P2pSeconds(llm_pp_link, 1, bytes);
      }
      llm_wave[d][m] = compute + tp + cp + pp;
      llm_compute[d] += compute;
      llm_tp[d] += tp;
      llm_cp[d] += cp;
      llm_pp[d] += pp;
    }
  }

  // --- Encoder jobs: forward and backward time of each.
  struct JobTime {
    int64_t wave = 0;
    double forward = 0;
    double backward = 0;
  };
  std::vector<std::vector<JobTime>> jobs(el.dp);
  std::vector<double> enc_compute(el.dp, 0), enc_tp(el.dp, 0);
  for (const EncoderJob& job : plan.encoder.jobs) {
    const double n = static_cast<double>(job.images.size());
    out.encoder_module.flops += n * image_flops.total();
    const double overhead = static_cast<double>(em.layers()) * enc_constants.layer_overhead_s;
    const PassSeconds gemms = EncoderJobSeconds(em, n, el.tp, enc_roofline);
    const double undivided = UndividedSeconds(cluster.tp_parallel_fraction, el.tp,
                                              n * trained_image_flops.total(), enc_rate);
    const double fwd = gemms.forward + undivided / 3 + overhead / 3;
    const double bwd = (gemms.backward + undivided * 2 / 3 + overhead * 2 / 3) * backward_share;
    // The TP collectives of a trained job, split forward/backward as its FLOPs are; a frozen
    // encoder runs the backward share it has.
    const double tp =
        TpSeconds(enc_tp_shared, el.tp, enc_sp,
                  EncoderTpCollectives(em, static_cast<int64_t>(job.images.size()), dtype_bytes));
    const double fwd_share = trained_image_flops.total() > 0
                                 ? trained_image_flops.forward / trained_image_flops.total()
                                 : 0.5;
    const double tp_fwd = tp * fwd_share;
    const double tp_bwd = tp * (1 - fwd_share) * backward_share;
    jobs[job.replica].push_back({job.wave, fwd + tp_fwd, bwd + tp_bwd});
    enc_compute[job.replica] += fwd + bwd;
    enc_tp[job.replica] += tp_fwd + tp_bwd;
  }

  // --- Boundary: per LLM replica and wave, the slowest of its ranks' receives; the sources.
  std::vector<std::vector<double>> transfer(ll.dp, std::vector<double>(waves, 0));
  std::vector<std::vector<std::vector<int64_t>>> sources(ll.dp,
                                                         std::vector<std::vector<int64_t>>(waves));
  {
    std::map<std::pair<int64_t, int64_t>, std::pair<int64_t, double>> per_rank;  // (rank, wave)
    for (const Transfer& t : plan.boundary.forward) {
      auto& [messages, bytes] = per_rank[{t.dst_rank, t.wave}];
      ++messages;
      bytes += static_cast<double>(t.rows * plan.options.row_bytes);
      const int64_t d = ll.CoordsOf(t.dst_rank).dp;
      const int64_t e = el.CoordsOf(t.src_rank).dp;
      auto& src = sources[d][t.wave];
      if (std::find(src.begin(), src.end(), e) == src.end()) src.push_back(e);
    }
    std::vector<double> per_rank_total(pl.world_size, 0);
    for (const auto& [key, value] : per_rank) {
      const int64_t d = ll.CoordsOf(key.first).dp;
      const double seconds = P2pSeconds(boundary_link, value.first, value.second);
      transfer[d][key.second] = std::max(transfer[d][key.second], seconds);
      per_rank_total[key.first] += (image_gradients ? 2.0 : 1.0) * seconds;
    }
    out.boundary_s = *std::max_element(per_rank_total.begin(), per_rank_total.end());
  }

  // --- DP all-reduces and the optimizer, per rank.
  const double enc_params = EncoderParameters(em);
  const double llm_params = LlmParameters(lm);
  out.encoder_module.parameters = enc_params;
  out.llm_module.parameters = llm_params;
  const double enc_rank_params = enc_params / el.tp;
  const double o = static_cast<double>(em.out_hidden());
  const double projector_params = EncoderProjectorParameters(em);
  const double enc_trained_params = training == EncoderTraining::kAll             ? enc_params
                                    : training == EncoderTraining::kProjectorOnly ? projector_params
                                                                                  : 0.0;
  const double enc_rank_trained = enc_trained_params / el.tp;
  const double llm_rank_params = llm_params / (ll.tp * ll.pp);
  out.encoder_module.dp_collective_s =
      enc_rank_trained > 0 ? AllReduceSeconds(enc_dp_link, el.dp, enc_rank_trained * dtype_bytes)
                           : 0.0;
  out.llm_module.dp_collective_s =
      AllReduceSeconds(llm_dp_link, ll.dp, llm_rank_params * dtype_bytes);
  out.encoder_module.optimizer_s = OptimizerSeconds(cluster, enc_rank_trained, dtype);
  out.llm_module.optimizer_s = OptimizerSeconds(cluster, llm_rank_params, dtype);

  // --- The schedule.
  std::vector<double> llm_end(ll.dp, 0), enc_end(el.dp, 0);
  double bubble = 0;
  {
    double stage_sum = 0;
    int64_t microbatches = 0;
    for (const LlmMicrobatch& mb : plan.llm.microbatches) {
      if (mb.samples.empty()) continue;
      stage_sum += llm_wave[mb.replica][mb.wave];
      ++microbatches;
    }
    const double mean_stage = microbatches > 0 ? stage_sum / static_cast<double>(microbatches) : 0;
    bubble = static_cast<double>(ll.pp - 1) * mean_stage;
  }
  double schedule_end = 0;
  if (!colocated) {
    std::vector<std::vector<double>> forward_end(el.dp, std::vector<double>(waves, 0));
    std::vector<std::vector<double>> grads_back(el.dp, std::vector<double>(waves, 0));
    std::vector<std::vector<double>> wave_end(ll.dp, std::vector<double>(waves, 0));
    for (int64_t round = 0; round < 2 * waves + 2; ++round) {
      for (int64_t e = 0; e < el.dp; ++e) {
        double t = 0;
        std::deque<const JobTime*> live;
        auto backward_oldest = [&] {
          const JobTime* o = live.front();
          live.pop_front();
          if (image_gradients) t = std::max(t, grads_back[e][o->wave]);
          t += o->backward;
        };
        for (const JobTime& job : jobs[e]) {
          t += job.forward;
          forward_end[e][job.wave] = t;
          live.push_back(&job);
          if (static_cast<int64_t>(live.size()) >= max_inflight) backward_oldest();
        }
        while (!live.empty()) backward_oldest();
        enc_end[e] = t;
      }
      std::vector<std::vector<double>> next(el.dp, std::vector<double>(waves, 0));
      for (int64_t d = 0; d < ll.dp; ++d) {
        double t = 0;
        for (int64_t m = 0; m < waves; ++m) {
          double ready = 0;
          for (int64_t e : sources[d][m]) ready = std::max(ready, forward_end[e][m]);
          if (!sources[d][m].empty()) ready += transfer[d][m];
          t = std::max(t, ready) + llm_wave[d][m];
          wave_end[d][m] = t;
          for (int64_t e : sources[d][m]) {
            next[e][m] = std::max(next[e][m], t + transfer[d][m]);
          }
        }
        llm_end[d] = t + bubble;
      }
      if (next == grads_back) break;
      grads_back = std::move(next);
    }
    for (int64_t e = 0; e < el.dp; ++e) {
      schedule_end = std::max(schedule_end, enc_end[e] + out.encoder_module.dp_collective_s);
    }
    for (int64_t d = 0; d < ll.dp; ++d) {
      schedule_end = std::max(schedule_end, llm_end[d] + out.llm_module.dp_collective_s);
    }
  } else {
    double forward = 0, backward = 0, llm = 0, xfer = 0;
    for (int64_t e = 0; e < el.dp; ++e) {
      double f = 0, b = 0;
      for (const JobTime& job : jobs[e]) {
        f += job.forward;
        b += job.backward;
      }
      forward = std::max(forward, f);
      backward = std::max(backward, b);
    }
    for (int64_t d = 0; d < ll.dp; ++d) {
      double t = 0, x = 0;
      for (int64_t m = 0; m < waves; ++m) {
        t += llm_wave[d][m];
        x += transfer[d][m];
      }
      llm = std::max(llm, t + bubble);
      xfer = std::max(xfer, x);
    }
    schedule_end = forward + xfer + llm + (image_gradients ? xfer : 0.0) + backward +
                   out.encoder_module.dp_collective_s + out.llm_module.dp_collective_s;
  }
  out.overhead_s = cluster.step_overhead_s;
  const double optimizer =
      colocated ? out.encoder_module.optimizer_s + out.llm_module.optimizer_s
                : std::max(out.encoder_module.optimizer_s, out.llm_module.optimizer_s);
  out.step_time_s = schedule_end + out.overhead_s + optimizer;

  // --- Per-module summaries: the busiest replica.
  auto summarize = [](ModuleEstimate* m, const std::vector<double>& compute,
                      const std::vector<double>& tp, int64_t ranks) {
    m->ranks = ranks;
    const size_t busiest = std::max_element(compute.begin(), compute.end()) - compute.begin();
    double mean = 0;
    for (double c : compute) mean += c;
    mean /= static_cast<double>(std::max<size_t>(1, compute.size()));
    m->compute_s = compute.empty() ? 0 : compute[busiest];
    m->tp_collective_s = tp.empty() ? 0 : tp[busiest];
    m->imbalance_s = m->compute_s - mean;
    return busiest;
  };
  summarize(&out.encoder_module, enc_compute, enc_tp, el.size());
  const size_t d_busy = summarize(&out.llm_module, llm_compute, llm_tp, ll.size());
  out.llm_module.cp_collective_s = llm_cp.empty() ? 0 : llm_cp[d_busy];
  out.llm_module.pp_p2p_s = llm_pp.empty() ? 0 : llm_pp[d_busy];
  out.llm_module.bubble_s = bubble;
  for (ModuleEstimate* m : {&out.encoder_module, &out.llm_module}) {
    m->busy_s = m->compute_s + m->tp_collective_s + m->cp_collective_s + m->pp_p2p_s +
                m->dp_collective_s + m->optimizer_s;
  }
  // Ranks sharing devices: every rank's compute (each rank of a replica computes its share) runs
  // under processor sharing, each of k computing ranks getting min(1, concurrency / k) of a
  // device; the step lasts at least until the last rank's compute is done.
  if (oversubscribed) {
    std::vector<double> work;
    for (int64_t e = 0; e < el.dp; ++e) {
      for (int64_t r = 0; r < el.replica_size(); ++r) {
        work.push_back(enc_compute[e] + out.encoder_module.optimizer_s);
      }
    }
    for (int64_t d = 0; d < ll.dp; ++d) {
      for (int64_t r = 0; r < ll.replica_size(); ++r) {
        work.push_back(llm_compute[d] + out.llm_module.optimizer_s);
      }
    }
    if (colocated) {  // a colocated rank is one process running both modules' work in turn
      std::vector<double> per_rank(pl.world_size, 0);
      for (size_t i = 0; i < work.size(); ++i) per_rank[i % pl.world_size] += work[i];
      work = std::move(per_rank);
    }
    std::sort(work.begin(), work.end());
    double t = 0, done = 0;
    for (size_t i = 0; i < work.size(); ++i) {
      const double active = static_cast<double>(work.size() - i);
      const double speed = std::min(1.0, cluster.Concurrency() / active);
      t += (work[i] - done) / speed;
      done = work[i];
    }
    out.shared_bound_s = t + out.overhead_s;
    out.step_time_s = std::max(out.step_time_s, out.shared_bound_s);
  }
  out.encoder_module.rank_compute_s = 0;
  for (double c : enc_compute) out.encoder_module.rank_compute_s += c * el.replica_size();
  out.llm_module.rank_compute_s = 0;
  for (double c : llm_compute) out.llm_module.rank_compute_s += c * ll.replica_size();

  // --- Memory per rank.
  const double state_per_param = StateBytesPerParameter(dtype_bytes, dtype);
  out.encoder_module.state_gib =
      (enc_rank_trained * state_per_param +
       (enc_rank_params - enc_rank_trained) * static_cast<double>(dtype_bytes)) /
      kGiB;
  const double stage_params =
      (static_cast<double>(stage_layers) * (LlmParameters(lm) - 2.0 * lm.vocab() * h - h) /
           std::max<int64_t>(1, lm.layers()) +
       lm.vocab() * h * (ll.pp > 1 ? 1.0 : 2.0) + h) /
      ll.tp;
  out.llm_module.state_gib = stage_params * state_per_param / kGiB;
  const int64_t per_side = em.patch() > 0 ? em.image_size() / em.patch() : 0;
  const double patches = static_cast<double>(per_side * per_side);
  int64_t max_job_images = 0;
  std::vector<int64_t> jobs_per_replica(el.dp, 0);
  for (const EncoderJob& job : plan.encoder.jobs) {
    max_job_images = std::max<int64_t>(max_job_images, job.images.size());
    ++jobs_per_replica[job.replica];
  }
  // A frozen tower keeps no activations; a job then holds its output rows (and, with a trainable
  // projector, the projector's input and inner activations).
  const double job_rows = patches * static_cast<double>(max_job_images);
  const double job_activation =
      training == EncoderTraining::kAll
          ? static_cast<double>(em.layers()) *
                LayerActivationBytes(patches, static_cast<double>(max_job_images), em.hidden(),
                                     el.tp, enc_sp, dtype_bytes)
      : training == EncoderTraining::kProjectorOnly
          ? job_rows * (static_cast<double>(em.hidden()) + 2.0 * o) * dtype_bytes
          : job_rows * o * dtype_bytes;
  const int64_t live_jobs =
      colocated ? *std::max_element(jobs_per_replica.begin(), jobs_per_replica.end())
                : std::min<int64_t>(max_inflight, waves);
  out.encoder_module.activation_gib = job_activation * static_cast<double>(live_jobs) / kGiB;
  const double seq = static_cast<double>(plan.options.seq_len) / ll.cp;
  const double mb = static_cast<double>(plan.llm.micro_batch);
  const double llm_layer = LayerActivationBytes(seq, mb, h, ll.tp, llm_sp, dtype_bytes);
  const double in_flight = static_cast<double>(std::min<int64_t>(ll.pp, waves));
  const double logits = 2.0 * seq * mb * lm.vocab() / ll.tp * 4.0;
  out.llm_module.activation_gib =
      (static_cast<double>(stage_layers) * llm_layer * in_flight + logits) / kGiB;
  const double enc_mem = out.encoder_module.state_gib + out.encoder_module.activation_gib;
  const double llm_mem = out.llm_module.state_gib + out.llm_module.activation_gib;
  out.memory_gib_per_device =
      (colocated ? enc_mem + llm_mem : std::max(enc_mem, llm_mem)) + cluster.reserved_gib;
  out.fits_memory = out.memory_gib_per_device <= cluster.memory_gib;
  if (!out.fits_memory) {
    out.notes.push_back(absl::StrCat("needs ", out.memory_gib_per_device, " GiB per device; ",
                                     cluster.name, " has ", cluster.memory_gib));
  }

  for (const SampleDescriptor& s : plan.samples) {
    out.tokens += static_cast<double>(s.sequence_length());
    out.images += static_cast<double>(s.image_count());
  }
  const double devices = static_cast<double>(out.devices);
  if (out.step_time_s > 0) {
    out.tflops_per_device =
        (out.encoder_module.flops + out.llm_module.flops) / out.step_time_s / devices / 1e12;
    out.tokens_per_s_per_device = out.tokens / out.step_time_s / devices;
  }
  return out;
}

}  // namespace

absl::StatusOr<StepEstimate> EstimateStep(const v1::RunSpec& spec, const StepPlan& plan,
                                          const ClusterSpec& cluster) {
  OtherLoad load;
  auto estimate = EstimateWith(spec, plan, cluster, load);
  const bool loaded = cluster.share_devices && cluster.devices() > 0 &&
                      cluster.loaded_collective_latency_s > 0 &&
                      plan.placement.kind == PlacementKind::kNonColocated &&
                      static_cast<double>(plan.placement.world_size) > cluster.Concurrency();
  // The loads depend on the step time they change: a few rounds settle them.
  for (int round = 0; loaded && estimate.ok() && round < 4; ++round) {
    const double step = estimate->step_time_s;
    if (!(step > 0)) break;
    load.on_llm = estimate->encoder_module.rank_compute_s / step;
    load.on_encoder = estimate->llm_module.rank_compute_s / step;
    estimate = EstimateWith(spec, plan, cluster, load);
  }
  return estimate;
}

}  // namespace hetpar::plan
