// Property tests of the boundary plan: random layouts and batches, each plan checked by
// simulating the data it moves, row by row, with an independent statement of who needs what.
#include "common/plan/boundary_plan.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/plan/step_plan.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::plan {
namespace {

using ::testing::HasSubstr;

// The identity of one embedding row: row `row` of image `image` of batch sample `sample`.
struct Tag {
  int64_t sample = -1;
  int64_t image = -1;
  int64_t row = -1;
  bool empty() const { return sample < 0; }
};

bool operator==(const Tag& a, const Tag& b) {
  return a.sample == b.sample && a.image == b.image && a.row == b.row;
}

std::ostream& operator<<(std::ostream& os, const Tag& t) {
  return os << "(sample " << t.sample << " image " << t.image << " row " << t.row << ")";
}

const CostModel kEncoderCost{4.0, 1.0};
const CostModel kLlmCost{10.0, 0.5};

struct Case {
  Placement placement;
  StepPlanOptions options;
  std::vector<SampleDescriptor> samples;

  std::string Describe() const {
    return absl::StrCat(std::string(PlacementKindName(placement.kind)), " encoder ",
                        placement.encoder.ToString(), " llm ", placement.llm.ToString(), " waves ",
                        options.waves, " micro_batch ", options.micro_batch, " seq_len ",
                        options.seq_len, " step ", options.step);
  }
};

Layout Grid(int64_t dp, int64_t tp, int64_t cp = 1, int64_t pp = 1, bool sp = false) {
  Layout l;
  l.dp = dp;
  l.tp = tp;
  l.cp = cp;
  l.pp = pp;
  l.sequence_parallel = sp;
  return l;
}

// A sample with images at random places between random text segments.
SampleDescriptor RandomSample(std::mt19937_64& rng, int64_t id, int64_t images, int64_t tokens,
                              int64_t text) {
  SampleDescriptor s;
  s.id = id;
  s.text_tokens = text;
  s.loss_tokens = text > 0 ? static_cast<int64_t>(rng() % (text + 1)) : 0;
  s.tokens_per_image = tokens;
  std::vector<int64_t> cuts;
  for (int64_t k = 0; k < images; ++k) cuts.push_back(static_cast<int64_t>(rng() % (text + 1)));
  std::sort(cuts.begin(), cuts.end());
  for (int64_t k = 0; k < images; ++k) s.image_starts.push_back(cuts[k] + k * tokens);
  return s;
}

int64_t RoundUp(int64_t value, int64_t unit) { return (value + unit - 1) / unit * unit; }

Case RandomCase(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  Case c;
  const int64_t tp = pick(1, 4);
  Layout llm = Grid(pick(1, 6), tp, pick(1, 3), pick(1, 3), tp > 1 && pick(0, 1) == 1);
  Layout enc;
  PlacementKind kind = PlacementKind::kNonColocated;
  if (pick(0, 3) == 0) {
    kind = PlacementKind::kColocated;
    std::vector<int64_t> divisors;
    for (int64_t t = 1; t <= 4; ++t) {
      if (llm.size() % t == 0) divisors.push_back(t);
    }
    const int64_t enc_tp = divisors[rng() % divisors.size()];
    enc = Grid(llm.size() / enc_tp, enc_tp);
  } else {
    enc = Grid(pick(1, 8), pick(1, 4));
  }
  auto placement = MakePlacement(kind, enc, llm);
  EXPECT_TRUE(placement.ok()) << placement.status();
  c.placement = *placement;

  c.options.waves = pick(1, 4);
  c.options.micro_batch = pick(1, 3);
  c.options.step = pick(0, 1000);
  c.options.generation = pick(0, 3);
  c.options.seed = rng();
  c.options.row_bytes = 4 * pick(1, 16);
  c.options.encoder_cost = kEncoderCost;
  c.options.llm_cost = kLlmCost;
  // Some batches leave replicas a wave short, as over the replicas left after a loss.
  const int64_t short_replicas =
      c.options.waves > 1 && llm.dp > 1 && pick(0, 3) == 0 ? pick(1, llm.dp - 1) : 0;
  const int64_t batch = (c.options.waves * llm.dp - short_replicas) * c.options.micro_batch;
  const int64_t base_tokens = pick(1, 9);
  const int64_t max_images = pick(0, 6);
  const bool text_only = pick(0, 19) == 0;
  int64_t longest = 1;
  for (int64_t i = 0; i < batch; ++i) {
    int64_t images = text_only ? 0 : pick(0, max_images);
    if (!text_only && pick(0, 9) == 0) images = pick(8, 14);  // a sample with many images
    const int64_t tokens = pick(0, 2) == 0 ? pick(1, 9) : base_tokens;
    c.samples.push_back(RandomSample(rng, 1000 + 7 * i, images, tokens, pick(0, 24)));
    longest = std::max(longest, c.samples.back().sequence_length());
  }
  const int64_t unit = 2 * llm.cp * llm.tp;
  c.options.seq_len = RoundUp(longest, unit) + unit * pick(0, 1);
  return c;
}

// Owner of position `pos` by the rule in sequence_sharding.h, written out independently:
// (cp rank, tp rank or -1 when every TP rank holds it).
std::pair<int64_t, int64_t> Owner(const Layout& llm, int64_t seq_len, int64_t pos) {
  int64_t cp_rank = 0;
  int64_t local = pos;
  if (llm.cp > 1) {
    const int64_t chunk_len = seq_len / (2 * llm.cp);
    const int64_t chunk = pos / chunk_len;
    cp_rank = chunk < llm.cp ? chunk : 2 * llm.cp - 1 - chunk;
    local = (chunk < llm.cp ? 0 : chunk_len) + pos % chunk_len;
  }
  if (!llm.sequence_parallel) return {cp_rank, -1};
  return {cp_rank, local / (seq_len / llm.cp / llm.tp)};
}

// Checks every invariant of the plan by moving tags through it.
void CheckPlan(const StepPlan& plan) {
  const Layout& el = plan.placement.encoder;
  const Layout& ll = plan.placement.llm;
  const auto& samples = plan.samples;
  const BoundaryPlan& bp = plan.boundary;
  const int64_t waves = plan.llm.waves;
  const int64_t first_stage = ll.first_stage_size();
  const int64_t seq_len = plan.options.seq_len;

  // Job buffers: identical on every TP rank of the replica.
  std::map<std::pair<int64_t, int64_t>, std::vector<Tag>> job_buffer;
  for (const EncoderJob& job : plan.encoder.jobs) {
    std::vector<Tag>& buffer = job_buffer[{job.replica, job.wave}];
    for (const ImageRef& ref : job.images) {
      for (int64_t r = 0; r < samples[ref.sample].tokens_per_image; ++r) {
        buffer.push_back({ref.sample, ref.image, r});
      }
    }
    ASSERT_EQ(static_cast<int64_t>(buffer.size()), job.rows);
  }

  // What each first-stage LLM rank needs in each wave, in buffer order.
  std::vector<std::vector<Tag>> expected(first_stage * waves);
  auto slot = [&](int64_t rank, int64_t wave) {
    return wave * first_stage + (rank - ll.rank_offset);
  };
  for (int64_t d = 0; d < ll.dp; ++d) {
    for (int64_t m = 0; m < waves; ++m) {
      for (int64_t s : plan.llm.At(d, m).samples) {
        const SampleDescriptor& sample = samples[s];
        for (int64_t k = 0; k < sample.image_count(); ++k) {
          for (int64_t r = 0; r < sample.tokens_per_image; ++r) {
            const auto [c, t] = Owner(ll, seq_len, sample.image_starts[k] + r);
            for (int64_t tt = 0; tt < ll.tp; ++tt) {
              if (t >= 0 && tt != t) continue;
              expected[slot(ll.RankOf(d, tt, c, 0), m)].push_back({s, k, r});
            }
          }
        }
      }
    }
  }
  for (int64_t r = ll.rank_offset; r < ll.end_rank(); ++r) {
    for (int64_t m = 0; m < waves; ++m) {
      const int64_t want =
          ll.CoordsOf(r).pp == 0 ? static_cast<int64_t>(expected[slot(r, m)].size()) : 0;
      ASSERT_EQ(bp.LlmBufferRows(r, m), want) << "rank " << r << " wave " << m;
    }
  }

  // Forward transfers: one message per (src, wave, dst); rows read where the sender has them,
  // written into empty slots of the receiver.
  std::vector<std::vector<Tag>> got(first_stage * waves);
  for (int64_t i = 0; i < first_stage * waves; ++i) got[i].resize(expected[i].size());
  for (size_t i = 0; i < bp.forward.size(); ++i) {
    const Transfer& t = bp.forward[i];
    if (i > 0) {
      const Transfer& p = bp.forward[i - 1];
      ASSERT_LT(std::tie(p.src_rank, p.wave, p.dst_rank), std::tie(t.src_rank, t.wave, t.dst_rank));
    }
    ASSERT_TRUE(el.Contains(t.src_rank));
    ASSERT_TRUE(ll.Contains(t.dst_rank));
    ASSERT_EQ(ll.CoordsOf(t.dst_rank).pp, 0);
    ASSERT_FALSE(t.pieces.empty());
    auto job = job_buffer.find({el.CoordsOf(t.src_rank).dp, t.wave});
    ASSERT_NE(job, job_buffer.end()) << "rank " << t.src_rank << " has no job in wave " << t.wave;
    std::vector<Tag>& dst = got[slot(t.dst_rank, t.wave)];
    int64_t rows = 0;
    for (const BlockPiece& p : t.pieces) {
      ASSERT_GE(p.rows, 1);
      rows += p.rows;
      ASSERT_EQ(bp.block_sender[plan.encoder.FlatImage(p.sample, p.image)], t.src_rank);
      for (int64_t r = 0; r < p.rows; ++r) {
        const Tag tag{p.sample, p.image, p.row_begin + r};
        ASSERT_LT(p.src_offset + r, static_cast<int64_t>(job->second.size()));
        ASSERT_EQ(job->second[p.src_offset + r], tag) << "source offset";
        ASSERT_LT(p.dst_offset + r, static_cast<int64_t>(dst.size()));
        ASSERT_TRUE(dst[p.dst_offset + r].empty()) << "row delivered twice: " << tag;
        dst[p.dst_offset + r] = tag;
      }
    }
    ASSERT_EQ(rows, t.rows);
  }

  // LLM share steps: holders have their segments from the transfers; copies fill the rest.
  const bool share = !ll.sequence_parallel && ll.tp > 1;
  if (!share) {
    ASSERT_TRUE(bp.llm_shares.empty());
  }
  int64_t expected_shares = 0;
  if (share) {
    for (int64_t i = 0; i < first_stage * waves; ++i) {
      const int64_t rank = i % first_stage + ll.rank_offset;
      if (ll.CoordsOf(rank).tp == 0 && !expected[i].empty()) ++expected_shares;
    }
  }
  ASSERT_EQ(static_cast<int64_t>(bp.llm_shares.size()), expected_shares);
  for (size_t i = 0; i < bp.llm_shares.size(); ++i) {
    const ShareStep& s = bp.llm_shares[i];
    if (i > 0) {
      const ShareStep& p = bp.llm_shares[i - 1];
      ASSERT_LT(std::tie(p.replica, p.cp_rank, p.wave), std::tie(s.replica, s.cp_rank, s.wave));
    }
    ASSERT_EQ(s.module, Module::kLlm);
    ASSERT_EQ(s.ranks, ll.TpGroup(ll.RankOf(s.replica, 0, s.cp_rank, 0)));
    ASSERT_EQ(s.buffer_rows, bp.LlmBufferRows(s.ranks[0], s.wave));
    int64_t next = 0;
    for (const ShareSegment& seg : s.segments) {
      ASSERT_EQ(seg.offset, next);
      ASSERT_GE(seg.rows, 1);
      next += seg.rows;
      const std::vector<Tag>& held = got[slot(seg.holder_rank, s.wave)];
      for (int64_t r = seg.offset; r < seg.offset + seg.rows; ++r) {
        ASSERT_FALSE(held[r].empty()) << "holder " << seg.holder_rank << " lacks row " << r;
      }
    }
    ASSERT_EQ(next, s.buffer_rows);
  }
  for (const ShareStep& s : bp.llm_shares) {
    for (const ShareSegment& seg : s.segments) {
      for (int64_t rank : s.ranks) {
        if (rank == seg.holder_rank) continue;
        std::vector<Tag>& to = got[slot(rank, s.wave)];
        const std::vector<Tag>& from = got[slot(seg.holder_rank, s.wave)];
        for (int64_t r = seg.offset; r < seg.offset + seg.rows; ++r) {
          ASSERT_TRUE(to[r].empty()) << "rank " << rank << " row " << r << " filled twice";
          to[r] = from[r];
        }
      }
    }
  }
  // Every needed row reached every rank that needs it, exactly once, in the right slot.
  for (int64_t i = 0; i < first_stage * waves; ++i) {
    ASSERT_EQ(got[i], expected[i])
        << "rank " << i % first_stage + ll.rank_offset << " wave " << i / first_stage;
  }

  // Backward is the transpose of forward.
  ASSERT_EQ(bp.backward.size(), bp.forward.size());
  {
    std::multiset<std::tuple<int64_t, int64_t, int64_t>> fwd, bwd;
    for (const Transfer& t : bp.forward) {
      const Transfer back = Transpose(t);
      fwd.insert({back.src_rank, back.wave, back.dst_rank});
    }
    for (size_t i = 0; i < bp.backward.size(); ++i) {
      const Transfer& t = bp.backward[i];
      bwd.insert({t.src_rank, t.wave, t.dst_rank});
      if (i > 0) {
        const Transfer& p = bp.backward[i - 1];
        ASSERT_LT(std::tie(p.src_rank, p.wave, p.dst_rank),
                  std::tie(t.src_rank, t.wave, t.dst_rank));
      }
      // The forward transfer it transposes.
      const Transfer& f = bp.forward[bp.forward_by_dst[i]];
      ASSERT_TRUE(Transpose(f) == t);
    }
    ASSERT_EQ(fwd, bwd);
    ASSERT_EQ(bp.backward_by_dst.size(), bp.backward.size());
    for (size_t i = 1; i < bp.backward_by_dst.size(); ++i) {
      const Transfer& p = bp.backward[bp.backward_by_dst[i - 1]];
      const Transfer& t = bp.backward[bp.backward_by_dst[i]];
      ASSERT_LT(std::tie(p.dst_rank, p.wave, p.src_rank), std::tie(t.dst_rank, t.wave, t.src_rank));
    }
  }
  // Gradients: each LLM rank sends the gradient of the rows it received directly; the encoder
  // rank sums pieces into a zeroed buffer. Count the contributions per job row and rank.
  std::map<std::tuple<int64_t, int64_t>, std::vector<int>> grad_count;  // (enc rank, wave)
  for (const Transfer& t : bp.backward) {
    ASSERT_TRUE(ll.Contains(t.src_rank));
    ASSERT_TRUE(el.Contains(t.dst_rank));
    const std::vector<Tag>& held = expected[slot(t.src_rank, t.wave)];
    const std::vector<Tag>& job = job_buffer.at({el.CoordsOf(t.dst_rank).dp, t.wave});
    std::vector<int>& count = grad_count[{t.dst_rank, t.wave}];
    count.resize(job.size(), 0);
    for (const BlockPiece& p : t.pieces) {
      ASSERT_EQ(bp.block_sender[plan.encoder.FlatImage(p.sample, p.image)], t.dst_rank);
      for (int64_t r = 0; r < p.rows; ++r) {
        const Tag tag{p.sample, p.image, p.row_begin + r};
        ASSERT_EQ(held[p.src_offset + r], tag);
        ASSERT_EQ(job[p.dst_offset + r], tag);
        ++count[p.dst_offset + r];
      }
    }
  }
  for (const EncoderJob& job : plan.encoder.jobs) {
    for (int64_t rank : el.TpGroup(el.RankOf(job.replica, 0, 0, 0))) {
      auto it = grad_count.find({rank, job.wave});
      for (size_t i = 0; i < job.images.size(); ++i) {
        const ImageRef& ref = job.images[i];
        const bool sender = bp.block_sender[plan.encoder.FlatImage(ref.sample, ref.image)] == rank;
        for (int64_t r = 0; r < samples[ref.sample].tokens_per_image; ++r) {
          const int have = it == grad_count.end() ? 0 : it->second[job.row_offsets[i] + r];
          ASSERT_EQ(have, sender ? 1 : 0)
              << "gradient of " << Tag{ref.sample, ref.image, r} << " at rank " << rank;
        }
      }
    }
  }
  // Encoder share steps complete every TP rank's gradient buffer exactly once.
  if (el.tp == 1) {
    ASSERT_TRUE(bp.encoder_shares.empty());
  } else {
    ASSERT_EQ(bp.encoder_shares.size(), plan.encoder.jobs.size());
    for (const ShareStep& s : bp.encoder_shares) {
      ASSERT_EQ(s.module, Module::kEncoder);
      ASSERT_EQ(s.ranks, el.TpGroup(el.RankOf(s.replica, 0, 0, 0)));
      const EncoderJob* job = plan.encoder.Find(s.replica, s.wave);
      ASSERT_NE(job, nullptr);
      ASSERT_EQ(s.buffer_rows, job->rows);
      std::map<int64_t, std::vector<int>> have;
      for (int64_t rank : s.ranks) {
        auto it = grad_count.find({rank, s.wave});
        have[rank] = it == grad_count.end() ? std::vector<int>(job->rows, 0) : it->second;
      }
      int64_t next = 0;
      for (const ShareSegment& seg : s.segments) {
        ASSERT_EQ(seg.offset, next);
        next += seg.rows;
        for (int64_t r = seg.offset; r < seg.offset + seg.rows; ++r) {
          ASSERT_EQ(have[seg.holder_rank][r], 1) << "holder lacks gradient row " << r;
          for (int64_t rank : s.ranks) {
            if (rank != seg.holder_rank) ++have[rank][r];
          }
        }
      }
      ASSERT_EQ(next, job->rows);
      for (const auto& [rank, rows] : have) {
        for (int64_t r = 0; r < job->rows; ++r) ASSERT_EQ(rows[r], 1) << rank << " row " << r;
      }
    }
  }

  // Source spreading bound: max <= S/t + (1 - 1/t) b over each encoder replica's TP ranks
  // (checked as max * t <= S + (t - 1) * b in integers), and <= 1.25 x mean when S >= 4(t-1)b.
  std::vector<int64_t> sent(el.size(), 0);
  for (const Transfer& t : bp.forward) sent[t.src_rank - el.rank_offset] += t.rows;
  std::vector<int64_t> largest(el.dp, 0);
  for (const EncoderJob& job : plan.encoder.jobs) {
    for (const ImageRef& ref : job.images) {
      largest[job.replica] = std::max(largest[job.replica], samples[ref.sample].tokens_per_image);
    }
  }
  for (int64_t e = 0; e < el.dp; ++e) {
    int64_t total = 0, max = 0;
    for (int64_t t = 0; t < el.tp; ++t) {
      const int64_t v = sent[el.RankOf(e, t, 0, 0) - el.rank_offset];
      total += v;
      max = std::max(max, v);
    }
    ASSERT_LE(max * el.tp, total + (el.tp - 1) * largest[e]) << "encoder replica " << e;
    if (total >= 4 * (el.tp - 1) * largest[e]) {
      ASSERT_LE(4 * max * el.tp, 5 * total) << "encoder replica " << e;
    }
  }
  // Landing spread without SP: the same bound over each (replica, cp) group's TP ranks.
  if (share) {
    std::vector<int64_t> received(first_stage, 0);
    std::vector<int64_t> largest_piece(first_stage, 0);
    for (const Transfer& t : bp.forward) {
      received[t.dst_rank - ll.rank_offset] += t.rows;
      const int64_t group = (t.dst_rank - ll.rank_offset) / ll.tp;
      for (const BlockPiece& p : t.pieces) {
        largest_piece[group] = std::max(largest_piece[group], p.rows);
      }
    }
    for (int64_t g = 0; g < first_stage / ll.tp; ++g) {
      int64_t total = 0, max = 0;
      for (int64_t t = 0; t < ll.tp; ++t) {
        total += received[g * ll.tp + t];
        max = std::max(max, received[g * ll.tp + t]);
      }
      ASSERT_LE(max * ll.tp, total + (ll.tp - 1) * largest_piece[g]) << "llm group " << g;
    }
  }

  // Per-rank views agree with a linear scan.
  for (int64_t rank = 0; rank < plan.placement.world_size; ++rank) {
    size_t from = 0, to = 0, bfrom = 0, bto = 0;
    for (const Transfer& t : bp.forward) {
      from += t.src_rank == rank;
      to += t.dst_rank == rank;
    }
    for (const Transfer& t : bp.backward) {
      bfrom += t.src_rank == rank;
      bto += t.dst_rank == rank;
    }
    const auto f = ForwardFrom(bp, rank);
    const auto g = ForwardTo(bp, rank);
    ASSERT_EQ(f.size(), from);
    ASSERT_EQ(g.size(), to);
    ASSERT_EQ(BackwardFrom(bp, rank).size(), bfrom);
    ASSERT_EQ(BackwardTo(bp, rank).size(), bto);
    for (const Transfer* t : f) ASSERT_EQ(t->src_rank, rank);
    for (const Transfer* t : g) ASSERT_EQ(t->dst_rank, rank);
    for (size_t i = 1; i < g.size(); ++i) {
      ASSERT_LT(std::tie(g[i - 1]->wave, g[i - 1]->src_rank), std::tie(g[i]->wave, g[i]->src_rank));
    }
    size_t llm_shares = 0;
    for (const ShareStep& s : bp.llm_shares) {
      llm_shares += std::count(s.ranks.begin(), s.ranks.end(), rank);
    }
    ASSERT_EQ(LlmSharesOf(bp, ll, rank).size(), llm_shares);
    size_t encoder_shares = 0;
    for (const ShareStep& s : bp.encoder_shares) {
      encoder_shares += std::count(s.ranks.begin(), s.ranks.end(), rank);
    }
    ASSERT_EQ(EncoderSharesOf(bp, el, rank).size(), encoder_shares);
  }
}

void ExpectSamePlan(const StepPlan& a, const StepPlan& b) {
  EXPECT_TRUE(a.llm == b.llm);
  EXPECT_TRUE(a.encoder == b.encoder);
  EXPECT_TRUE(a.boundary.forward == b.boundary.forward);
  EXPECT_TRUE(a.boundary.backward == b.boundary.backward);
  EXPECT_EQ(a.boundary.forward_by_dst, b.boundary.forward_by_dst);
  EXPECT_EQ(a.boundary.backward_by_dst, b.boundary.backward_by_dst);
  EXPECT_TRUE(a.boundary.llm_shares == b.boundary.llm_shares);
  EXPECT_TRUE(a.boundary.encoder_shares == b.boundary.encoder_shares);
  EXPECT_EQ(a.boundary.block_sender, b.boundary.block_sender);
  EXPECT_EQ(a.boundary.llm_buffer_rows, b.boundary.llm_buffer_rows);
  EXPECT_EQ(a.n_global, b.n_global);
}

TEST(BoundaryPlanPropertyTest, RandomLayoutsAndBatches) {
  int64_t with_cp = 0, with_sp = 0, colocated = 0, split_samples = 0, text_only = 0, uneven = 0;
  for (uint64_t seed = 0; seed < 2500; ++seed) {
    const Case c = RandomCase(seed);
    SCOPED_TRACE(absl::StrCat("seed ", seed, ": ", c.Describe()));
    auto plan = BuildStepPlan(c.placement, c.samples, c.options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    CheckPlan(*plan);
    if (HasFatalFailure()) return;
    auto again = BuildStepPlan(c.placement, c.samples, c.options);
    ASSERT_TRUE(again.ok());
    ExpectSamePlan(*plan, *again);
    with_cp += c.placement.llm.cp > 1;
    with_sp += c.placement.llm.sequence_parallel;
    colocated += c.placement.kind == PlacementKind::kColocated;
    text_only += plan->encoder.total_images() == 0;
    uneven += static_cast<int64_t>(c.samples.size()) <
              c.options.waves * c.options.micro_batch * c.placement.llm.dp;
    // Samples whose images were encoded on more than one encoder replica.
    for (int64_t s = 0; s < static_cast<int64_t>(plan->samples.size()); ++s) {
      std::set<int64_t> replicas;
      for (int64_t k = 0; k < plan->samples[s].image_count(); ++k) {
        replicas.insert(
            plan->encoder.jobs[plan->encoder.image_job[plan->encoder.FlatImage(s, k)]].replica);
      }
      split_samples += replicas.size() > 1;
    }
  }
  // The generator reaches every regime the properties are about.
  EXPECT_GT(with_cp, 500);
  EXPECT_GT(with_sp, 300);
  EXPECT_GT(colocated, 300);
  EXPECT_GT(split_samples, 500);
  EXPECT_GT(text_only, 50);
  EXPECT_GT(uneven, 200);
}

// Plans for fixed layouts and a mixed batch (zero, one and many images per sample).
StepPlan PlanFor(const Layout& enc, const Layout& llm, int64_t waves, int64_t micro_batch,
                 uint64_t seed = 11) {
  std::mt19937_64 rng(seed);
  Case c;
  auto placement = MakePlacement(PlacementKind::kNonColocated, enc, llm);
  EXPECT_TRUE(placement.ok()) << placement.status();
  c.placement = *placement;
  c.options.waves = waves;
  c.options.micro_batch = micro_batch;
  c.options.row_bytes = 64;
  c.options.seed = seed;
  c.options.encoder_cost = kEncoderCost;
  c.options.llm_cost = kLlmCost;
  const int64_t batch = waves * micro_batch * llm.dp;
  int64_t longest = 1;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t images = i % 5 == 0 ? 0 : (i % 7 == 0 ? 12 : 1 + static_cast<int64_t>(rng() % 3));
    c.samples.push_back(RandomSample(rng, i, images, 16, 5 + static_cast<int64_t>(rng() % 20)));
    longest = std::max(longest, c.samples.back().sequence_length());
  }
  c.options.seq_len = RoundUp(longest, 2 * llm.cp * llm.tp);
  auto plan = BuildStepPlan(c.placement, c.samples, c.options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *plan;
}

TEST(BoundaryPlanTest, AnyDpRatio) {
  // encoder dp -> llm dp: fan-out 1 -> 7, uneven 3 -> 2 and 5 -> 3, fan-in 8 -> 1.
  for (const auto& [enc_dp, llm_dp] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 7}, {3, 2}, {5, 3}, {8, 1}}) {
    for (const auto& [enc_tp, llm_tp, cp, sp] :
         std::vector<std::tuple<int64_t, int64_t, int64_t, bool>>{
             {1, 1, 1, false}, {2, 2, 1, false}, {2, 2, 2, false}, {3, 2, 2, true}}) {
      SCOPED_TRACE(absl::StrCat(enc_dp, " -> ", llm_dp, " enc tp ", enc_tp, " llm tp ", llm_tp,
                                " cp ", cp, " sp ", sp));
      const StepPlan plan = PlanFor(Grid(enc_dp, enc_tp), Grid(llm_dp, llm_tp, cp, 2, sp), 3, 2);
      CheckPlan(plan);
      if (HasFatalFailure()) return;
      // Every encoder replica with images talks to some LLM rank; with fan-in every encoder
      // replica feeds the one LLM replica.
      std::set<int64_t> senders;
      for (const Transfer& t : plan.boundary.forward) senders.insert(t.src_rank);
      std::set<int64_t> busy;
      for (const EncoderJob& job : plan.encoder.jobs) busy.insert(job.replica);
      std::set<int64_t> sender_replicas;
      for (int64_t r : senders) sender_replicas.insert(plan.placement.encoder.CoordsOf(r).dp);
      EXPECT_EQ(sender_replicas, busy);
    }
  }
}

