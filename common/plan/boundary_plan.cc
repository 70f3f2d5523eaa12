#include "common/plan/boundary_plan.h"

#include <algorithm>
#include <numeric>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/plan/sequence_sharding.h"

namespace hetpar::plan {
namespace {

// One piece with its route, before pieces are grouped into transfers.
struct RoutedPiece {
  int64_t src_rank;
  int64_t wave;
  int64_t dst_rank;
  int64_t sequence;  // creation order: keeps payload order = receiver buffer order
  BlockPiece piece;
};

void AppendSegment(std::vector<ShareSegment>* segments, int64_t holder, int64_t offset,
                   int64_t rows) {
  if (!segments->empty()) {
    ShareSegment& last = segments->back();
    if (last.holder_rank == holder && last.offset + last.rows == offset) {
      last.rows += rows;
      return;
    }
  }
  segments->push_back({holder, offset, rows});
}

// Appends `piece` to the transfer, merging it into the previous piece when it continues it.
void AppendPiece(Transfer* transfer, const BlockPiece& piece) {
  transfer->rows += piece.rows;
  if (!transfer->pieces.empty()) {
    BlockPiece& last = transfer->pieces.back();
    if (last.sample == piece.sample && last.image == piece.image &&
        last.row_begin + last.rows == piece.row_begin &&
        last.src_offset + last.rows == piece.src_offset &&
        last.dst_offset + last.rows == piece.dst_offset) {
      last.rows += piece.rows;
      return;
    }
  }
  transfer->pieces.push_back(piece);
}

// Index order over transfers by (dst_rank, wave, src_rank).
std::vector<int64_t> ByDestination(const std::vector<Transfer>& transfers) {
  std::vector<int64_t> order(transfers.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const Transfer& x = transfers[a];
    const Transfer& y = transfers[b];
    return std::tie(x.dst_rank, x.wave, x.src_rank) < std::tie(y.dst_rank, y.wave, y.src_rank);
  });
  return order;
}

std::vector<const Transfer*> FromRank(const std::vector<Transfer>& transfers, int64_t rank) {
  auto begin = std::lower_bound(transfers.begin(), transfers.end(), rank,
                                [](const Transfer& t, int64_t r) { return t.src_rank < r; });
  std::vector<const Transfer*> out;
  for (auto it = begin; it != transfers.end() && it->src_rank == rank; ++it) out.push_back(&*it);
  return out;
}

std::vector<const Transfer*> ToRank(const std::vector<Transfer>& transfers,
                                    const std::vector<int64_t>& by_dst, int64_t rank) {
  auto begin = std::lower_bound(by_dst.begin(), by_dst.end(), rank, [&](int64_t index, int64_t r) {
    return transfers[index].dst_rank < r;
  });
  std::vector<const Transfer*> out;
  for (auto it = begin; it != by_dst.end() && transfers[*it].dst_rank == rank; ++it) {
    out.push_back(&transfers[*it]);
  }
  return out;
}

}  // namespace

bool operator==(const BlockPiece& a, const BlockPiece& b) {
  return a.sample == b.sample && a.image == b.image && a.row_begin == b.row_begin &&
         a.rows == b.rows && a.src_offset == b.src_offset && a.dst_offset == b.dst_offset;
}

bool operator==(const Transfer& a, const Transfer& b) {
  return a.wave == b.wave && a.src_rank == b.src_rank && a.dst_rank == b.dst_rank &&
         a.rows == b.rows && a.pieces == b.pieces;
}

bool operator==(const ShareSegment& a, const ShareSegment& b) {
  return a.holder_rank == b.holder_rank && a.offset == b.offset && a.rows == b.rows;
}

bool operator==(const ShareStep& a, const ShareStep& b) {
  return a.module == b.module && a.wave == b.wave && a.replica == b.replica &&
         a.cp_rank == b.cp_rank && a.ranks == b.ranks && a.buffer_rows == b.buffer_rows &&
         a.segments == b.segments;
}

Transfer Transpose(const Transfer& transfer) {
  Transfer out;
  out.wave = transfer.wave;
  out.src_rank = transfer.dst_rank;
  out.dst_rank = transfer.src_rank;
  out.rows = transfer.rows;
  out.pieces = transfer.pieces;
  for (BlockPiece& piece : out.pieces) std::swap(piece.src_offset, piece.dst_offset);
  return out;
}

