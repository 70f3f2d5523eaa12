#include "common/plan/layout.h"

#include "absl/strings/str_cat.h"

namespace hetpar::plan {

std::string_view ModuleName(Module module) {
  switch (module) {
    case Module::kEncoder:
      return "encoder";
    case Module::kLlm:
      return "llm";
  }
  return "unknown";
}

bool operator==(const RankCoords& a, const RankCoords& b) {
  return a.dp == b.dp && a.tp == b.tp && a.cp == b.cp && a.pp == b.pp;
}

RankCoords Layout::CoordsOf(int64_t rank) const {
  int64_t local = rank - rank_offset;
  RankCoords coords;
  coords.tp = local % tp;
  local /= tp;
  coords.cp = local % cp;
  local /= cp;
  coords.dp = local % dp;
  coords.pp = local / dp;
  return coords;
}

absl::StatusOr<RankCoords> Layout::Locate(int64_t rank) const {
  if (!Contains(rank)) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is outside the layout ",
                                                   ToString(), "; expected a rank in [",
                                                   rank_offset, ", ", end_rank(), ")"));
  }
  return CoordsOf(rank);
}

std::vector<int64_t> Layout::TpGroup(int64_t rank) const {
  RankCoords c = CoordsOf(rank);
  std::vector<int64_t> group;
  group.reserve(tp);
  for (c.tp = 0; c.tp < tp; ++c.tp) group.push_back(RankOf(c));
  return group;
}

std::vector<int64_t> Layout::CpGroup(int64_t rank) const {
  RankCoords c = CoordsOf(rank);
  std::vector<int64_t> group;
  group.reserve(cp);
  for (c.cp = 0; c.cp < cp; ++c.cp) group.push_back(RankOf(c));
  return group;
}

std::vector<int64_t> Layout::DpGroup(int64_t rank) const {
  RankCoords c = CoordsOf(rank);
  std::vector<int64_t> group;
  group.reserve(dp);
  for (c.dp = 0; c.dp < dp; ++c.dp) group.push_back(RankOf(c));
  return group;
}

std::vector<int64_t> Layout::PpGroup(int64_t rank) const {
  RankCoords c = CoordsOf(rank);
  std::vector<int64_t> group;
  group.reserve(pp);
  for (c.pp = 0; c.pp < pp; ++c.pp) group.push_back(RankOf(c));
  return group;
}

std::vector<int64_t> Layout::ReplicaRanks(int64_t dp_index) const {
  std::vector<int64_t> ranks;
  ranks.reserve(replica_size());
  for (int64_t p = 0; p < pp; ++p) {
    for (int64_t c = 0; c < cp; ++c) {
      for (int64_t t = 0; t < tp; ++t) ranks.push_back(RankOf(dp_index, t, c, p));
    }
  }
  return ranks;
}

std::string Layout::ToString() const {
  std::string text = absl::StrCat("dp ", dp, " x tp ", tp);
  if (cp != 1 || pp != 1) absl::StrAppend(&text, " x cp ", cp, " x pp ", pp);
  if (sequence_parallel) absl::StrAppend(&text, ", sequence parallel");
  absl::StrAppend(&text, ", ranks [", rank_offset, ", ", end_rank(), ")");
  return text;
}

bool operator==(const Layout& a, const Layout& b) {
  return a.dp == b.dp && a.tp == b.tp && a.cp == b.cp && a.pp == b.pp &&
         a.sequence_parallel == b.sequence_parallel && a.rank_offset == b.rank_offset;
}

absl::Status ValidateLayout(const Layout& layout, Module module, std::string_view name) {
  const std::string prefix(name);
  for (const auto& [dim, value] : {std::pair<const char*, int64_t>{"dp", layout.dp},
                                   {"tp", layout.tp},
                                   {"cp", layout.cp},
                                   {"pp", layout.pp}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, ".", dim, "=", value, " must be >= 1"));
    }
  }
  if (layout.rank_offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, " starts at rank ", layout.rank_offset, "; expected >= 0"));
  }
  if (module == Module::kEncoder) {
    if (layout.cp != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, ".cp=", layout.cp, ": the encoder has no context parallelism; expected 1"));
    }
    if (layout.pp != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, ".pp=", layout.pp, ": the encoder is not pipelined; expected 1"));
    }
  }
  return absl::OkStatus();
}

