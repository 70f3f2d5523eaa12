#include "common/train/checkpoint.h"

#include <ATen/ATen.h>
#include <stdlib.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_pin.h"
#include "common/nn/export.h"
#include "common/nn/test_ranks.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::train {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  int split_dim;
};

constexpr char kFrozen[] = "f.frozen";

// Parameters split on each dim of 1-, 2- and 3-D tensors, replicated ones and a frozen one;
// every split size divides by 1, 2 and 4.
std::vector<Spec> Specs() {
  return {{"a.weight", {8, 6}, 0}, {"b.weight", {6, 8}, 1},   {"c.norm", {6}, -1},
          {"d.bias", {8}, 0},      {"e.table", {4, 2, 8}, 2}, {kFrozen, {4, 4}, 0}};
}

std::vector<Spec> Pick(const std::vector<std::string>& names) {
  std::vector<Spec> picked;
  for (const Spec& s : Specs()) {
    if (std::find(names.begin(), names.end(), s.name) != names.end()) picked.push_back(s);
  }
  return picked;
}

hetpar::v1::Optimizer Adam() {
  hetpar::v1::Optimizer o;
  o.set_lr(0.05);
  o.set_weight_decay(0.1);
  o.set_beta1(0.9);
  o.set_beta2(0.999);
  o.set_eps(1e-8);
  return o;
}

// A module's parameters (TP rank `rank` of `size`, float64, initialised from `seed`) and their
// optimizer. Sets of different seeds start from different values, so a loaded value can only
// come from the checkpoint.
struct Trainee {
  std::vector<Spec> specs;
  std::unique_ptr<nn::ParameterSet> set;
  std::unique_ptr<ModuleOptimizer> opt;
};

Trainee MakeTrainee(const std::vector<Spec>& specs, int rank, int size, int64_t seed) {
  Trainee t;
  t.specs = specs;
  t.set =
      std::make_unique<nn::ParameterSet>(seed, at::kDouble, rank, size, nn::InitStyle::kAllRandom);
  for (const Spec& s : specs) {
    auto added = t.set->Add(s.name, s.shape, s.split_dim, nn::InitRule::Normal(0.5));
    EXPECT_TRUE(added.ok()) << added.status();
  }
  t.set->Freeze(kFrozen);
  auto opt = ModuleOptimizer::Create(t.set.get(), Adam());
  EXPECT_TRUE(opt.ok()) << opt.status();
  t.opt = *std::move(opt);
  return t;
}

at::Tensor SliceOf(const at::Tensor& full, const nn::NamedParameter& p) {
  return p.slice.split_dim < 0 ? full
                               : full.narrow(p.slice.split_dim, p.slice.offset, p.slice.length);
}

// The full gradient of a parameter at `step`: the same whatever the layout.
at::Tensor FullGrad(const Spec& spec, int step) {
  int64_t n = 1;
  for (int64_t d : spec.shape) n *= d;
  return at::arange(n, at::kDouble)
      .mul(0.37)
      .add(step * 0.11 + static_cast<double>(spec.name.size()) * 0.05)
      .sin()
      .reshape(spec.shape);
}

// One optimizer step of `t` with this rank's slices of the full gradients of `step`.
absl::Status TrainStep(Trainee& t, int step) {
  for (const Spec& s : t.specs) {
    const nn::NamedParameter* p = t.set->Find(s.name);
    if (p->trainable) p->tensor.mutable_grad() = SliceOf(FullGrad(s, step), *p).clone();
  }
  return t.opt->Step(step, 1.0);
}

// Exact equality of every element (bit for bit), with the first mismatch reported.
void ExpectIdentical(const at::Tensor& actual, const at::Tensor& expected,
                     const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  const at::Tensor a = actual.detach().contiguous().view(-1);
  const at::Tensor e = expected.detach().contiguous().view(-1);
  if (std::memcmp(a.data_ptr(), e.data_ptr(), a.numel() * a.element_size()) == 0) return;
  for (int64_t i = 0; i < a.numel(); ++i) {
    ASSERT_EQ(a[i].item<double>(), e[i].item<double>()) << what << ": mismatch at index " << i;
  }
}

// A module's full parameters and moments, joined from the slices of the trainees of one TP
// group (in rank order, which is offset order).
struct FullState {
  std::map<std::string, at::Tensor> value;
  std::map<std::string, at::Tensor> exp_avg;  // absent without state
  std::map<std::string, at::Tensor> exp_avg_sq;
  std::map<std::string, int64_t> step;
};

FullState Join(const std::vector<Trainee>& group) {
  FullState full;
  for (const Spec& s : group.front().specs) {
    const nn::NamedParameter& p0 = *group.front().set->Find(s.name);
    const auto join = [&](const std::function<at::Tensor(const Trainee&)>& part) {
      if (p0.slice.split_dim < 0) return part(group.front()).clone();
      std::vector<at::Tensor> parts;
      for (const Trainee& t : group) parts.push_back(part(t));
      return at::cat(parts, p0.slice.split_dim);
    };
    full.value[s.name] =
        join([&](const Trainee& t) { return t.set->Find(s.name)->tensor.detach(); });
    if (!group.front().opt->StateOf(s.name).has_value()) continue;
    full.exp_avg[s.name] = join([&](const Trainee& t) { return t.opt->StateOf(s.name)->exp_avg; });
    full.exp_avg_sq[s.name] =
        join([&](const Trainee& t) { return t.opt->StateOf(s.name)->exp_avg_sq; });
    full.step[s.name] = group.front().opt->StateOf(s.name)->step;
  }
  return full;
}

// Every parameter of `t` and its AdamW state are this rank's slices of `full`.
void ExpectHolds(const Trainee& t, const FullState& full, const std::string& what) {
  for (const Spec& s : t.specs) {
    SCOPED_TRACE(absl::StrCat(what, ", ", s.name));
    const nn::NamedParameter& p = *t.set->Find(s.name);
    ExpectIdentical(p.tensor, SliceOf(full.value.at(s.name), p), "value");
    std::optional<ModuleOptimizer::ParamState> state = t.opt->StateOf(s.name);
    if (full.exp_avg.count(s.name) == 0) {
      EXPECT_FALSE(state.has_value());
      continue;
    }
    ASSERT_TRUE(state.has_value());
    EXPECT_EQ(state->step, full.step.at(s.name));
    ExpectIdentical(state->exp_avg, SliceOf(full.exp_avg.at(s.name), p), "exp_avg");
    ExpectIdentical(state->exp_avg_sq, SliceOf(full.exp_avg_sq.at(s.name), p), "exp_avg_sq");
  }
}

uint32_t FileCrc(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return static_cast<uint32_t>(
      crc32_z(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));
}

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Where one entry of a .hpar file lies.
struct EntryBytes {
  int64_t offset = 0;  // its first byte (the name length)
  int64_t bytes = 0;   // through its trailing CRC-32
  int64_t data_offset = 0;
  int64_t data_bytes = 0;
};

// Every entry of the .hpar file `path` by name, found by walking the layout common/nn/export.h
// gives (a 32-byte header; per entry u32 name length, the name, u8 dtype, u8 dims, u16, i64 per
// dim, u64 data bytes, the data, u32 CRC-32), not with the code under test.
std::map<std::string, EntryBytes> EntriesOf(const std::string& path) {
  const std::string file = ReadBytes(path);
  const auto get = [&](int64_t at, auto value) {
    std::memcpy(&value, file.data() + at, sizeof(value));
    return value;
  };
  std::map<std::string, EntryBytes> entries;
  const uint64_t count = get(16, uint64_t{0});
  int64_t at = 32;
  for (uint64_t i = 0; i < count; ++i) {
    EntryBytes e;
    e.offset = at;
    const uint32_t name_bytes = get(at, uint32_t{0});
    const std::string name = file.substr(at + 4, name_bytes);
    at += 4 + name_bytes;
    const uint8_t dims = static_cast<uint8_t>(file[at + 1]);
    at += 4 + 8 * dims;
    e.data_bytes = static_cast<int64_t>(get(at, uint64_t{0}));
    e.data_offset = at + 8;
    at = e.data_offset + e.data_bytes + 4;
    e.bytes = at - e.offset;
    entries[name] = e;
  }
  EXPECT_EQ(at, static_cast<int64_t>(file.size())) << path;
  return entries;
}