int64_t BoundaryPlan::LlmBufferRows(int64_t rank, int64_t wave) const {
  const int64_t local = rank - llm_rank_offset;
  if (local < 0 || local >= llm_first_stage_ranks || wave < 0 || wave >= waves) return 0;
  return llm_buffer_rows[wave * llm_first_stage_ranks + local];
}

std::vector<const Transfer*> ForwardFrom(const BoundaryPlan& plan, int64_t rank) {
  return FromRank(plan.forward, rank);
}

std::vector<const Transfer*> ForwardTo(const BoundaryPlan& plan, int64_t rank) {
  return ToRank(plan.forward, plan.forward_by_dst, rank);
}

std::vector<const Transfer*> BackwardFrom(const BoundaryPlan& plan, int64_t rank) {
  return FromRank(plan.backward, rank);
}

std::vector<const Transfer*> BackwardTo(const BoundaryPlan& plan, int64_t rank) {
  return ToRank(plan.backward, plan.backward_by_dst, rank);
}

std::vector<const ShareStep*> LlmSharesOf(const BoundaryPlan& plan, const Layout& llm,
                                          int64_t rank) {
  std::vector<const ShareStep*> out;
  if (!llm.Contains(rank)) return out;
  const RankCoords c = llm.CoordsOf(rank);
  if (c.pp != 0) return out;
  auto key = std::make_pair(c.dp, c.cp);
  auto it = std::lower_bound(plan.llm_shares.begin(), plan.llm_shares.end(), key,
                             [](const ShareStep& s, const std::pair<int64_t, int64_t>& k) {
                               return std::make_pair(s.replica, s.cp_rank) < k;
                             });
  for (; it != plan.llm_shares.end() && it->replica == c.dp && it->cp_rank == c.cp; ++it) {
    out.push_back(&*it);
  }
  return out;
}

std::vector<const ShareStep*> EncoderSharesOf(const BoundaryPlan& plan, const Layout& encoder,
                                              int64_t rank) {
  std::vector<const ShareStep*> out;
  if (!encoder.Contains(rank)) return out;
  const int64_t replica = encoder.CoordsOf(rank).dp;
  auto it = std::lower_bound(plan.encoder_shares.begin(), plan.encoder_shares.end(), replica,
                             [](const ShareStep& s, int64_t r) { return s.replica < r; });
  for (; it != plan.encoder_shares.end() && it->replica == replica; ++it) out.push_back(&*it);
  return out;
}

