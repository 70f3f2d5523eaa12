#include "coordinator/membership.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hetpar::coordinator {

GridShape GridShape::FromLayout(const v1::Layout& layout) {
  GridShape grid;
  grid.dp = std::max<int64_t>(1, layout.dp());
  grid.tp = std::max<int64_t>(1, layout.tp());
  grid.cp = std::max<int64_t>(1, layout.cp());
  grid.pp = std::max<int64_t>(1, layout.pp());
  return grid;
}

v1::RankCoordinates CoordinatesOf(v1::Module module, const GridShape& grid, int64_t rank) {
  v1::RankCoordinates c;
  c.set_module(module);
  c.set_rank(rank);
  int64_t rest = rank;
  c.set_tp(rest % grid.tp);
  rest /= grid.tp;
  c.set_cp(rest % grid.cp);
  rest /= grid.cp;
  c.set_dp(rest % grid.dp);
  rest /= grid.dp;
  c.set_pp(rest);
  return c;
}

const char* RoleName(v1::WorkerRole role) {
  switch (role) {
    case v1::WORKER_ROLE_ENCODER:
      return "encoder";
    case v1::WORKER_ROLE_LLM:
      return "llm";
    case v1::WORKER_ROLE_COLOCATED:
      return "colocated";
    case v1::WORKER_ROLE_UNSPECIFIED:
    case v1::WorkerRole_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::WorkerRole_INT_MAX_SENTINEL_DO_NOT_USE_:
      break;
  }
  return "unspecified";
}

const char* ModuleName(v1::Module module) {
  switch (module) {
    case v1::MODULE_ENCODER:
      return "encoder";
    case v1::MODULE_LLM:
      return "llm";
    case v1::MODULE_UNSPECIFIED:
    case v1::Module_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::Module_INT_MAX_SENTINEL_DO_NOT_USE_:
      break;
  }
  return "unspecified";
}

std::string DescribeRank(const v1::RankCoordinates& rank) {
  std::string text = absl::StrCat(ModuleName(rank.module()), " rank ", rank.rank(), " (dp ",
                                  rank.dp(), ", tp ", rank.tp());
  if (rank.module() == v1::MODULE_LLM)
    absl::StrAppend(&text, ", cp ", rank.cp(), ", pp ", rank.pp());
  return text + ")";
}

std::string DataAddressText(const std::string& address) {
  if (address.empty()) return "-";
  for (unsigned char c : address) {
    if (c < 0x20 || c >= 0x7f) return absl::StrCat("<", address.size(), "-byte address>");
  }
  return address;
}

std::string WorkerRecord::Describe() const {
  std::vector<std::string> rank_text;
  for (const auto& rank : ranks) rank_text.push_back(DescribeRank(rank));
  return absl::StrCat(worker_id, " (", absl::StrJoin(rank_text, " + "), ", host ",
                      host.empty() ? "?" : host, ")");
}

absl::StatusOr<Membership> Membership::Create(const v1::RunSpec& spec) {
  Membership m;
  m.placement_ = spec.placement() == v1::PLACEMENT_COLOCATED ? v1::PLACEMENT_COLOCATED
                                                             : v1::PLACEMENT_NON_COLOCATED;
  m.encoder_grid_ = GridShape::FromLayout(spec.encoder().layout());
  // The encoder has no context or pipeline parallelism.
  m.encoder_grid_.cp = 1;
  m.encoder_grid_.pp = 1;
  m.llm_grid_ = GridShape::FromLayout(spec.llm().layout());
  if (m.placement_ == v1::PLACEMENT_COLOCATED) {
    if (m.encoder_grid_.size() != m.llm_grid_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement colocated needs both layouts to cover the same ranks: encoder ",
                       m.encoder_grid_.size(), " ranks, llm ", m.llm_grid_.size(), " ranks"));
    }
    m.slots_[v1::WORKER_ROLE_COLOCATED].assign(m.llm_grid_.size(), nullptr);
    m.expected_workers_ = m.llm_grid_.size();
  } else {
    m.slots_[v1::WORKER_ROLE_ENCODER].assign(m.encoder_grid_.size(), nullptr);
    m.retired_encoder_replicas_.assign(m.encoder_grid_.dp, false);
    m.open_encoder_replicas_.assign(m.encoder_grid_.dp, false);
    m.open_llm_replicas_.assign(m.llm_grid_.dp, false);
    m.retired_llm_replicas_.assign(m.llm_grid_.dp, false);
    m.slots_[v1::WORKER_ROLE_LLM].assign(m.llm_grid_.size(), nullptr);
    m.expected_workers_ = m.encoder_grid_.size() + m.llm_grid_.size();
  }
  return m;
}