void FlipByte(const std::string& path, int64_t offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(offset);
  char byte = 0;
  file.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x10);
  file.seekp(offset);
  file.write(&byte, 1);
}

// The CRC-32 an entry stores and the one of its bytes as they are now.
struct EntryCrcs {
  uint32_t stored = 0;
  uint32_t computed = 0;
};

EntryCrcs CrcsOf(const std::string& path, const EntryBytes& e) {
  const std::string file = ReadBytes(path);
  EntryCrcs crcs;
  std::memcpy(&crcs.stored, file.data() + e.offset + e.bytes - 4, 4);
  crcs.computed = static_cast<uint32_t>(crc32_z(
      0, reinterpret_cast<const Bytef*>(file.data() + e.offset), static_cast<size_t>(e.bytes - 4)));
  return crcs;
}

// The sidecar's block size for the CRC-32s of entry data.
constexpr int64_t kBlockBytes = int64_t{1} << 20;

// The CRC-32 of each kBlockBytes block of an entry's data as the file holds it now.
std::vector<uint32_t> BlockCrcsOf(const std::string& path, const EntryBytes& e) {
  const std::string file = ReadBytes(path);
  std::vector<uint32_t> crcs;
  for (int64_t begin = 0; begin < e.data_bytes; begin += kBlockBytes) {
    const int64_t bytes = std::min(kBlockBytes, e.data_bytes - begin);
    crcs.push_back(static_cast<uint32_t>(
        crc32_z(0, reinterpret_cast<const Bytef*>(file.data() + e.data_offset + begin),
                static_cast<size_t>(bytes))));
  }
  return crcs;
}

// Parameters whose entries span several blocks: float64 [512, 1024] split along dim 0 (4 MiB,
// 512 rows of 8 KiB: each TP 2 half is two whole blocks) and float64 [2, 262144] split along
// dim 1 (4 MiB, two rows of 2 MiB: a TP 2 rank needs half of each row, 1 MiB apart).
std::vector<Spec> BigSpecs() {
  return {{"big.rows", {512, 1024}, 0}, {"big.cols", {2, 262144}, 1}};
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_checkpoint_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes every trainee's shard (same order as `ids`) and completes the checkpoint.
  void Save(const std::string& dir, const std::vector<ShardId>& ids,
            const std::vector<const Trainee*>& writers, int64_t step) {
    for (size_t i = 0; i < ids.size(); ++i) {
      absl::Status written = WriteShard(dir, ids[i], step, *writers[i]->set, writers[i]->opt.get());
      ASSERT_TRUE(written.ok()) << written;
    }
    absl::StatusOr<bool> complete = CompleteIfAllWritten(dir, ids, step, json::object());
    ASSERT_TRUE(complete.ok()) << complete.status();
    ASSERT_TRUE(*complete);
  }

  std::string dir_;
};

