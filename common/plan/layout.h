// Parallel layouts of the two modules and their placement on ranks.
//
// A module's layout is a grid of `dp x tp x cp x pp` ranks starting at `rank_offset`. The order
// of the dimensions is fixed everywhere in hetpar: tp fastest, then cp, then dp, then pp:
//
//   rank = rank_offset + tp + TP * (cp + CP * (dp + DP * pp))
//
// so the first pipeline stage of every replica (pp = 0) is the contiguous span
// [rank_offset, rank_offset + dp * tp * cp). A replica (one DP copy) is the tp x cp x pp ranks
// with one dp coordinate.
//
// Placement puts both modules on world ranks:
//   non-colocated: encoder ranks [0, E), LLM ranks [E, E + L), world size E + L;
//   colocated:     both layouts over [0, W), so E = L = W and every process is a rank of both.
//
// Everything here is pure and cheap; values are plain structs that copy freely.
#ifndef HETPAR_COMMON_PLAN_LAYOUT_H_
#define HETPAR_COMMON_PLAN_LAYOUT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hetpar/v1/run_spec.pb.h"

namespace hetpar::plan {

enum class Module { kEncoder, kLlm };

// "encoder" or "llm".
std::string_view ModuleName(Module module);

// A rank's coordinates inside its module's grid.
struct RankCoords {
  int64_t dp = 0;
  int64_t tp = 0;
  int64_t cp = 0;
  int64_t pp = 0;
};

bool operator==(const RankCoords& a, const RankCoords& b);

struct Layout {
  int64_t dp = 1;
  int64_t tp = 1;
  int64_t cp = 1;
  int64_t pp = 1;
  bool sequence_parallel = false;
  int64_t rank_offset = 0;  // world rank of grid coordinate (0, 0, 0, 0)

  // Ranks in the grid: dp * tp * cp * pp.
  int64_t size() const { return dp * tp * cp * pp; }
  // Ranks in one replica: tp * cp * pp.
  int64_t replica_size() const { return tp * cp * pp; }
  // Ranks of the first pipeline stage over all replicas: dp * tp * cp.
  int64_t first_stage_size() const { return dp * tp * cp; }
  int64_t end_rank() const { return rank_offset + size(); }
  bool Contains(int64_t rank) const { return rank >= rank_offset && rank < end_rank(); }

  // World rank of `coords`. Coordinates must be inside the grid.
  int64_t RankOf(const RankCoords& coords) const {
    return rank_offset + coords.tp + tp * (coords.cp + cp * (coords.dp + dp * coords.pp));
  }
  int64_t RankOf(int64_t dp_index, int64_t tp_index, int64_t cp_index, int64_t pp_index) const {
    return RankOf(RankCoords{dp_index, tp_index, cp_index, pp_index});
  }
  // Coordinates of a rank the layout contains (unchecked; see Locate).
  RankCoords CoordsOf(int64_t rank) const;
  // Coordinates of `rank`, or InvalidArgument naming the layout's span when it is outside.
  absl::StatusOr<RankCoords> Locate(int64_t rank) const;

  // Groups of the rank, as world ranks in increasing coordinate order. The rank must be inside.
  std::vector<int64_t> TpGroup(int64_t rank) const;  // same dp, cp, pp
  std::vector<int64_t> CpGroup(int64_t rank) const;  // same dp, tp, pp
  std::vector<int64_t> DpGroup(int64_t rank) const;  // same tp, cp, pp
  std::vector<int64_t> PpGroup(int64_t rank) const;  // same dp, tp, cp: the rank's pipeline
  int64_t PpStage(int64_t rank) const { return CoordsOf(rank).pp; }
  // All ranks of replica `dp_index`, in rank order.
  std::vector<int64_t> ReplicaRanks(int64_t dp_index) const;

  // "dp 2 x tp 8 x cp 2 x pp 4, sequence parallel, ranks [32, 160)".
  std::string ToString() const;
};

bool operator==(const Layout& a, const Layout& b);

// Checks every dimension is >= 1, the offset is >= 0, and that an encoder layout has
// cp = pp = 1 and no sequence parallelism. `name` prefixes messages ("encoder.layout").
absl::Status ValidateLayout(const Layout& layout, Module module, std::string_view name);

// A layout from the RunSpec's layout message (offset 0).
Layout LayoutFromProto(const hetpar::v1::Layout& proto);

enum class PlacementKind { kNonColocated, kColocated };

std::string_view PlacementKindName(PlacementKind kind);  // "non_colocated" / "colocated"

struct Placement {
  PlacementKind kind = PlacementKind::kNonColocated;
  Layout encoder;
  Layout llm;
  int64_t world_size = 0;

  bool IsEncoderRank(int64_t rank) const { return encoder.Contains(rank); }
  bool IsLlmRank(int64_t rank) const { return llm.Contains(rank); }
};

bool operator==(const Placement& a, const Placement& b);

// Places the two layouts by the convention above (their rank_offset fields are overwritten)
// and validates them: dimensions, encoder restrictions, and for colocated placement equal
// world sizes.
absl::StatusOr<Placement> MakePlacement(PlacementKind kind, Layout encoder, Layout llm);

// Checks a placement built by hand: valid layouts, spans as the convention above says
// (disjoint and back to back for non-colocated, identical for colocated) and world_size.
absl::Status ValidatePlacement(const Placement& placement);

// The placement of a RunSpec (placement, encoder.layout, llm.layout).
absl::StatusOr<Placement> PlacementFromRunSpec(const hetpar::v1::RunSpec& spec);

// Layers [first, last) of pipeline stage `stage` of `stages` (1 <= stages <= layers): the
// layers split as evenly as they go, stage k taking [k * layers / stages, (k+1) * layers /
// stages), so every stage holds floor or ceil of layers / stages, at least one.
std::pair<int64_t, int64_t> PipelineStageLayers(int64_t layers, int64_t stages, int64_t stage);

}  // namespace hetpar::plan

#endif  // HETPAR_COMMON_PLAN_LAYOUT_H_