std::vector<v1::WorkerRole> Membership::roles() const {
  std::vector<v1::WorkerRole> roles;
  for (const auto& [role, slots] : slots_) roles.push_back(role);
  return roles;
}

std::vector<v1::RankCoordinates> Membership::RanksOfSlot(v1::WorkerRole role, int64_t slot) const {
  std::vector<v1::RankCoordinates> ranks;
  if (role == v1::WORKER_ROLE_ENCODER || role == v1::WORKER_ROLE_COLOCATED) {
    ranks.push_back(CoordinatesOf(v1::MODULE_ENCODER, encoder_grid_, slot));
  }
  if (role == v1::WORKER_ROLE_LLM || role == v1::WORKER_ROLE_COLOCATED) {
    ranks.push_back(CoordinatesOf(v1::MODULE_LLM, llm_grid_, slot));
  }
  return ranks;
}

absl::StatusOr<WorkerRecord*> Membership::Admit(const v1::RegisterRequest& request,
                                                int64_t generation, absl::Time now) {
  auto it = slots_.find(request.role());
  if (it == slots_.end()) {
    std::vector<std::string> names;
    for (const auto& [role, slots] : slots_) names.push_back(RoleName(role));
    return absl::InvalidArgumentError(
        absl::StrCat("role ", RoleName(request.role()), " has no ranks in this run (placement ",
                     placement_ == v1::PLACEMENT_COLOCATED ? "colocated" : "non_colocated",
                     "); expected role ", absl::StrJoin(names, " or ")));
  }
  std::vector<WorkerRecord*>& slots = it->second;
  int64_t slot = -1;
  if (request.has_requested_rank()) {
    const int64_t wanted = request.requested_rank();
    if (wanted < 0 || wanted >= static_cast<int64_t>(slots.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("requested_rank=", wanted, " is out of range for role ",
                       RoleName(request.role()), ": expected 0..", slots.size() - 1));
    }
    if (Retired(request.role(), wanted) && !Open(request.role(), wanted)) {
      const std::vector<v1::RankCoordinates> ranks = RanksOfSlot(request.role(), wanted);
      const bool encoder = ranks.back().module() == v1::MODULE_ENCODER;
      return absl::FailedPreconditionError(absl::StrCat(
          RoleName(request.role()), " rank ", wanted, " belongs to ",
          ModuleName(ranks.back().module()), " replica ", ranks.back().dp(),
          encoder ? ", which is not in the encoder pool and admits no worker now (grow the pool "
                    "with `hetpar scale --encoders N`)"
                  : ", which is out of the run and admits no worker now"));
    }
    if (slots[wanted] != nullptr) {
      // ALREADY_EXISTS, not RESOURCE_EXHAUSTED: the rank frees once its holder is found gone
      // (a restarted worker may register before its lost self's session end is seen), and the
      // worker tries again until its --connect-timeout.
      return absl::AlreadyExistsError(absl::StrCat(RoleName(request.role()), " rank ", wanted,
                                                   " is already held by worker ",
                                                   slots[wanted]->worker_id));
    }
    slot = wanted;
  } else {
    bool retired = false;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (Retired(request.role(), static_cast<int64_t>(i))) {
        retired = retired || slots[i] == nullptr;
        continue;
      }
      if (slots[i] == nullptr) {
        slot = static_cast<int64_t>(i);
        break;
      }
    }
    // Then a rank of an open replica: the worker joins the run at a step boundary.
    for (size_t i = 0; slot < 0 && i < slots.size(); ++i) {
      if (slots[i] == nullptr && Open(request.role(), static_cast<int64_t>(i))) {
        slot = static_cast<int64_t>(i);
      }
    }
    if (slot < 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "every ", RoleName(request.role()), " rank is taken (", slots.size(),
          retired ? " ranks: the others are alive, and those of replicas out of the run admit "
                    "no one now; `hetpar scale --encoders N` opens encoder replicas)"
                  : " ranks, all registered and alive)"));
    }
  }
  const char* prefix = request.role() == v1::WORKER_ROLE_ENCODER ? "enc"
                       : request.role() == v1::WORKER_ROLE_LLM   ? "llm"
                                                                 : "col";
  const std::string worker_id = absl::StrCat(prefix, slot, "-", ++next_serial_);
  auto record = std::make_unique<WorkerRecord>();
  record->worker_id = worker_id;
  record->role = request.role();
  record->slot = slot;
  record->world_rank = request.role() == v1::WORKER_ROLE_LLM ? encoder_grid_.size() + slot : slot;
  record->ranks = RanksOfSlot(request.role(), slot);
  record->host = request.host();
  record->data_address = request.data_address();
  record->capabilities.assign(request.capabilities().begin(), request.capabilities().end());
  record->generation = generation;
  record->registered_at = now;
  record->last_heartbeat = now;
  record->joining = Retired(request.role(), slot);
  WorkerRecord* raw = record.get();
  slots[slot] = raw;
  by_id_[worker_id] = raw;
  workers_.push_back(std::move(record));
  return raw;
}

