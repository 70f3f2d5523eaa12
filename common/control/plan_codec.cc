#include "common/control/plan_codec.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace hetpar::coordinator {
namespace {

template <typename T, typename Repeated>
std::vector<T> ToVector(const Repeated& repeated) {
  return std::vector<T>(repeated.begin(), repeated.end());
}

v1::PlanRankCoords CoordsToProto(const plan::RankCoords& c) {
  v1::PlanRankCoords p;
  p.set_dp(c.dp);
  p.set_tp(c.tp);
  p.set_cp(c.cp);
  p.set_pp(c.pp);
  return p;
}

plan::RankCoords CoordsFromProto(const v1::PlanRankCoords& p) {
  return plan::RankCoords{p.dp(), p.tp(), p.cp(), p.pp()};
}

void JobToProto(const plan::EncoderJob& job, v1::PlanEncoderJob* p) {
  p->set_replica(job.replica);
  p->set_wave(job.wave);
  for (const auto& image : job.images) {
    v1::PlanImageRef* ref = p->add_images();
    ref->set_sample(image.sample);
    ref->set_image(image.image);
  }
  for (int64_t offset : job.row_offsets) p->add_row_offsets(offset);
  p->set_rows(job.rows);
  p->set_cost(job.cost);
}

plan::EncoderJob JobFromProto(const v1::PlanEncoderJob& p) {
  plan::EncoderJob job;
  job.replica = p.replica();
  job.wave = p.wave();
  for (const auto& ref : p.images())
    job.images.push_back(plan::ImageRef{ref.sample(), ref.image()});
  job.row_offsets = ToVector<int64_t>(p.row_offsets());
  job.rows = p.rows();
  job.cost = p.cost();
  return job;
}

void TransferToProto(const plan::Transfer& t, v1::PlanTransfer* p) {
  p->set_wave(t.wave);
  p->set_src_rank(t.src_rank);
  p->set_dst_rank(t.dst_rank);
  p->set_rows(t.rows);
  for (const auto& piece : t.pieces) {
    v1::PlanBlockPiece* q = p->add_pieces();
    q->set_sample(piece.sample);
    q->set_image(piece.image);
    q->set_row_begin(piece.row_begin);
    q->set_rows(piece.rows);
    q->set_src_offset(piece.src_offset);
    q->set_dst_offset(piece.dst_offset);
  }
}

plan::Transfer TransferFromProto(const v1::PlanTransfer& p) {
  plan::Transfer t;
  t.wave = p.wave();
  t.src_rank = p.src_rank();
  t.dst_rank = p.dst_rank();
  t.rows = p.rows();
  for (const auto& q : p.pieces()) {
    t.pieces.push_back(plan::BlockPiece{q.sample(), q.image(), q.row_begin(), q.rows(),
                                        q.src_offset(), q.dst_offset()});
  }
  return t;
}

void ShareToProto(const plan::ShareStep& s, v1::PlanShareStep* p) {
  p->set_module(s.module == plan::Module::kEncoder ? v1::MODULE_ENCODER : v1::MODULE_LLM);
  p->set_wave(s.wave);
  p->set_replica(s.replica);
  p->set_cp_rank(s.cp_rank);
  for (int64_t rank : s.ranks) p->add_ranks(rank);
  p->set_buffer_rows(s.buffer_rows);
  for (const auto& segment : s.segments) {
    v1::PlanShareSegment* q = p->add_segments();
    q->set_holder_rank(segment.holder_rank);
    q->set_offset(segment.offset);
    q->set_rows(segment.rows);
  }
}

absl::StatusOr<plan::ShareStep> ShareFromProto(const v1::PlanShareStep& p,
                                               const std::string& where) {
  plan::ShareStep s;
  switch (p.module()) {
    case v1::MODULE_ENCODER:
      s.module = plan::Module::kEncoder;
      break;
    case v1::MODULE_LLM:
      s.module = plan::Module::kLlm;
      break;
    case v1::MODULE_UNSPECIFIED:
    case v1::Module_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::Module_INT_MAX_SENTINEL_DO_NOT_USE_:
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".module=", p.module(), "; expected encoder or llm"));
  }
  s.wave = p.wave();
  s.replica = p.replica();
  s.cp_rank = p.cp_rank();
  s.ranks = ToVector<int64_t>(p.ranks());
  s.buffer_rows = p.buffer_rows();
  for (const auto& q : p.segments()) {
    s.segments.push_back(plan::ShareSegment{q.holder_rank(), q.offset(), q.rows()});
  }
  return s;
}

}  // namespace