TEST_F(CheckpointTest, SavedAtTp2LoadsAtTp1And4AndStepsOnAlike) {
  const std::string dir = absl::StrCat(dir_, "/", CheckpointDirName(2));
  EXPECT_EQ(CheckpointDirName(2), "step-000002");
  std::vector<Trainee> tp2;
  for (int rank = 0; rank < 2; ++rank) tp2.push_back(MakeTrainee(Specs(), rank, 2, 5));
  const std::vector<ShardId> writers = {{"llm", 0, 2, 0, 1}, {"llm", 1, 2, 0, 1}};
  std::atomic<int> completed{0};
  absl::Status status = nn::testing::RunRanks(2, [&](int rank, nn::Communicator&) -> absl::Status {
    for (int step = 0; step < 2; ++step) HETPAR_RETURN_IF_ERROR(TrainStep(tp2[rank], step));
    HETPAR_RETURN_IF_ERROR(WriteShard(dir, writers[rank], 2, *tp2[rank].set, tp2[rank].opt.get()));
    HETPAR_ASSIGN_OR_RETURN(bool complete,
                            CompleteIfAllWritten(dir, writers, 2, json{{"data_position", 123}}));
    if (complete) completed.fetch_add(1);
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_GE(completed.load(), 1);  // whichever finished last saw both sidecars
  absl::StatusOr<CheckpointInfo> info = ReadCheckpointInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step, 2);
  EXPECT_EQ(info->extra, json({{"data_position", 123}}));

  const FullState saved = Join(tp2);
  ASSERT_EQ(saved.exp_avg.size(), Specs().size() - 1);  // every parameter but the frozen one
  std::vector<std::vector<Trainee>> loaded;
  for (int tp : {1, 4}) {
    loaded.emplace_back();
    for (int rank = 0; rank < tp; ++rank) {
      Trainee t = MakeTrainee(Specs(), rank, tp, 6);
      ASSERT_FALSE(at::equal(t.set->Find(kFrozen)->tensor,
                             SliceOf(saved.value.at(kFrozen), *t.set->Find(kFrozen))));
      absl::Status load = LoadModuleState(dir, "llm", *t.set, t.opt.get());
      ASSERT_TRUE(load.ok()) << load;
      ExpectHolds(t, saved, absl::StrCat("tp=", tp, " rank ", rank));
      loaded.back().push_back(std::move(t));
    }
  }

  // The next step, with the same full gradient, moves every layout's slices alike.
  for (Trainee& t : tp2) ASSERT_TRUE(TrainStep(t, 2).ok());
  for (auto& group : loaded) {
    for (Trainee& t : group) ASSERT_TRUE(TrainStep(t, 2).ok());
  }
  const FullState next = Join(tp2);
  EXPECT_FALSE(at::equal(next.value.at("a.weight"), saved.value.at("a.weight")));
  for (size_t g = 0; g < loaded.size(); ++g) {
    for (size_t rank = 0; rank < loaded[g].size(); ++rank) {
      ExpectHolds(loaded[g][rank], next,
                  absl::StrCat("after a step, tp=", loaded[g].size(), " rank ", rank));
    }
  }
}

TEST_F(CheckpointTest, PipelineStagesLoadIntoTheWholeModelAndBack) {
  // Two LLM stages and an encoder whose parameter has the name of an LLM one: loading a module
  // takes its own shards only.
  const std::vector<Spec> stage0_specs = Pick({"a.weight", "b.weight", kFrozen});
  const std::vector<Spec> stage1_specs = Pick({"c.norm", "d.bias", "e.table"});
  const std::vector<Spec> encoder_specs = Pick({"a.weight"});
  Trainee stage0 = MakeTrainee(stage0_specs, 0, 1, 5);
  Trainee stage1 = MakeTrainee(stage1_specs, 0, 1, 5);
  Trainee encoder = MakeTrainee(encoder_specs, 0, 1, 9);
  ASSERT_TRUE(TrainStep(stage0, 0).ok());
  ASSERT_TRUE(TrainStep(stage1, 0).ok());
  ASSERT_TRUE(TrainStep(encoder, 0).ok());
  const std::string staged = dir_ + "/staged";
  Save(staged, {{"llm", 0, 1, 0, 2}, {"llm", 0, 1, 1, 2}, {"encoder", 0, 1, 0, 1}},
       {&stage0, &stage1, &encoder}, 1);

  Trainee whole = MakeTrainee(Specs(), 0, 1, 6);
  absl::Status status = LoadModuleState(staged, "llm", *whole.set, whole.opt.get());
  ASSERT_TRUE(status.ok()) << status;
  FullState stages;  // both stages' parameters
  {
    std::vector<Trainee> g0;
    g0.push_back(std::move(stage0));
    std::vector<Trainee> g1;
    g1.push_back(std::move(stage1));
    const FullState f0 = Join(g0);
    const FullState f1 = Join(g1);
    for (const FullState* f : {&f0, &f1}) {
      stages.value.insert(f->value.begin(), f->value.end());
      stages.exp_avg.insert(f->exp_avg.begin(), f->exp_avg.end());
      stages.exp_avg_sq.insert(f->exp_avg_sq.begin(), f->exp_avg_sq.end());
      stages.step.insert(f->step.begin(), f->step.end());
    }
  }
  ExpectHolds(whole, stages, "whole model from two stages");

  Trainee encoder_loaded = MakeTrainee(encoder_specs, 0, 1, 6);
  status = LoadModuleState(staged, "encoder", *encoder_loaded.set, encoder_loaded.opt.get());
  ASSERT_TRUE(status.ok()) << status;
  std::vector<Trainee> encoders;
  encoders.push_back(std::move(encoder));
  ExpectHolds(encoder_loaded, Join(encoders), "encoder");

  // And back: the whole model, one step further, saved as one stage; the second of two stages,
  // at TP 2, loads its part.
  ASSERT_TRUE(TrainStep(whole, 1).ok());
  const std::string single = dir_ + "/single";
  Save(single, {{"llm", 0, 1, 0, 1}}, {&whole}, 2);
  std::vector<Trainee> wholes;
  wholes.push_back(std::move(whole));
  const FullState saved = Join(wholes);
  EXPECT_EQ(saved.step.at("d.bias"), 2);
  for (int rank = 0; rank < 2; ++rank) {
    Trainee part = MakeTrainee(stage1_specs, rank, 2, 7);
    status = LoadModuleState(single, "llm", *part.set, part.opt.get());
    ASSERT_TRUE(status.ok()) << status;
    ExpectHolds(part, saved, absl::StrCat("stage 1 at tp=2 rank ", rank));
  }
}

TEST_F(CheckpointTest, CompleteOnlyOnceEverySidecarIsWritten) {
  const std::string dir = dir_ + "/step-000005";
  const std::vector<ShardId> ids = {
      {"encoder", 0, 1, 0, 1}, {"llm", 0, 2, 0, 1}, {"llm", 1, 2, 0, 1}};
  std::vector<Trainee> trainees;
  trainees.push_back(MakeTrainee(Pick({"a.weight"}), 0, 1, 5));
  trainees.push_back(MakeTrainee(Specs(), 0, 2, 5));
  trainees.push_back(MakeTrainee(Specs(), 1, 2, 5));
  const json extra{{"data", {{"epoch", 1}, {"sample", 42}}}};
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(TrainStep(trainees[i], 0).ok());
    ASSERT_TRUE(WriteShard(dir, ids[i], 5, *trainees[i].set, trainees[i].opt.get()).ok());
    absl::StatusOr<bool> complete = CompleteIfAllWritten(dir, ids, 5, extra);
    ASSERT_TRUE(complete.ok()) << complete.status();
    EXPECT_EQ(*complete, i + 1 == ids.size()) << "after " << i + 1 << " shards";
    EXPECT_EQ(fs::exists(dir + "/manifest.json"), i + 1 == ids.size());
    if (i + 1 < ids.size()) {
      absl::StatusOr<CheckpointInfo> info = ReadCheckpointInfo(dir);
      EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
      EXPECT_THAT(info.status().message(), HasSubstr(dir));
    }
  }
  EXPECT_EQ(ShardName(ids[2]), "llm-pp0-tp1");

  const json manifest = ReadJson(dir + "/manifest.json");
  EXPECT_EQ(manifest["format"], 1);
  EXPECT_EQ(manifest["step"], 5);
  EXPECT_EQ(manifest["extra"], extra);
  ASSERT_EQ(manifest["shards"].size(), 3u);
  for (size_t i = 0; i < ids.size(); ++i) {
    const json& shard = manifest["shards"][i];
    const std::string file = ShardName(ids[i]) + ".hpar";
    EXPECT_EQ(shard["name"], ShardName(ids[i]));
    EXPECT_EQ(shard["file"], file);
    EXPECT_EQ(shard["bytes"], fs::file_size(dir + "/" + file));
    EXPECT_EQ(shard["crc32"], FileCrc(dir + "/" + file));
  }
  absl::StatusOr<CheckpointInfo> info = ReadCheckpointInfo(dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step, 5);
  EXPECT_EQ(info->extra, extra);

  // The sidecar of TP rank 1 describes its slices, and its moments where it has them.
  const json sidecar = ReadJson(dir + "/llm-pp0-tp1.json");
  EXPECT_EQ(sidecar["format"], 1);
  EXPECT_EQ(sidecar["module"], "llm");
  EXPECT_EQ(sidecar["step"], 5);
  EXPECT_EQ(sidecar["tp"], 1);
  EXPECT_EQ(sidecar["tp_size"], 2);
  EXPECT_EQ(sidecar["pp"], 0);
  EXPECT_EQ(sidecar["pp_size"], 1);
  EXPECT_EQ(sidecar["file"], "llm-pp0-tp1.hpar");
  EXPECT_EQ(sidecar["bytes"], manifest["shards"][2]["bytes"]);
  EXPECT_EQ(sidecar["crc32"], manifest["shards"][2]["crc32"]);
  const std::vector<Spec> specs = Specs();
  ASSERT_EQ(sidecar["params"].size(), specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    const json& p = sidecar["params"][i];
    SCOPED_TRACE(s.name);
    EXPECT_EQ(p["name"], s.name);
    EXPECT_EQ(p["full_shape"].get<std::vector<int64_t>>(), s.shape);
    EXPECT_EQ(p["split_dim"], s.split_dim);
    const int64_t length = s.split_dim < 0 ? 0 : s.shape[s.split_dim] / 2;
    EXPECT_EQ(p["offset"], length);  // rank 1's half starts where rank 0's ends
    EXPECT_EQ(p["length"], length);
    EXPECT_EQ(p.contains("adam_step"), s.name != kFrozen);
    if (s.name != kFrozen) {
      EXPECT_EQ(p["adam_step"], 1);
    }
    // Where each of its entries lies in the shard file, as the file's own layout says.
    const std::map<std::string, EntryBytes> layout = EntriesOf(dir + "/llm-pp0-tp1.hpar");
    const json& where = p["entries"];
    ASSERT_TRUE(where.is_object()) << p.dump();
    std::vector<std::pair<std::string, std::string>> kinds = {{"value", ""}};
    if (s.name != kFrozen) {
      kinds.push_back({"exp_avg", "@exp_avg"});
      kinds.push_back({"exp_avg_sq", "@exp_avg_sq"});
    }
    EXPECT_EQ(where.size(), kinds.size()) << where.dump();
    for (const auto& [kind, suffix] : kinds) {
      SCOPED_TRACE(kind);
      const EntryBytes& e = layout.at(s.name + suffix);
      const json& range = where[kind];
      EXPECT_EQ(range["offset"], e.offset);
      EXPECT_EQ(range["bytes"], e.bytes);
      // And the CRC-32 of its data (small: one block, shorter than block_bytes).
      EXPECT_EQ(range["data_offset"], e.data_offset);
      EXPECT_EQ(range["dtype"], "float64");
      EXPECT_EQ(range["block_bytes"], kBlockBytes);
      EXPECT_EQ(range["block_crc32"].get<std::vector<uint32_t>>(),
                BlockCrcsOf(dir + "/llm-pp0-tp1.hpar", e));
      EXPECT_EQ(range.size(), 6u) << range.dump();
    }
  }
  auto entries = nn::ReadFullParameters(dir + "/llm-pp0-tp1.hpar");
  ASSERT_TRUE(entries.ok()) << entries.status();
  std::set<std::string> names;
  for (const auto& e : *entries) names.insert(e.name);
  EXPECT_EQ(names.count("a.weight@exp_avg"), 1u);
  EXPECT_EQ(names.count("a.weight@exp_avg_sq"), 1u);
  EXPECT_EQ(names.count(std::string(kFrozen) + "@exp_avg"), 0u);
  EXPECT_EQ(entries->size(), 3 * specs.size() - 2);

  // A writer of another step finds sidecars that are not its own.
  absl::StatusOr<bool> other = CompleteIfAllWritten(dir, ids, 6, extra);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.status().message(), HasSubstr("encoder-pp0-tp0.json"));
  // Bad arguments.
  EXPECT_EQ(CompleteIfAllWritten(dir, {}, 5, extra).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CompleteIfAllWritten(dir, {ids[0], ids[0]}, 5, extra).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CompleteIfAllWritten(dir, ids, 5, json::array()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteShard(dir, {"llm", 1, 2, 0, 1}, 5, *trainees[1].set, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // the set is TP rank 0
}

// A step written again by another write (a run resumed from an earlier step trains it again
// into the same checkpoint.dir): the old manifest goes before the first new shard, and the old
// write's sidecars do not count for the new one. A crash part-way leaves the step incomplete,
// never complete with some shards of each write.
TEST_F(CheckpointTest, AStepWrittenAgainIsIncompleteUntilEveryShardOfTheNewWriteIsThere) {
  const std::string dir = dir_ + "/step-000004";
  const std::vector<ShardId> ids = {{"encoder", 0, 1, 0, 1}, {"llm", 0, 1, 0, 1}};
  std::vector<Trainee> trainees;
  trainees.push_back(MakeTrainee(Pick({"a.weight"}), 0, 1, 5));
  trainees.push_back(MakeTrainee(Specs(), 0, 1, 5));
  const auto write = [&](size_t i, uint64_t write_id) {
    absl::StatusOr<ShardSnapshot> snapshot =
        SnapshotShard(ids[i], 4, *trainees[i].set, trainees[i].opt.get());
    ASSERT_TRUE(snapshot.ok()) << snapshot.status();
    snapshot->write_id = write_id;
    const absl::Status written = WriteShardSnapshot(dir, *snapshot);
    ASSERT_TRUE(written.ok()) << written;
  };
  for (size_t i = 0; i < ids.size(); ++i) ASSERT_NO_FATAL_FAILURE(write(i, 11));
  ASSERT_TRUE(*CompleteIfAllWritten(dir, ids, 4, json::object(), 11));
  EXPECT_EQ(ReadJson(dir + "/manifest.json")["write_id"], 11);
  EXPECT_EQ(ReadJson(dir + "/encoder-pp0-tp0.json")["write_id"], 11);

  // Write 22 of the same step: its first shard takes the old manifest away.
  for (Trainee& t : trainees) ASSERT_TRUE(TrainStep(t, 0).ok());
  ASSERT_NO_FATAL_FAILURE(write(0, 22));
  EXPECT_FALSE(fs::exists(dir + "/manifest.json"));
  absl::StatusOr<bool> half = CompleteIfAllWritten(dir, ids, 4, json::object(), 22);
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_FALSE(*half) << "the llm sidecar is write 11's";
  EXPECT_EQ(ReadCheckpointInfo(dir).status().code(), absl::StatusCode::kNotFound);
  ASSERT_NO_FATAL_FAILURE(write(1, 22));
  absl::StatusOr<bool> whole = CompleteIfAllWritten(dir, ids, 4, json::object(), 22);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(*whole);
  EXPECT_EQ(ReadJson(dir + "/manifest.json")["write_id"], 22);
  // A writer of the same write finishing later keeps the manifest.
  ASSERT_NO_FATAL_FAILURE(write(1, 22));
  EXPECT_TRUE(fs::exists(dir + "/manifest.json"));
}

TEST_F(CheckpointTest, CorruptShardIsDataLossAndChangesNothing) {
  Trainee saved = MakeTrainee(Specs(), 0, 1, 5);
  ASSERT_TRUE(TrainStep(saved, 0).ok());
  Save(dir_, {{"llm", 0, 1, 0, 1}}, {&saved}, 1);
  const std::string shard = dir_ + "/llm-pp0-tp0.hpar";
  // A flipped byte in the tensor of an entry every loading rank with an optimizer reads.
  const EntryBytes e = EntriesOf(shard).at("a.weight@exp_avg");
  const EntryCrcs good = CrcsOf(shard, e);
  ASSERT_EQ(good.stored, good.computed);
  FlipByte(shard, e.data_offset + e.data_bytes / 2);
  const EntryCrcs bad = CrcsOf(shard, e);
  ASSERT_EQ(bad.stored, good.stored);
  ASSERT_NE(bad.computed, good.computed);

  Trainee t = MakeTrainee(Specs(), 0, 2, 6);
  const at::Tensor before = t.set->Find("a.weight")->tensor.detach().clone();
  const at::Tensor norm_before = t.set->Find("c.norm")->tensor.detach().clone();
  absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(shard));
  EXPECT_THAT(status.message(), HasSubstr("'a.weight@exp_avg'"));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("computed ", bad.computed)));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("stored ", good.stored)));
  EXPECT_THAT(status.message(), HasSubstr("the file is corrupt"));
  ExpectIdentical(t.set->Find("a.weight")->tensor, before, "a.weight after a failed load");
  ExpectIdentical(t.set->Find("c.norm")->tensor, norm_before, "c.norm after a failed load");
  for (const Spec& s : Specs()) EXPECT_FALSE(t.opt->StateOf(s.name).has_value()) << s.name;

  // Without an optimizer the moments are not read: the parameters load.
  status = LoadModuleState(dir_, "llm", *t.set, nullptr);
  ASSERT_TRUE(status.ok()) << status;
  std::vector<Trainee> group;
  group.push_back(std::move(saved));
  const FullState full = Join(group);
  for (const Spec& s : Specs()) {
    const nn::NamedParameter& p = *t.set->Find(s.name);
    ExpectIdentical(p.tensor, SliceOf(full.value.at(s.name), p), s.name);
  }
}