WorkerRecord* Membership::Find(const std::string& worker_id) {
  auto it = by_id_.find(worker_id);
  return it == by_id_.end() ? nullptr : it->second;
}

const WorkerRecord* Membership::Find(const std::string& worker_id) const {
  auto it = by_id_.find(worker_id);
  return it == by_id_.end() ? nullptr : it->second;
}

void Membership::MarkDead(const std::string& worker_id, const std::string& reason) {
  WorkerRecord* worker = Find(worker_id);
  if (worker == nullptr || !worker->alive) return;
  worker->alive = false;
  worker->session_open = false;
  worker->dead_reason = reason;
  auto& slots = slots_[worker->role];
  if (worker->slot >= 0 && worker->slot < static_cast<int64_t>(slots.size()) &&
      slots[worker->slot] == worker) {
    slots[worker->slot] = nullptr;
  }
}

void Membership::RetireReplica(v1::Module module, int64_t dp) {
  std::vector<bool>& retired =
      module == v1::MODULE_ENCODER ? retired_encoder_replicas_ : retired_llm_replicas_;
  if (dp < 0 || dp >= static_cast<int64_t>(retired.size())) return;
  retired[dp] = true;
  (module == v1::MODULE_ENCODER ? open_encoder_replicas_ : open_llm_replicas_)[dp] = false;
}

std::vector<int64_t> Membership::Replicas(v1::Module module) const {
  const std::vector<bool>& retired =
      module == v1::MODULE_ENCODER ? retired_encoder_replicas_ : retired_llm_replicas_;
  const int64_t dp = module == v1::MODULE_ENCODER ? encoder_grid_.dp : llm_grid_.dp;
  std::vector<int64_t> replicas;
  for (int64_t d = 0; d < dp; ++d) {
    if (d >= static_cast<int64_t>(retired.size()) || !retired[d]) replicas.push_back(d);
  }
  return replicas;
}

int64_t Membership::ReplicaOf(const WorkerRecord& worker, v1::Module module) {
  for (const v1::RankCoordinates& rank : worker.ranks) {
    if (rank.module() == module) return rank.dp();
  }
  return -1;
}

void Membership::SetOpen(v1::Module module, int64_t dp, bool open) {
  std::vector<bool>& flags =
      module == v1::MODULE_ENCODER ? open_encoder_replicas_ : open_llm_replicas_;
  const std::vector<bool>& retired =
      module == v1::MODULE_ENCODER ? retired_encoder_replicas_ : retired_llm_replicas_;
  if (dp < 0 || dp >= static_cast<int64_t>(flags.size())) return;
  flags[dp] = open && retired[dp];
}

std::vector<int64_t> Membership::OpenReplicas(v1::Module module) const {
  const std::vector<bool>& flags =
      module == v1::MODULE_ENCODER ? open_encoder_replicas_ : open_llm_replicas_;
  std::vector<int64_t> open;
  for (size_t d = 0; d < flags.size(); ++d) {
    if (flags[d]) open.push_back(static_cast<int64_t>(d));
  }
  return open;
}