Layout LayoutFromProto(const hetpar::v1::Layout& proto) {
  Layout layout;
  layout.dp = proto.dp();
  layout.tp = proto.tp();
  layout.cp = proto.cp();
  layout.pp = proto.pp();
  layout.sequence_parallel = proto.sequence_parallel();
  layout.rank_offset = 0;
  return layout;
}

std::string_view PlacementKindName(PlacementKind kind) {
  switch (kind) {
    case PlacementKind::kNonColocated:
      return "non_colocated";
    case PlacementKind::kColocated:
      return "colocated";
  }
  return "unknown";
}

bool operator==(const Placement& a, const Placement& b) {
  return a.kind == b.kind && a.encoder == b.encoder && a.llm == b.llm &&
         a.world_size == b.world_size;
}

absl::StatusOr<Placement> MakePlacement(PlacementKind kind, Layout encoder, Layout llm) {
  encoder.rank_offset = 0;
  llm.rank_offset = 0;
  if (kind == PlacementKind::kNonColocated) llm.rank_offset = encoder.size();
  Placement placement;
  placement.kind = kind;
  placement.encoder = encoder;
  placement.llm = llm;
  placement.world_size =
      kind == PlacementKind::kNonColocated ? encoder.size() + llm.size() : llm.size();
  if (absl::Status status = ValidatePlacement(placement); !status.ok()) return status;
  return placement;
}

absl::Status ValidatePlacement(const Placement& placement) {
  if (absl::Status s = ValidateLayout(placement.encoder, Module::kEncoder, "encoder.layout");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateLayout(placement.llm, Module::kLlm, "llm.layout"); !s.ok()) {
    return s;
  }
  const Layout& e = placement.encoder;
  const Layout& l = placement.llm;
  if (placement.kind == PlacementKind::kNonColocated) {
    if (e.rank_offset != 0 || l.rank_offset != e.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("non-colocated placement puts encoder ranks at [0, ", e.size(),
                       ") and LLM ranks at [", e.size(), ", ", e.size() + l.size(),
                       "); got encoder ", e.ToString(), " and llm ", l.ToString()));
    }
    if (placement.world_size != e.size() + l.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("non-colocated world size is ", placement.world_size, "; expected encoder ",
                       e.size(), " + llm ", l.size(), " = ", e.size() + l.size()));
    }
    return absl::OkStatus();
  }
  if (e.size() != l.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "colocated layouts must cover the same ranks: encoder dp x tp = ", e.size(), " (",
        e.ToString(), "), llm dp x tp x cp x pp = ", l.size(), " (", l.ToString(), ")"));
  }
  if (e.rank_offset != 0 || l.rank_offset != 0 || placement.world_size != l.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("colocated placement puts both layouts at ranks [0, ", l.size(),
                     ") with world size ", l.size(), "; got encoder ", e.ToString(), ", llm ",
                     l.ToString(), ", world size ", placement.world_size));
  }
  return absl::OkStatus();
}

absl::StatusOr<Placement> PlacementFromRunSpec(const hetpar::v1::RunSpec& spec) {
  PlacementKind kind = PlacementKind::kNonColocated;
  if (spec.placement() == hetpar::v1::PLACEMENT_COLOCATED) {
    kind = PlacementKind::kColocated;
  } else if (spec.placement() != hetpar::v1::PLACEMENT_NON_COLOCATED) {
    return absl::InvalidArgumentError(absl::StrCat(
        "placement=", spec.placement(), " is not a placement; expected non_colocated (",
        hetpar::v1::PLACEMENT_NON_COLOCATED, ") or colocated (", hetpar::v1::PLACEMENT_COLOCATED,
        ")"));
  }
  return MakePlacement(kind, LayoutFromProto(spec.encoder().layout()),
                       LayoutFromProto(spec.llm().layout()));
}

std::pair<int64_t, int64_t> PipelineStageLayers(int64_t layers, int64_t stages, int64_t stage) {
  return {stage * layers / stages, (stage + 1) * layers / stages};
}

}  // namespace hetpar::plan