v1::RankStepPlan RankStepPlanToProto(const plan::RankStepPlan& plan) {
  v1::RankStepPlan p;
  p.set_rank(plan.rank);
  p.set_step(plan.step);
  p.set_generation(plan.generation);
  p.set_attempt(plan.attempt);
  p.set_waves(plan.waves);
  p.set_n_global(plan.n_global);
  p.set_seq_len(plan.seq_len);
  p.set_row_bytes(plan.row_bytes);
  p.set_encoder_role(plan.encoder_role);
  if (plan.encoder_role) *p.mutable_encoder_coords() = CoordsToProto(plan.encoder_coords);
  for (const auto& job : plan.encoder_jobs) JobToProto(job, p.add_encoder_jobs());
  for (const auto& t : plan.forward_sends) TransferToProto(t, p.add_forward_sends());
  for (const auto& t : plan.backward_receives) TransferToProto(t, p.add_backward_receives());
  for (const auto& s : plan.encoder_shares) ShareToProto(s, p.add_encoder_shares());
  p.set_llm_role(plan.llm_role);
  if (plan.llm_role) *p.mutable_llm_coords() = CoordsToProto(plan.llm_coords);
  for (const auto& mb : plan.microbatches) {
    v1::PlanMicrobatch* q = p.add_microbatches();
    q->set_replica(mb.replica);
    q->set_wave(mb.wave);
    for (int64_t sample : mb.samples) q->add_samples(sample);
    q->set_tokens(mb.tokens);
    q->set_image_rows(mb.image_rows);
    q->set_loss_tokens(mb.loss_tokens);
    q->set_cost(mb.cost);
  }
  for (int64_t rows : plan.image_rows) p.add_image_rows(rows);
  for (const auto& t : plan.forward_receives) TransferToProto(t, p.add_forward_receives());
  for (const auto& t : plan.backward_sends) TransferToProto(t, p.add_backward_sends());
  for (const auto& s : plan.llm_shares) ShareToProto(s, p.add_llm_shares());
  for (int64_t index : plan.sample_indices) p.add_sample_indices(index);
  for (const auto& sample : plan.samples) {
    v1::PlanSample* q = p.add_samples();
    q->set_id(sample.id);
    q->set_text_tokens(sample.text_tokens);
    q->set_loss_tokens(sample.loss_tokens);
    q->set_tokens_per_image(sample.tokens_per_image);
    for (int64_t start : sample.image_starts) q->add_image_starts(start);
    q->set_id_checksum(sample.id_checksum);
    q->set_token_checksum(sample.token_checksum);
  }
  return p;
}

absl::StatusOr<plan::RankStepPlan> RankStepPlanFromProto(const v1::RankStepPlan& p) {
  plan::RankStepPlan plan;
  plan.rank = p.rank();
  plan.step = p.step();
  plan.generation = p.generation();
  plan.attempt = p.attempt();
  plan.waves = p.waves();
  plan.n_global = p.n_global();
  plan.seq_len = p.seq_len();
  plan.row_bytes = p.row_bytes();
  const std::string where = absl::StrCat("step plan of rank ", p.rank(), " (step ", p.step(), ")");
  if (p.sample_indices_size() != p.samples_size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", p.sample_indices_size(),
                                                   " sample_indices but ", p.samples_size(),
                                                   " samples; expected one descriptor per index"));
  }
  plan.sample_indices = ToVector<int64_t>(p.sample_indices());
  for (size_t i = 1; i < plan.sample_indices.size(); ++i) {
    if (plan.sample_indices[i] <= plan.sample_indices[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": sample_indices[", i, "]=", plan.sample_indices[i], " after ",
                       plan.sample_indices[i - 1], "; expected strictly increasing batch indices"));
    }
  }
  for (const auto& q : p.samples()) {
    plan::SampleDescriptor sample;
    sample.id = q.id();
    sample.text_tokens = q.text_tokens();
    sample.loss_tokens = q.loss_tokens();
    sample.tokens_per_image = q.tokens_per_image();
    sample.image_starts = ToVector<int64_t>(q.image_starts());
    sample.id_checksum = q.id_checksum();
    sample.token_checksum = q.token_checksum();
    plan.samples.push_back(std::move(sample));
  }
  auto check_sample = [&](int64_t batch_index, const char* field) -> absl::Status {
    if (plan.Sample(batch_index) != nullptr) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", field, " names batch index ",
                                                   batch_index,
                                                   ", which the plan carries no descriptor for"));
  };
  plan.encoder_role = p.encoder_role();
  plan.encoder_coords = CoordsFromProto(p.encoder_coords());
  for (const auto& q : p.encoder_jobs()) {
    plan.encoder_jobs.push_back(JobFromProto(q));
    for (const auto& image : plan.encoder_jobs.back().images) {
      if (absl::Status s = check_sample(image.sample, "encoder_jobs.images"); !s.ok()) return s;
    }
  }
  auto transfers = [&](const auto& from, std::vector<plan::Transfer>* to,
                       const char* field) -> absl::Status {
    for (const auto& q : from) {
      to->push_back(TransferFromProto(q));
      for (const auto& piece : to->back().pieces) {
        if (absl::Status s = check_sample(piece.sample, field); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  };
  auto shares = [&](const auto& from, std::vector<plan::ShareStep>* to,
                    const char* field) -> absl::Status {
    for (const auto& q : from) {
      absl::StatusOr<plan::ShareStep> share = ShareFromProto(q, absl::StrCat(where, ": ", field));
      if (!share.ok()) return share.status();
      to->push_back(*std::move(share));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = transfers(p.forward_sends(), &plan.forward_sends, "forward_sends");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          transfers(p.backward_receives(), &plan.backward_receives, "backward_receives");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = shares(p.encoder_shares(), &plan.encoder_shares, "encoder_shares");
      !s.ok()) {
    return s;
  }
  plan.llm_role = p.llm_role();
  plan.llm_coords = CoordsFromProto(p.llm_coords());
  for (const auto& q : p.microbatches()) {
    plan::LlmMicrobatch mb;
    mb.replica = q.replica();
    mb.wave = q.wave();
    mb.samples = ToVector<int64_t>(q.samples());
    mb.tokens = q.tokens();
    mb.image_rows = q.image_rows();
    mb.loss_tokens = q.loss_tokens();
    mb.cost = q.cost();
    for (int64_t sample : mb.samples) {
      if (absl::Status s = check_sample(sample, "microbatches.samples"); !s.ok()) return s;
    }
    plan.microbatches.push_back(std::move(mb));
  }
  plan.image_rows = ToVector<int64_t>(p.image_rows());
  if (absl::Status s = transfers(p.forward_receives(), &plan.forward_receives, "forward_receives");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = transfers(p.backward_sends(), &plan.backward_sends, "backward_sends");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = shares(p.llm_shares(), &plan.llm_shares, "llm_shares"); !s.ok()) return s;
  return plan;
}

}  // namespace hetpar::coordinator