TEST_F(CheckpointTest, TruncatedOrMissingShardIsDataLoss) {
  Trainee saved = MakeTrainee(Specs(), 0, 1, 5);
  ASSERT_TRUE(TrainStep(saved, 0).ok());
  Save(dir_, {{"llm", 0, 1, 0, 1}}, {&saved}, 1);
  const std::string shard = dir_ + "/llm-pp0-tp0.hpar";
  const uintmax_t bytes = fs::file_size(shard);
  fs::resize_file(shard, bytes - 1);

  Trainee t = MakeTrainee(Specs(), 0, 1, 6);
  const at::Tensor before = t.set->Find("d.bias")->tensor.detach().clone();
  absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(shard));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat(bytes - 1, " bytes")));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("manifest says ", bytes)));
  ExpectIdentical(t.set->Find("d.bias")->tensor, before, "d.bias after a failed load");

  fs::remove(shard);
  status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(shard));
  EXPECT_THAT(status.message(), HasSubstr("missing"));
  ExpectIdentical(t.set->Find("d.bias")->tensor, before, "d.bias after a failed load");
}

TEST_F(CheckpointTest, ReadsOnlyTheEntriesOverlappingItsSlice) {
  std::vector<Trainee> tp2;
  for (int rank = 0; rank < 2; ++rank) {
    tp2.push_back(MakeTrainee(Specs(), rank, 2, 5));
    ASSERT_TRUE(TrainStep(tp2.back(), 0).ok());
  }
  Save(dir_, {{"llm", 0, 2, 0, 1}, {"llm", 1, 2, 0, 1}}, {&tp2[0], &tp2[1]}, 1);
  const FullState saved = Join(tp2);
  // A flipped byte in the tensor of every entry of the tp1 shard, and none in the tp0 shard.
  const std::string tp1_shard = dir_ + "/llm-pp0-tp1.hpar";
  const std::map<std::string, EntryBytes> tp1_entries = EntriesOf(tp1_shard);
  ASSERT_EQ(tp1_entries.size(), 3 * Specs().size() - 2);
  for (const auto& [name, e] : tp1_entries) {
    ASSERT_GT(e.data_bytes, 0) << name;
    FlipByte(tp1_shard, e.data_offset + e.data_bytes / 2);
    const EntryCrcs crcs = CrcsOf(tp1_shard, e);
    ASSERT_NE(crcs.stored, crcs.computed) << name;
  }

  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE(absl::StrCat("tp=4 rank ", rank));
    Trainee t = MakeTrainee(Specs(), rank, 4, 6);
    // Does every split slice of this rank lie inside the one the tp0 shard saved?
    bool inside_tp0 = true;
    for (const Spec& s : Specs()) {
      const nn::NamedParameter& p = *t.set->Find(s.name);
      const nn::NamedParameter& saved_tp0 = *tp2[0].set->Find(s.name);
      if (s.split_dim < 0) continue;
      ASSERT_EQ(p.slice.split_dim, s.split_dim);
      inside_tp0 =
          inside_tp0 && p.slice.offset >= saved_tp0.slice.offset &&
          p.slice.offset + p.slice.length <= saved_tp0.slice.offset + saved_tp0.slice.length;
    }
    EXPECT_EQ(inside_tp0, rank < 2);  // each tp0 half holds the quarters of ranks 0 and 1
    const at::Tensor before = t.set->Find("b.weight")->tensor.detach().clone();
    absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
    if (inside_tp0) {
      ASSERT_TRUE(status.ok()) << status;
      ExpectHolds(t, saved, "from the tp0 shard alone");
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
      EXPECT_THAT(status.message(), HasSubstr(tp1_shard));
      EXPECT_THAT(status.message(), HasSubstr("CRC-32"));
      ExpectIdentical(t.set->Find("b.weight")->tensor, before, "b.weight after a failed load");
      EXPECT_FALSE(t.opt->StateOf("b.weight").has_value());
    }
  }
}