std::vector<int64_t> Membership::SlotsOfReplica(v1::Module module, int64_t dp) const {
  const GridShape& grid = module == v1::MODULE_ENCODER ? encoder_grid_ : llm_grid_;
  std::vector<int64_t> slots;
  for (int64_t slot = 0; slot < grid.size(); ++slot) {
    if (CoordinatesOf(module, grid, slot).dp() == dp) slots.push_back(slot);
  }
  return slots;
}

bool Membership::ReplicaComplete(v1::Module module, int64_t dp) const {
  auto it =
      slots_.find(module == v1::MODULE_ENCODER ? v1::WORKER_ROLE_ENCODER : v1::WORKER_ROLE_LLM);
  if (it == slots_.end()) return false;
  for (int64_t slot : SlotsOfReplica(module, dp)) {
    if (it->second[slot] == nullptr) return false;
  }
  return true;
}

bool Membership::ReadyToJoin(v1::Module module, int64_t dp) const {
  const std::vector<int64_t> open = OpenReplicas(module);
  if (std::find(open.begin(), open.end(), dp) == open.end()) return false;
  auto it =
      slots_.find(module == v1::MODULE_ENCODER ? v1::WORKER_ROLE_ENCODER : v1::WORKER_ROLE_LLM);
  if (it == slots_.end()) return false;
  for (int64_t slot : SlotsOfReplica(module, dp)) {
    const WorkerRecord* worker = it->second[slot];
    if (worker == nullptr || !worker->joining || !worker->session_open) return false;
  }
  return true;
}

std::vector<WorkerRecord*> Membership::Activate(v1::Module module, int64_t dp) {
  std::vector<WorkerRecord*> joined;
  std::vector<bool>& flags =
      module == v1::MODULE_ENCODER ? open_encoder_replicas_ : open_llm_replicas_;
  std::vector<bool>& retired =
      module == v1::MODULE_ENCODER ? retired_encoder_replicas_ : retired_llm_replicas_;
  if (dp < 0 || dp >= static_cast<int64_t>(flags.size())) return joined;
  retired[dp] = false;
  flags[dp] = false;
  auto it =
      slots_.find(module == v1::MODULE_ENCODER ? v1::WORKER_ROLE_ENCODER : v1::WORKER_ROLE_LLM);
  if (it == slots_.end()) return joined;
  for (int64_t slot : SlotsOfReplica(module, dp)) {
    WorkerRecord* worker = it->second[slot];
    if (worker == nullptr) continue;
    worker->joining = false;
    joined.push_back(worker);
  }
  return joined;
}

int64_t Membership::joining_workers() const {
  int64_t n = 0;
  for (const WorkerRecord* worker : LiveWorkers()) n += worker->joining ? 1 : 0;
  return n;
}

bool Membership::Open(v1::WorkerRole role, int64_t slot) const {
  if (role == v1::WORKER_ROLE_ENCODER) {
    const int64_t dp = CoordinatesOf(v1::MODULE_ENCODER, encoder_grid_, slot).dp();
    return dp < static_cast<int64_t>(open_encoder_replicas_.size()) && open_encoder_replicas_[dp];
  }
  if (role == v1::WORKER_ROLE_LLM) {
    const int64_t dp = CoordinatesOf(v1::MODULE_LLM, llm_grid_, slot).dp();
    return dp < static_cast<int64_t>(open_llm_replicas_.size()) && open_llm_replicas_[dp];
  }
  return false;
}

bool Membership::Retired(v1::WorkerRole role, int64_t slot) const {
  if (role == v1::WORKER_ROLE_ENCODER) {
    const int64_t dp = CoordinatesOf(v1::MODULE_ENCODER, encoder_grid_, slot).dp();
    return dp < static_cast<int64_t>(retired_encoder_replicas_.size()) &&
           retired_encoder_replicas_[dp];
  }
  if (role == v1::WORKER_ROLE_LLM) {
    const int64_t dp = CoordinatesOf(v1::MODULE_LLM, llm_grid_, slot).dp();
    return dp < static_cast<int64_t>(retired_llm_replicas_.size()) && retired_llm_replicas_[dp];
  }
  return false;
}