absl::StatusOr<BoundaryPlan> BuildBoundaryPlan(const Placement& placement,
                                               const std::vector<SampleDescriptor>& samples,
                                               const LlmAssignment& llm,
                                               const EncoderAssignment& encoder,
                                               const BoundaryPlanOptions& options) {
  if (absl::Status s = ValidatePlacement(placement); !s.ok()) return s;
  const Layout& el = placement.encoder;
  const Layout& ll = placement.llm;
  if (options.row_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("boundary plan: row_bytes=", options.row_bytes, "; expected >= 1"));
  }
  auto sharding_or = SequenceSharding::Create(options.seq_len, ll.cp, ll.tp, ll.sequence_parallel);
  if (!sharding_or.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("boundary plan: llm layout ", ll.ToString(),
                                                   ": ",
                                                   std::string(sharding_or.status().message())));
  }
  const SequenceSharding& sharding = *sharding_or;
  if (absl::Status s = ValidateBatch(samples, options.seq_len); !s.ok()) return s;
  const int64_t batch = static_cast<int64_t>(samples.size());
  if (llm.replicas != ll.dp || static_cast<int64_t>(llm.sample_wave.size()) != batch ||
      static_cast<int64_t>(llm.microbatches.size()) != llm.replicas * llm.waves) {
    return absl::InvalidArgumentError(absl::StrCat(
        "boundary plan: the LLM assignment is for ", llm.replicas, " replicas and ",
        llm.sample_wave.size(), " samples; expected llm dp ", ll.dp, " and ", batch, " samples"));
  }
  bool images_match =
      static_cast<int64_t>(encoder.image_base.size()) == batch + 1 && encoder.image_base[0] == 0;
  for (int64_t i = 0; images_match && i < batch; ++i) {
    images_match = encoder.image_base[i + 1] - encoder.image_base[i] == samples[i].image_count();
  }
  if (encoder.replicas != el.dp || encoder.waves != llm.waves || !images_match) {
    return absl::InvalidArgumentError(absl::StrCat(
        "boundary plan: the encoder assignment is for ", encoder.replicas, " replicas, ",
        encoder.waves, " waves and ", encoder.total_images(), " images; expected encoder dp ",
        el.dp, ", ", llm.waves, " waves and the batch's images, sample by sample"));
  }

  BoundaryPlan plan;
  plan.waves = llm.waves;
  plan.seq_len = options.seq_len;
  plan.row_bytes = options.row_bytes;
  plan.llm_rank_offset = ll.rank_offset;
  plan.llm_first_stage_ranks = ll.first_stage_size();
  const int64_t waves = llm.waves;
  const int64_t total_images = encoder.total_images();

  // Senders: wave by wave, largest block first, to the TP rank with the fewest bytes so far.
  plan.block_sender.assign(total_images, -1);
  {
    std::vector<std::vector<int64_t>> jobs_by_wave(waves);
    for (int64_t j = 0; j < static_cast<int64_t>(encoder.jobs.size()); ++j) {
      jobs_by_wave[encoder.jobs[j].wave].push_back(j);
    }
    std::vector<int64_t> sent_rows(el.dp * el.tp, 0);
    std::vector<int64_t> order;
    for (int64_t m = 0; m < waves; ++m) {
      for (int64_t j : jobs_by_wave[m]) {
        const EncoderJob& job = encoder.jobs[j];
        const int64_t n = static_cast<int64_t>(job.images.size());
        order.resize(n);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
          return samples[job.images[a].sample].tokens_per_image >
                 samples[job.images[b].sample].tokens_per_image;
        });
        int64_t* loads = &sent_rows[job.replica * el.tp];
        for (int64_t i : order) {
          const ImageRef& ref = job.images[i];
          const int64_t t = std::min_element(loads, loads + el.tp) - loads;
          loads[t] += samples[ref.sample].tokens_per_image;
          plan.block_sender[encoder.FlatImage(ref.sample, ref.image)] =
              el.RankOf(job.replica, t, 0, 0);
        }
      }
    }
  }

  // Landing. Buffer counters per first-stage rank (under SP) or per (replica, cp) group.
  const int64_t first_stage = ll.first_stage_size();
  const bool sp = ll.sequence_parallel;
  plan.llm_buffer_rows.assign(waves * first_stage, 0);
  std::vector<int64_t> landed_rows(first_stage, 0);  // per rank, over the step (lander choice)
  const bool llm_share = !sp && ll.tp > 1;
  std::vector<ShareStep> shares(llm_share ? ll.dp * ll.cp * waves : 0);
  std::vector<RoutedPiece> routed;
  routed.reserve(total_images * 2);
  std::vector<int64_t> counter(first_stage, 0);
  const auto& segments = sharding.segments();
  for (int64_t m = 0; m < waves; ++m) {
    std::fill(counter.begin(), counter.end(), 0);
    for (int64_t d = 0; d < ll.dp; ++d) {
      for (int64_t s : llm.At(d, m).samples) {
        const SampleDescriptor& sample = samples[s];
        const int64_t tokens = sample.tokens_per_image;
        for (int64_t k = 0; k < sample.image_count(); ++k) {
          const int64_t flat = encoder.FlatImage(s, k);
          const int64_t src = plan.block_sender[flat];
          const int64_t src_base = encoder.image_row_offset[flat];
          const int64_t start = sample.image_starts[k];
          int64_t row = 0;
          int64_t seg = sharding.SegmentOf(start);
          while (row < tokens) {
            const SequenceSharding::Segment& segment = segments[seg];
            const int64_t take = std::min(segment.end, start + tokens) - (start + row);
            // The group's buffer counter lives at its tp = 0 rank (or the owner under SP).
            const int64_t owner_tp = segment.tp_rank >= 0 ? segment.tp_rank : 0;
            const int64_t counter_local =
                ll.RankOf(d, owner_tp, segment.cp_rank, 0) - ll.rank_offset;
            int64_t dst;
            if (segment.tp_rank >= 0 || ll.tp == 1) {
              dst = ll.RankOf(d, owner_tp, segment.cp_rank, 0);
            } else {
              const int64_t first = counter_local;  // tp ranks of the group are consecutive
              int64_t best = first;
              for (int64_t t = 1; t < ll.tp; ++t) {
                if (landed_rows[first + t] < landed_rows[best]) best = first + t;
              }
              dst = best + ll.rank_offset;
            }
            landed_rows[dst - ll.rank_offset] += take;
            BlockPiece piece{s, k, row, take, src_base + row, counter[counter_local]};
            if (llm_share) {
              ShareStep& share = shares[(d * ll.cp + segment.cp_rank) * waves + m];
              AppendSegment(&share.segments, dst, piece.dst_offset, take);
            }
            counter[counter_local] += take;
            routed.push_back({src, m, dst, static_cast<int64_t>(routed.size()), piece});
            row += take;
            ++seg;
          }
        }
      }
    }
    // Buffer sizes: under SP each rank's own counter; otherwise the group's, for all its ranks.
    int64_t* rows = &plan.llm_buffer_rows[m * first_stage];
    for (int64_t local = 0; local < first_stage; ++local) {
      rows[local] = sp ? counter[local] : counter[local - local % ll.tp];
    }
  }

  // Group pieces into transfers sorted by (src, wave, dst), payload in creation order.
  std::sort(routed.begin(), routed.end(), [](const RoutedPiece& a, const RoutedPiece& b) {
    return std::tie(a.src_rank, a.wave, a.dst_rank, a.sequence) <
           std::tie(b.src_rank, b.wave, b.dst_rank, b.sequence);
  });
  for (const RoutedPiece& r : routed) {
    if (plan.forward.empty() || plan.forward.back().src_rank != r.src_rank ||
        plan.forward.back().wave != r.wave || plan.forward.back().dst_rank != r.dst_rank) {
      Transfer transfer;
      transfer.wave = r.wave;
      transfer.src_rank = r.src_rank;
      transfer.dst_rank = r.dst_rank;
      plan.forward.push_back(std::move(transfer));
    }
    AppendPiece(&plan.forward.back(), r.piece);
  }
  plan.forward_by_dst = ByDestination(plan.forward);
  plan.backward.reserve(plan.forward.size());
  for (int64_t index : plan.forward_by_dst) plan.backward.push_back(Transpose(plan.forward[index]));
  plan.backward_by_dst.assign(plan.forward.size(), 0);
  for (int64_t i = 0; i < static_cast<int64_t>(plan.forward_by_dst.size()); ++i) {
    // backward[i] is forward[forward_by_dst[i]]; backward in (dst, wave, src) order is forward's
    // (src, wave, dst) order.
    plan.backward_by_dst[plan.forward_by_dst[i]] = i;
  }

  // LLM share steps, in (replica, cp, wave) order.
  if (llm_share) {
    for (int64_t d = 0; d < ll.dp; ++d) {
      for (int64_t c = 0; c < ll.cp; ++c) {
        std::vector<int64_t> ranks = ll.TpGroup(ll.RankOf(d, 0, c, 0));
        for (int64_t m = 0; m < waves; ++m) {
          ShareStep& share = shares[(d * ll.cp + c) * waves + m];
          if (share.segments.empty()) continue;
          share.module = Module::kLlm;
          share.wave = m;
          share.replica = d;
          share.cp_rank = c;
          share.ranks = ranks;
          share.buffer_rows = plan.LlmBufferRows(ranks[0], m);
          plan.llm_shares.push_back(std::move(share));
        }
      }
    }
  }

  // Encoder share steps (gradients), in (replica, wave) order like the jobs.
  if (el.tp > 1) {
    for (const EncoderJob& job : encoder.jobs) {
      ShareStep share;
      share.module = Module::kEncoder;
      share.wave = job.wave;
      share.replica = job.replica;
      share.cp_rank = 0;
      share.ranks = el.TpGroup(el.RankOf(job.replica, 0, 0, 0));
      share.buffer_rows = job.rows;
      for (int64_t i = 0; i < static_cast<int64_t>(job.images.size()); ++i) {
        const ImageRef& ref = job.images[i];
        AppendSegment(&share.segments, plan.block_sender[encoder.FlatImage(ref.sample, ref.image)],
                      job.row_offsets[i], samples[ref.sample].tokens_per_image);
      }
      plan.encoder_shares.push_back(std::move(share));
    }
  }
  return plan;
}

}  // namespace hetpar::plan