TEST_F(CheckpointTest, AStageLoadsWhenTheOtherStagesShardIsDamaged) {
  const std::vector<Spec> stage0_specs = Pick({"a.weight", "b.weight", kFrozen});
  const std::vector<Spec> stage1_specs = Pick({"c.norm", "d.bias", "e.table"});
  std::vector<Trainee> stage0;
  stage0.push_back(MakeTrainee(stage0_specs, 0, 1, 5));
  Trainee stage1 = MakeTrainee(stage1_specs, 0, 1, 5);
  ASSERT_TRUE(TrainStep(stage0[0], 0).ok());
  ASSERT_TRUE(TrainStep(stage1, 0).ok());
  Save(dir_, {{"llm", 0, 1, 0, 2}, {"llm", 0, 1, 1, 2}}, {&stage0[0], &stage1}, 1);
  // Stage 1's shard: a flipped byte in its first entry and its last bytes cut off.
  const std::string pp1_shard = dir_ + "/llm-pp1-tp0.hpar";
  const EntryBytes first = EntriesOf(pp1_shard).at("c.norm");
  FlipByte(pp1_shard, first.data_offset);
  fs::resize_file(pp1_shard, fs::file_size(pp1_shard) - 3);

  // Stage 0 (at tp 2 too) needs none of it.
  for (int tp : {1, 2}) {
    for (int rank = 0; rank < tp; ++rank) {
      Trainee t = MakeTrainee(stage0_specs, rank, tp, 6);
      absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
      ASSERT_TRUE(status.ok()) << status;
      ExpectHolds(t, Join(stage0), absl::StrCat("stage 0 at tp=", tp, " rank ", rank));
    }
  }
  // Stage 1, or the whole model, does.
  for (const std::vector<Spec>& specs : {stage1_specs, Specs()}) {
    Trainee t = MakeTrainee(specs, 0, 1, 6);
    const at::Tensor before = t.set->Find("d.bias")->tensor.detach().clone();
    absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(), HasSubstr(pp1_shard));
    ExpectIdentical(t.set->Find("d.bias")->tensor, before, "d.bias after a failed load");
  }
}

TEST_F(CheckpointTest, SidecarWithoutEntriesReadsTheWholeShard) {
  // Sidecars as written before they said where the entries lie.
  std::vector<Trainee> tp2;
  for (int rank = 0; rank < 2; ++rank) {
    tp2.push_back(MakeTrainee(Specs(), rank, 2, 5));
    ASSERT_TRUE(TrainStep(tp2.back(), 0).ok());
  }
  Save(dir_, {{"llm", 0, 2, 0, 1}, {"llm", 1, 2, 0, 1}}, {&tp2[0], &tp2[1]}, 1);
  for (const char* name : {"llm-pp0-tp0.json", "llm-pp0-tp1.json"}) {
    json sidecar = ReadJson(dir_ + "/" + name);
    for (json& p : sidecar["params"]) ASSERT_EQ(p.erase("entries"), 1u);
    std::ofstream(dir_ + "/" + name) << sidecar.dump(2);
  }
  const FullState saved = Join(tp2);
  for (int rank = 0; rank < 4; ++rank) {
    Trainee t = MakeTrainee(Specs(), rank, 4, 6);
    absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
    ASSERT_TRUE(status.ok()) << status;
    ExpectHolds(t, saved, absl::StrCat("old sidecars, tp=4 rank ", rank));
  }

  // Read whole, the shard is checked whole against the manifest: a flipped byte of its header,
  // which no entry covers, is found.
  const std::string shard = dir_ + "/llm-pp0-tp0.hpar";
  const uint32_t good_crc = FileCrc(shard);
  FlipByte(shard, 13);  // the flags
  const uint32_t bad_crc = FileCrc(shard);
  ASSERT_NE(bad_crc, good_crc);
  Trainee t = MakeTrainee(Specs(), 0, 4, 6);
  absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(shard));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat(good_crc)));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat(bad_crc)));
}

// Saves a tp 1 checkpoint of BigSpecs() after one step into `dir` and returns its full state.
FullState SaveBig(const std::string& dir) {
  Trainee saved = MakeTrainee(BigSpecs(), 0, 1, 5);
  EXPECT_TRUE(TrainStep(saved, 0).ok());
  const ShardId id{"llm", 0, 1, 0, 1};
  absl::Status written = WriteShard(dir, id, 1, *saved.set, saved.opt.get());
  EXPECT_TRUE(written.ok()) << written;
  absl::StatusOr<bool> complete = CompleteIfAllWritten(dir, {id}, 1, json::object());
  EXPECT_TRUE(complete.ok() && *complete) << complete.status();
  std::vector<Trainee> group;
  group.push_back(std::move(saved));
  return Join(group);
}