TEST(BoundaryPlanTest, ManyImagesOfOneSampleComeFromSeveralEncoderReplicas) {
  Case c;
  c.placement = *MakePlacement(PlacementKind::kNonColocated, Grid(4, 2), Grid(1, 2, 2, 1));
  c.options.waves = 1;
  c.options.micro_batch = 1;
  c.options.row_bytes = 8;
  c.options.seq_len = 160;
  c.options.encoder_cost = kEncoderCost;
  c.options.llm_cost = kLlmCost;
  std::mt19937_64 rng(3);
  c.samples = {RandomSample(rng, 42, 8, 16, 20)};
  auto plan = BuildStepPlan(c.placement, c.samples, c.options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  CheckPlan(*plan);
  ASSERT_EQ(plan->encoder.jobs.size(), 4u);
  for (const EncoderJob& job : plan->encoder.jobs) EXPECT_EQ(job.images.size(), 2u);
  // Each replica's two blocks leave from its two TP ranks (one each).
  std::set<int64_t> senders(plan->boundary.block_sender.begin(), plan->boundary.block_sender.end());
  EXPECT_EQ(senders.size(), 8u);
}

TEST(BoundaryPlanTest, TextOnlyBatchGivesAnEmptyValidPlan) {
  Case c;
  c.placement = *MakePlacement(PlacementKind::kNonColocated, Grid(3, 2), Grid(2, 2, 2, 2, true));
  c.options.waves = 2;
  c.options.micro_batch = 2;
  c.options.row_bytes = 8;
  c.options.seq_len = 64;
  for (int64_t i = 0; i < 8; ++i) c.samples.push_back(MakeSample(i, 0, 0, 30, 10));
  auto plan = BuildStepPlan(c.placement, c.samples, c.options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  CheckPlan(*plan);
  EXPECT_TRUE(plan->boundary.forward.empty());
  EXPECT_TRUE(plan->boundary.backward.empty());
  EXPECT_TRUE(plan->boundary.llm_shares.empty());
  EXPECT_TRUE(plan->boundary.encoder_shares.empty());
  EXPECT_TRUE(plan->encoder.jobs.empty());
  EXPECT_EQ(plan->n_global, 80);
  for (int64_t rows : plan->boundary.llm_buffer_rows) EXPECT_EQ(rows, 0);
}

TEST(BoundaryPlanTest, SendBytesWithinBoundOfTheMean) {
  // Many equal blocks per replica: the spread is exact or within one block.
  const StepPlan plan = PlanFor(Grid(2, 4), Grid(2, 2, 1, 1), 4, 4);
  std::vector<int64_t> sent(plan.placement.encoder.size(), 0);
  for (const Transfer& t : plan.boundary.forward) sent[t.src_rank] += t.rows;
  for (int64_t e = 0; e < 2; ++e) {
    int64_t max = 0, min = INT64_MAX;
    for (int64_t t = 0; t < 4; ++t) {
      max = std::max(max, sent[e * 4 + t]);
      min = std::min(min, sent[e * 4 + t]);
    }
    EXPECT_LE(max - min, 16) << "replica " << e;  // at most one block of 16 rows apart
  }
}

TEST(BoundaryPlanTest, CpLandingFollowsPositions) {
  // One sample, one 8-row image at positions [4, 12) of a 16-position sequence, cp 2 (chunks of
  // 4: rank 0 owns [0,4) and [12,16), rank 1 owns [4,12)): every row lands on CP rank 1.
  Case c;
  c.placement = *MakePlacement(PlacementKind::kNonColocated, Grid(1, 1), Grid(1, 1, 2, 1));
  c.options.waves = 1;
  c.options.micro_batch = 1;
  c.options.row_bytes = 4;
  c.options.seq_len = 16;
  SampleDescriptor s;
  s.id = 9;
  s.text_tokens = 6;
  s.tokens_per_image = 8;
  s.image_starts = {4};
  c.samples = {s};
  auto plan = BuildStepPlan(c.placement, c.samples, c.options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->boundary.forward.size(), 1u);
  const Transfer& t = plan->boundary.forward[0];
  EXPECT_EQ(t.src_rank, 0);
  EXPECT_EQ(t.dst_rank, 2);  // llm ranks start at 1; cp rank 1 is rank 2
  ASSERT_EQ(t.pieces.size(), 1u);
  EXPECT_EQ(t.pieces[0].rows, 8);
  // With seq_len 24 (chunks of 6: CP rank 0 owns [0,6) and [18,24), CP rank 1 owns [6,18)) the
  // same image straddles: rows 0-1 land on CP rank 0, rows 2-7 on CP rank 1.
  c.options.seq_len = 24;
  plan = BuildStepPlan(c.placement, c.samples, c.options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  CheckPlan(*plan);
  ASSERT_EQ(plan->boundary.forward.size(), 2u);
  const Transfer& first = plan->boundary.forward[0];
  const Transfer& second = plan->boundary.forward[1];
  EXPECT_EQ(first.dst_rank, 1);
  ASSERT_EQ(first.pieces.size(), 1u);
  EXPECT_EQ(first.pieces[0].row_begin, 0);
  EXPECT_EQ(first.pieces[0].rows, 2);
  EXPECT_EQ(first.pieces[0].src_offset, 0);
  EXPECT_EQ(first.pieces[0].dst_offset, 0);
  EXPECT_EQ(second.dst_rank, 2);
  ASSERT_EQ(second.pieces.size(), 1u);
  EXPECT_EQ(second.pieces[0].row_begin, 2);
  EXPECT_EQ(second.pieces[0].rows, 6);
  EXPECT_EQ(second.pieces[0].src_offset, 2);
  EXPECT_EQ(second.pieces[0].dst_offset, 0);
  // Backward: both pieces return to encoder rank 0, together tiling the block once.
  ASSERT_EQ(plan->boundary.backward.size(), 2u);
  for (const Transfer& b : plan->boundary.backward) EXPECT_EQ(b.dst_rank, 0);
}

TEST(BoundaryPlanTest, RejectsInconsistentInputs) {
  const StepPlan plan = PlanFor(Grid(2, 1), Grid(2, 1), 2, 1);
  BoundaryPlanOptions options{plan.options.seq_len, 8};
  // Assignment from another layout.
  Placement wrong = plan.placement;
  wrong = *MakePlacement(PlacementKind::kNonColocated, Grid(3, 1), Grid(2, 1));
  auto a = BuildBoundaryPlan(wrong, plan.samples, plan.llm, plan.encoder, options);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("expected encoder dp 3"));
  // A sequence length the LLM cannot shard.
  Placement cp = *MakePlacement(PlacementKind::kNonColocated, Grid(2, 1), Grid(2, 1, 3, 1));
  auto b = BuildBoundaryPlan(cp, plan.samples, plan.llm, plan.encoder, {100, 8});
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("seq_len=100"));
  // A sample whose image count changed after the assignment.
  auto changed = plan.samples;
  for (auto& s : changed) {
    if (s.image_count() > 0) {
      s.image_starts.pop_back();
      s.text_tokens += s.tokens_per_image;
      break;
    }
  }
  auto c = BuildBoundaryPlan(plan.placement, changed, plan.llm, plan.encoder, options);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("sample by sample"));
  // Zero row size.
  EXPECT_FALSE(BuildBoundaryPlan(plan.placement, plan.samples, plan.llm, plan.encoder,
                                 {plan.options.seq_len, 0})
                   .ok());
}

}  // namespace
}  // namespace hetpar::plan