bool Membership::Complete() const {
  for (const auto& [role, slots] : slots_) {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] == nullptr && !Retired(role, static_cast<int64_t>(i))) return false;
    }
  }
  return true;
}

int64_t Membership::alive_workers() const {
  int64_t n = 0;
  for (const auto& [role, slots] : slots_) {
    for (const WorkerRecord* worker : slots) n += worker == nullptr ? 0 : 1;
  }
  return n;
}

std::vector<std::string> Membership::Missing() const {
  std::vector<std::string> missing;
  for (const auto& [role, slots] : slots_) {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] != nullptr || Retired(role, static_cast<int64_t>(i))) continue;
      std::vector<std::string> rank_text;
      for (const auto& rank : RanksOfSlot(role, static_cast<int64_t>(i))) {
        rank_text.push_back(DescribeRank(rank));
      }
      std::string line = absl::StrJoin(rank_text, " + ");
      if (role == v1::WORKER_ROLE_COLOCATED) line = "colocated " + line;
      missing.push_back(std::move(line));
    }
  }
  return missing;
}

v1::PeerInfo Membership::PeerInfoOf(const WorkerRecord& worker) const {
  v1::PeerInfo peer;
  peer.set_worker_id(worker.worker_id);
  peer.set_role(worker.role);
  for (const auto& rank : worker.ranks) *peer.add_ranks() = rank;
  peer.set_host(worker.host);
  peer.set_data_address(worker.data_address);
  peer.set_world_rank(worker.world_rank);
  return peer;
}

std::vector<const WorkerRecord*> Membership::PeersOf(const WorkerRecord& worker) const {
  std::vector<const WorkerRecord*> peers;
  auto add_role = [&](v1::WorkerRole role, bool first_stage_only) {
    auto it = slots_.find(role);
    if (it == slots_.end()) return;
    for (const WorkerRecord* peer : it->second) {
      if (peer == nullptr || peer == &worker) continue;
      if (first_stage_only && peer->ranks.back().pp() != 0) continue;
      peers.push_back(peer);
    }
  };
  switch (worker.role) {
    case v1::WORKER_ROLE_ENCODER:
      add_role(v1::WORKER_ROLE_LLM, /*first_stage_only=*/true);
      break;
    case v1::WORKER_ROLE_LLM: {
      const v1::RankCoordinates& self = worker.ranks.back();
      if (self.pp() == 0) add_role(v1::WORKER_ROLE_ENCODER, false);
      // Pipeline neighbours: the same (dp, cp, tp) one stage before and after.
      auto it = slots_.find(v1::WORKER_ROLE_LLM);
      if (it == slots_.end()) break;
      for (const WorkerRecord* peer : it->second) {
        if (peer == nullptr || peer == &worker) continue;
        const v1::RankCoordinates& other = peer->ranks.back();
        if (other.dp() == self.dp() && other.cp() == self.cp() && other.tp() == self.tp() &&
            (other.pp() == self.pp() - 1 || other.pp() == self.pp() + 1)) {
          peers.push_back(peer);
        }
      }
      break;
    }
    case v1::WORKER_ROLE_COLOCATED:
      add_role(v1::WORKER_ROLE_COLOCATED, false);
      break;
    case v1::WORKER_ROLE_UNSPECIFIED:
    case v1::WorkerRole_INT_MIN_SENTINEL_DO_NOT_USE_:
    case v1::WorkerRole_INT_MAX_SENTINEL_DO_NOT_USE_:
      break;
  }
  return peers;
}

std::vector<WorkerRecord*> Membership::TrainingWorkers() const {
  std::vector<WorkerRecord*> training = LiveWorkers();
  // Joining workers, and those of an encoder replica that left the pool (closing their session).
  training.erase(std::remove_if(training.begin(), training.end(),
                                [this](const WorkerRecord* w) {
                                  return w->joining || Retired(w->role, w->slot);
                                }),
                 training.end());
  return training;
}

std::vector<WorkerRecord*> Membership::LiveWorkers() const {
  std::vector<WorkerRecord*> live;
  live.reserve(expected_workers_);
  for (const auto& [role, slots] : slots_) {
    for (WorkerRecord* worker : slots) {
      if (worker != nullptr) live.push_back(worker);
    }
  }
  return live;
}

}  // namespace hetpar::coordinator