TEST_F(CheckpointTest, ARankReadsOnlyTheBlocksOfTheSavedSliceItKeeps) {
  const FullState full = SaveBig(dir_);
  const std::string shard = dir_ + "/llm-pp0-tp0.hpar";
  const std::map<std::string, EntryBytes> layout = EntriesOf(shard);
  // The sidecar holds the CRC-32s of the four 1 MiB blocks of each entry's 4 MiB of data.
  const json sidecar = ReadJson(dir_ + "/llm-pp0-tp0.json");
  ASSERT_EQ(sidecar["params"].size(), 2u);
  for (const json& p : sidecar["params"]) {
    for (const auto& [kind, suffix] : std::vector<std::pair<std::string, std::string>>{
             {"value", ""}, {"exp_avg", "@exp_avg"}, {"exp_avg_sq", "@exp_avg_sq"}}) {
      const std::string name = p["name"].get<std::string>() + suffix;
      SCOPED_TRACE(name);
      const EntryBytes& e = layout.at(name);
      ASSERT_EQ(e.data_bytes, 4 * kBlockBytes);
      const json& range = p["entries"][kind];
      EXPECT_EQ(range["offset"], e.offset);
      EXPECT_EQ(range["bytes"], e.bytes);
      EXPECT_EQ(range["data_offset"], e.data_offset);
      EXPECT_EQ(range["dtype"], "float64");
      EXPECT_EQ(range["block_bytes"], kBlockBytes);
      const std::vector<uint32_t> crcs = BlockCrcsOf(shard, e);
      ASSERT_EQ(crcs.size(), 4u);
      EXPECT_EQ(range["block_crc32"].get<std::vector<uint32_t>>(), crcs);
    }
  }
  // Every rank of TP 2 and TP 4 gets its part of the values and moments, bit for bit.
  for (int tp : {2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      Trainee t = MakeTrainee(BigSpecs(), rank, tp, 6);
      absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
      ASSERT_TRUE(status.ok()) << status;
      ExpectHolds(t, full, absl::StrCat("tp=", tp, " rank ", rank));
    }
  }

  // A flipped byte in the last block of big.rows' value, which the whole entry's CRC-32 would
  // catch: TP 2 rank 0 (rows 0..255: blocks 0 and 1) does not read it and loads; rank 1 (rows
  // 256..511: blocks 2 and 3) is refused.
  const EntryBytes rows = layout.at("big.rows");
  const uint32_t stored = BlockCrcsOf(shard, rows)[3];
  FlipByte(shard, rows.data_offset + 3 * kBlockBytes + 12345);
  const uint32_t computed = BlockCrcsOf(shard, rows)[3];
  ASSERT_NE(computed, stored);
  const EntryCrcs whole = CrcsOf(shard, rows);
  ASSERT_NE(whole.computed, whole.stored);
  Trainee rank0 = MakeTrainee(BigSpecs(), 0, 2, 6);
  absl::Status status = LoadModuleState(dir_, "llm", *rank0.set, rank0.opt.get());
  ASSERT_TRUE(status.ok()) << status;
  ExpectHolds(rank0, full, "tp=2 rank 0 beside a corrupt block it does not need");

  Trainee rank1 = MakeTrainee(BigSpecs(), 1, 2, 6);
  const at::Tensor rows_before = rank1.set->Find("big.rows")->tensor.detach().clone();
  const at::Tensor cols_before = rank1.set->Find("big.cols")->tensor.detach().clone();
  status = LoadModuleState(dir_, "llm", *rank1.set, rank1.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(shard));
  EXPECT_THAT(status.message(), HasSubstr("entry 'big.rows'"));
  EXPECT_THAT(status.message(), HasSubstr("block 3"));
  EXPECT_THAT(status.message(),
              HasSubstr(absl::StrCat("[", rows.data_offset + 3 * kBlockBytes, ", ",
                                     rows.data_offset + 4 * kBlockBytes, ")")));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("computed ", computed)));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("stored ", stored)));
  EXPECT_THAT(status.message(), HasSubstr("the file is corrupt"));
  ExpectIdentical(rank1.set->Find("big.rows")->tensor, rows_before, "big.rows after a failed load");
  ExpectIdentical(rank1.set->Find("big.cols")->tensor, cols_before, "big.cols after a failed load");
  for (const Spec& s : BigSpecs()) EXPECT_FALSE(rank1.opt->StateOf(s.name).has_value()) << s.name;
}

TEST_F(CheckpointTest, ACorruptBlockARankNeedsIsDataLoss) {
  const FullState full = SaveBig(dir_);
  const std::string shard = dir_ + "/llm-pp0-tp0.hpar";
  const std::map<std::string, EntryBytes> layout = EntriesOf(shard);
  // big.cols split along dim 1: TP 2 rank 0 needs data bytes [0, 1 MiB) and [2, 3 MiB), so
  // reads blocks 0 to 2 (the gap too); TP 4 rank 0 needs [0, 0.5 MiB) and [2, 2.5 MiB). A
  // flipped byte in block 3 touches neither.
  const EntryBytes cols = layout.at("big.cols");
  FlipByte(shard, cols.data_offset + 3 * kBlockBytes + 7);
  for (int tp : {2, 4}) {
    Trainee t = MakeTrainee(BigSpecs(), 0, tp, 6);
    absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
    ASSERT_TRUE(status.ok()) << status;
    ExpectHolds(t, full, absl::StrCat("tp=", tp, " rank 0 beside a corrupt block of big.cols"));
  }

  // A flipped byte in block 1 of big.rows' first moment, which TP 2 rank 0 needs.
  const EntryBytes exp_avg = layout.at("big.rows@exp_avg");
  const uint32_t stored = BlockCrcsOf(shard, exp_avg)[1];
  FlipByte(shard, exp_avg.data_offset + kBlockBytes + 100);
  const uint32_t computed = BlockCrcsOf(shard, exp_avg)[1];
  ASSERT_NE(computed, stored);
  Trainee t = MakeTrainee(BigSpecs(), 0, 2, 6);
  const at::Tensor before = t.set->Find("big.rows")->tensor.detach().clone();
  absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(shard));
  EXPECT_THAT(status.message(), HasSubstr("entry 'big.rows@exp_avg'"));
  EXPECT_THAT(status.message(), HasSubstr("block 1"));
  EXPECT_THAT(status.message(),
              HasSubstr(absl::StrCat("[", exp_avg.data_offset + kBlockBytes, ", ",
                                     exp_avg.data_offset + 2 * kBlockBytes, ")")));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("computed ", computed)));
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("stored ", stored)));
  ExpectIdentical(t.set->Find("big.rows")->tensor, before, "big.rows after a failed load");
  for (const Spec& s : BigSpecs()) EXPECT_FALSE(t.opt->StateOf(s.name).has_value()) << s.name;
  // Without an optimizer the moments are not read: the values load.
  status = LoadModuleState(dir_, "llm", *t.set, nullptr);
  ASSERT_TRUE(status.ok()) << status;
  for (const Spec& s : BigSpecs()) {
    const nn::NamedParameter& p = *t.set->Find(s.name);
    ExpectIdentical(p.tensor, SliceOf(full.value.at(s.name), p), s.name);
  }
}

TEST_F(CheckpointTest, SidecarWithoutBlockChecksumsReadsWholeEntries) {
  const FullState full = SaveBig(dir_);
  const std::string shard = dir_ + "/llm-pp0-tp0.hpar";
  const std::string sidecar_path = dir_ + "/llm-pp0-tp0.json";
  const json sidecar = ReadJson(sidecar_path);
  const EntryBytes rows = EntriesOf(shard).at("big.rows");
  const int64_t flipped = rows.data_offset + 3 * kBlockBytes + 12345;
  FlipByte(shard, flipped);  // in a block TP 2 rank 0 does not need
  const EntryCrcs crcs = CrcsOf(shard, rows);
  ASSERT_NE(crcs.computed, crcs.stored);
  // The sidecar with `fields` taken out of every entry range.
  const auto write_without = [&](const std::vector<std::string>& fields) {
    json old = sidecar;
    for (json& p : old["params"]) {
      for (auto& [kind, range] : p["entries"].items()) {
        for (const std::string& field : fields) ASSERT_EQ(range.erase(field), 1u) << kind;
      }
    }
    std::ofstream(sidecar_path) << old.dump(2);
  };
  // Without the block CRC-32s (as written before they were recorded), or without the dtype
  // that a partial read takes from the sidecar, TP 2 rank 0 reads big.rows whole, so its
  // entry's CRC-32 finds the flipped byte.
  for (const std::vector<std::string>& fields :
       {std::vector<std::string>{"dtype"},
        std::vector<std::string>{"data_offset", "dtype", "block_bytes", "block_crc32"}}) {
    SCOPED_TRACE(absl::StrCat("without ", fields.size(), " fields"));
    write_without(fields);
    Trainee t = MakeTrainee(BigSpecs(), 0, 2, 6);
    const at::Tensor before = t.set->Find("big.rows")->tensor.detach().clone();
    absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(), HasSubstr(shard));
    EXPECT_THAT(status.message(), HasSubstr("entry 'big.rows'"));
    EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("computed ", crcs.computed)));
    EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("stored ", crcs.stored)));
    ExpectIdentical(t.set->Find("big.rows")->tensor, before, "big.rows after a failed load");
  }
  // Undamaged, the old sidecars load at TP 2 and 4.
  FlipByte(shard, flipped);  // back
  for (int tp : {2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      Trainee t = MakeTrainee(BigSpecs(), rank, tp, 6);
      absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
      ASSERT_TRUE(status.ok()) << status;
      ExpectHolds(t, full, absl::StrCat("old sidecar, tp=", tp, " rank ", rank));
    }
  }
  // Block CRC-32s that do not fit their entry make a corrupt sidecar.
  json damaged = sidecar;
  damaged["params"][0]["entries"]["value"]["block_crc32"].erase(0);
  std::ofstream(sidecar_path) << damaged.dump(2);
  Trainee t = MakeTrainee(BigSpecs(), 0, 2, 6);
  absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(sidecar_path));
  EXPECT_THAT(status.message(), HasSubstr("3 block CRC-32s"));
}

TEST_F(CheckpointTest, MissingOrMalformedManifest) {
  Trainee saved = MakeTrainee(Specs(), 0, 1, 5);
  ASSERT_TRUE(WriteShard(dir_, {"llm", 0, 1, 0, 1}, 0, *saved.set, saved.opt.get()).ok());
  Trainee t = MakeTrainee(Specs(), 0, 1, 6);
  absl::Status status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr(dir_));
  EXPECT_EQ(ReadCheckpointInfo(dir_).status().code(), absl::StatusCode::kNotFound);

  std::ofstream(dir_ + "/manifest.json") << "{\"format\": 1, \"step\": ";
  status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr(dir_ + "/manifest.json"));
  std::ofstream(dir_ + "/manifest.json") << "{\"format\": 1, \"step\": \"three\"}";
  absl::StatusOr<CheckpointInfo> info = ReadCheckpointInfo(dir_);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDataLoss) << info.status();
  EXPECT_THAT(info.status().message(), HasSubstr(dir_ + "/manifest.json"));
}

TEST_F(CheckpointTest, ParameterInNoShardIsNotFoundAndChangesNothing) {
  // Saved at step 0: no optimizer state yet, and the loaded optimizer gets none.
  Trainee saved = MakeTrainee(Specs(), 0, 1, 5);
  Save(dir_, {{"llm", 0, 1, 0, 1}}, {&saved}, 0);
  Trainee plain = MakeTrainee(Specs(), 0, 1, 6);
  absl::Status status = LoadModuleState(dir_, "llm", *plain.set, plain.opt.get());
  ASSERT_TRUE(status.ok()) << status;
  std::vector<Trainee> group;
  group.push_back(std::move(saved));
  ExpectHolds(plain, Join(group), "step 0");

  std::vector<Spec> specs = Specs();
  specs.push_back({"z.extra", {2, 2}, -1});
  Trainee t = MakeTrainee(specs, 0, 1, 6);
  const at::Tensor before = t.set->Find("a.weight")->tensor.detach().clone();
  status = LoadModuleState(dir_, "llm", *t.set, t.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("'z.extra'"));
  EXPECT_THAT(status.message(), HasSubstr(dir_));
  ExpectIdentical(t.set->Find("a.weight")->tensor, before, "a.weight after a failed load");
  // A module with no shard at all.
  status = LoadModuleState(dir_, "encoder", *plain.set, plain.opt.get());
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
}

TEST_F(CheckpointTest, PruneKeepsTheNewestCompleteCheckpoints) {
  const std::string parent = dir_ + "/ckpts";
  // Complete: 1, 3, 4 (a manifest); incomplete: 2 (a failed attempt), 5 (being written).
  for (int step : {1, 2, 3, 4, 5}) {
    const std::string dir = absl::StrCat(parent, "/", CheckpointDirName(step));
    fs::create_directories(dir);
    std::ofstream(dir + "/llm-pp0-tp0.hpar") << "shard";
    if (step != 2 && step != 5) {
      std::ofstream(dir + "/manifest.json") << json{
          {"format", 1},
          {"step", step},
          {"shards", json::array()},
          {"extra", json::object()}}.dump();
    }
  }
  fs::create_directories(parent + "/other");
  std::ofstream(parent + "/step-notes.txt") << "not a checkpoint";
  const auto listing = [&] {
    std::set<std::string> names;
    for (const auto& entry : fs::directory_iterator(parent)) {
      names.insert(entry.path().filename().string());
    }
    return names;
  };

  ASSERT_TRUE(PruneCheckpoints(parent, 2).ok());
  EXPECT_EQ(listing(), std::set<std::string>({"step-000003", "step-000004", "step-000005", "other",
                                              "step-notes.txt"}));
  ASSERT_TRUE(PruneCheckpoints(parent, 1).ok());
  EXPECT_EQ(listing(),
            std::set<std::string>({"step-000004", "step-000005", "other", "step-notes.txt"}));
  ASSERT_TRUE(PruneCheckpoints(parent, 1).ok());  // nothing more to do
  EXPECT_EQ(listing().size(), 4u);
  // A run resumed from step 1 completes its step 2: step 4, of the run that went further, is
  // neither removed nor counted, and the checkpoint resumed from stays.
  for (int step : {1, 2}) {
    const std::string dir = absl::StrCat(parent, "/", CheckpointDirName(step));
    fs::create_directories(dir);
    std::ofstream(dir + "/manifest.json") << json{{"format", 1},
                                                  {"step", step},
                                                  {"shards", json::array()},
                                                  {"extra", json::object()}}
                                                 .dump();
  }
  ASSERT_TRUE(PruneCheckpoints(parent, 2, 2).ok());
  EXPECT_EQ(listing(), std::set<std::string>({"step-000001", "step-000002", "step-000004",
                                              "step-000005", "other", "step-notes.txt"}));
  EXPECT_EQ(PruneCheckpoints(parent, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(PruneCheckpoints(dir_ + "/missing", 2).ok());
}

// A complete checkpoint of `step` at `dir` as pruning sees one: a manifest (of no shards).
std::string CompleteCheckpointAt(const std::string& dir, int step) {
  fs::create_directories(dir);
  std::ofstream(dir + "/manifest.json") << json{
      {"format", 1},
      {"step", step},
      {"shards", json::array()},
      {"extra", json::object()}}.dump();
  return dir;
}

// A restarted coordinator resumes from step 2 and pins it; a worker of the coordinator it
// replaced then completes step 4 and prunes with keep 1: step 2 stays (not counted: step 4 is
// kept too), and goes at the first pruning after the pin is let go.
TEST_F(CheckpointTest, APinnedCheckpointIsNotPruned) {
  const std::string parent = dir_ + "/ckpts";
  const auto complete = [&](int step) {
    return CompleteCheckpointAt(absl::StrCat(parent, "/", CheckpointDirName(step)), step);
  };
  const std::string picked = complete(2);
  const std::string older = complete(1);
  ASSERT_TRUE(PinCheckpoint(picked, "a test's coordinator").ok());
  ASSERT_TRUE(PinCheckpoint(older, "an earlier coordinator").ok());
  ASSERT_TRUE(UnpinCheckpoints(parent, picked + "/").ok());  // every pin but the picked one goes
  EXPECT_TRUE(IsCheckpointPinned(picked));
  EXPECT_FALSE(IsCheckpointPinned(older));
  complete(4);
  ASSERT_TRUE(PruneCheckpoints(parent, 1, 4).ok());
  EXPECT_TRUE(fs::exists(picked + "/manifest.json")) << "the pinned checkpoint was pruned";
  EXPECT_FALSE(fs::exists(older)) << "the unpinned older checkpoint was kept";
  EXPECT_TRUE(fs::exists(absl::StrCat(parent, "/", CheckpointDirName(4), "/manifest.json")));

  ASSERT_TRUE(UnpinCheckpoints(parent).ok());
  EXPECT_FALSE(IsCheckpointPinned(picked));
  complete(6);
  ASSERT_TRUE(PruneCheckpoints(parent, 1, 6).ok());
  EXPECT_FALSE(fs::exists(picked));
  EXPECT_FALSE(fs::exists(absl::StrCat(parent, "/", CheckpointDirName(4))));
  EXPECT_TRUE(fs::exists(absl::StrCat(parent, "/", CheckpointDirName(6), "/manifest.json")));
  EXPECT_TRUE(UnpinCheckpoints(dir_ + "/missing").ok());
}

// A pruning killed between taking checkpoints out of sight and removing them: the next pruning
// removes what it left, and puts back the one a restart pinned before the rename.
TEST_F(CheckpointTest, WhatAPruningCutShortLeftIsClearedByTheNext) {
  const std::string parent = dir_ + "/ckpts";
  const auto complete = [&](const std::string& name, int step) {
    const std::string dir = CompleteCheckpointAt(parent + "/" + name, step);
    std::ofstream(dir + "/llm-pp0-tp0.hpar") << "shard";
    return dir;
  };
  const std::string left = complete(".pruned-step-000001-00c0ffee12345678", 1);
  const std::string removing = complete(".removing-step-000001-0123456789abcdef", 1);
  const std::string pinned = complete(".pruned-step-000002-0123456789abcdef", 2);
  ASSERT_TRUE(PinCheckpoint(pinned, "a restart").ok());
  // Pinned, but its step is being written again (an empty directory so far): not put over it.
  const std::string rewritten = complete(".pruned-step-000004-0123456789abcdef", 4);
  ASSERT_TRUE(PinCheckpoint(rewritten, "a restart").ok());
  const std::string step4 = absl::StrCat(parent, "/", CheckpointDirName(4));
  fs::create_directories(step4);
  // Not what a pruning leaves: kept.
  const std::string other = complete(".pruned-notes", 0);
  complete("step-000003", 3);

  ASSERT_TRUE(PruneCheckpoints(parent, 1, 3).ok());
  EXPECT_FALSE(fs::exists(left)) << "a checkpoint whose pruning was cut short is kept";
  EXPECT_FALSE(fs::exists(removing)) << "a checkpoint whose removal was cut short is kept";
  EXPECT_FALSE(fs::exists(pinned));
  const std::string back = absl::StrCat(parent, "/", CheckpointDirName(2));
  EXPECT_TRUE(fs::exists(back + "/llm-pp0-tp0.hpar")) << "the pinned checkpoint is not back";
  EXPECT_TRUE(IsCheckpointPinned(back));
  EXPECT_TRUE(fs::is_empty(step4)) << "a pinned copy was put over a step being written";
  EXPECT_TRUE(fs::exists(rewritten + "/manifest.json"));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_TRUE(fs::exists(absl::StrCat(parent, "/", CheckpointDirName(3), "/manifest.json")));

  // Its pin goes with the others' (the restart's first commit), and the next pruning removes it.
  ASSERT_TRUE(UnpinCheckpoints(parent).ok());
  EXPECT_FALSE(IsCheckpointPinned(rewritten));
  EXPECT_FALSE(IsCheckpointPinned(back));
  ASSERT_TRUE(PruneCheckpoints(parent, 1, 3).ok());
  EXPECT_FALSE(fs::exists(rewritten));
}

TEST_F(CheckpointTest, ARestartPutsBackTheCheckpointItPinnedWhenAPruningTookIt) {
  const std::string parent = dir_ + "/ckpts";
  const auto complete_at = [](const std::string& dir) {
    fs::create_directories(dir);
    std::ofstream(dir + "/manifest.json") << "{}";
    return dir;
  };
  const std::string step = absl::StrCat(parent, "/", CheckpointDirName(4));
  fs::create_directories(step);
  std::ofstream(step + "/manifest.json") << "{}";
  ASSERT_TRUE(PinCheckpoint(step, "a restart").ok());
  // An unpinned one of the same step (another pruner's) is not taken for it.
  fs::create_directories(parent + "/.pruned-step-000004-aaaaaaaaaaaaaaaa");
  const std::string taken = parent + "/.pruned-step-000004-0123456789abcdef";
  fs::rename(step, taken);
  // Pins that go (an earlier coordinator's, of another step) and one that stays (this restart's,
  // in the copy a pruner took).
  const std::string stale = complete_at(parent + "/.pruned-step-000003-0123456789abcdef");
  ASSERT_TRUE(PinCheckpoint(stale, "an earlier coordinator").ok());
  ASSERT_TRUE(UnpinCheckpoints(parent, step).ok());
  EXPECT_FALSE(IsCheckpointPinned(stale));
  EXPECT_TRUE(IsCheckpointPinned(taken));

  absl::StatusOr<bool> put = PutBackPinnedCheckpoint(step + "/");
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_TRUE(*put);
  EXPECT_TRUE(fs::exists(step + "/manifest.json"));
  EXPECT_FALSE(fs::exists(taken));
  EXPECT_TRUE(fs::exists(parent + "/.pruned-step-000004-aaaaaaaaaaaaaaaa"));
  // Already there: nothing to do. Removed for good: not there.
  put = PutBackPinnedCheckpoint(step);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_TRUE(*put);
  put = PutBackPinnedCheckpoint(absl::StrCat(parent, "/", CheckpointDirName(5)));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_FALSE(*put);

  EXPECT_EQ(PrunedCheckpointOrigin(".pruned-step-000004-0123456789abcdef"), "step-000004");
  EXPECT_EQ(PrunedCheckpointOrigin(".pruned-step-000004-0123456789abcdeg"), "");
  EXPECT_EQ(PrunedCheckpointOrigin(".pruned-step-000004"), "");
  EXPECT_EQ(PrunedCheckpointOrigin(".pruned-notes-0123456789abcdef"), "");
  EXPECT_EQ(PrunedCheckpointOrigin("step-000004"), "");
}

}  // namespace
}  // namespace hetpar::train
