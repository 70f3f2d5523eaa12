#include "common/nn/export.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <stdlib.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/nn/test_ranks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hetpar::nn {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  int split_dim;
};

// Parameters split on each dim of 1-, 2- and 3-D tensors, and replicated ones; every split size
// divides by 1, 2 and 4.
std::vector<Spec> Specs() {
  return {{"a.weight", {8, 6}, 0}, {"b.weight", {6, 8}, 1},   {"c.norm", {6}, -1},
          {"d.bias", {8}, 0},      {"e.table", {4, 2, 8}, 2}, {"f.scale", {3, 5}, -1}};
}

// The "trained" full tensor of a parameter: random values unrelated to its init.
at::Tensor Trained(const Spec& spec, at::ScalarType dtype) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(ParameterSeed(99, spec.name));
  return at::normal(0.0, 1.0, spec.shape, generator, at::TensorOptions().dtype(at::kDouble))
      .to(dtype);
}

std::unique_ptr<ParameterSet> MakeSet(const std::vector<Spec>& specs, int rank, int size,
                                      at::ScalarType dtype) {
  auto set = std::make_unique<ParameterSet>(5, dtype, rank, size, InitStyle::kAllRandom);
  for (const Spec& s : specs) {
    const InitRule rule = s.shape.size() == 1 ? InitRule::Normal(0.1, 1.0) : InitRule::Normal(0.02);
    auto added = set->Add(s.name, s.shape, s.split_dim, rule);
    EXPECT_TRUE(added.ok()) << added.status();
  }
  return set;
}

at::Tensor SliceOf(const at::Tensor& full, const NamedParameter& p) {
  return p.slice.split_dim < 0 ? full
                               : full.narrow(p.slice.split_dim, p.slice.offset, p.slice.length);
}

// Sets every rank's slices to the trained values.
void Train(ParameterSet& set, const std::vector<Spec>& specs) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < specs.size(); ++i) {
    const NamedParameter& p = set.parameters()[i];
    p.tensor.copy_(SliceOf(Trained(specs[i], set.dtype()), p));
  }
}

// Exact equality of every element (NaN-free data), with the first mismatch reported.
void ExpectIdentical(const at::Tensor& actual, const at::Tensor& expected,
                     const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  const at::Tensor a = actual.to(at::kDouble).contiguous().view(-1);
  const at::Tensor e = expected.to(at::kDouble).contiguous().view(-1);
  for (int64_t i = 0; i < a.numel(); ++i) {
    ASSERT_EQ(a[i].item<double>(), e[i].item<double>()) << what << ": mismatch at index " << i;
  }
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_export_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Saves the trained model from a TP group of `tp` threads.
  void SaveAt(int tp, const std::string& path, at::ScalarType dtype,
              const std::vector<Spec>& specs = Specs()) {
    absl::Status status = testing::RunRanks(tp, [&](int rank, Communicator& comm) {
      auto set = MakeSet(specs, rank, tp, dtype);
      Train(*set, specs);
      return SaveFullParameters(*set, comm, path);
    });
    ASSERT_TRUE(status.ok()) << status;
  }

  std::string dir_;
};

TEST_F(ExportTest, SavedAtTp2LoadsAtTp1And4ElementByElement) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    SCOPED_TRACE(DtypeName(dtype));
    const std::string path = absl::StrCat(dir_, "/models/", DtypeName(dtype), ".hpar");
    SaveAt(2, path, dtype);
    for (const auto& entry : fs::directory_iterator(fs::path(path).parent_path())) {
      EXPECT_THAT(entry.path().filename().string(), ::testing::Not(HasSubstr(".tmp-")));
    }
    for (int tp : {1, 4}) {
      for (int rank = 0; rank < tp; ++rank) {
        auto set = MakeSet(Specs(), rank, tp, dtype);
        // The loaded values differ from the init the set starts with.
        const at::Tensor before = set->parameters()[0].tensor.clone();
        ASSERT_TRUE(LoadFullParameters(*set, path).ok());
        EXPECT_FALSE(at::equal(before, set->parameters()[0].tensor));
        for (size_t i = 0; i < Specs().size(); ++i) {
          const NamedParameter& p = set->parameters()[i];
          ExpectIdentical(p.tensor, SliceOf(Trained(Specs()[i], dtype), p),
                          absl::StrCat(p.name, " at tp=", tp, " rank ", rank));
          EXPECT_TRUE(p.tensor.requires_grad());
          EXPECT_FALSE(p.tensor.grad().defined());
        }
      }
    }
  }
}

TEST_F(ExportTest, FileHoldsTheFullTensorsInOrderWithTheDocumentedLayout) {
  const std::string path = dir_ + "/m.hpar";
  SaveAt(4, path, at::kFloat);
  auto read = ReadFullParameters(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), Specs().size());
  int64_t expected_size = 32;
  const std::vector<Spec> specs = Specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    EXPECT_EQ((*read)[i].name, s.name);
    ExpectIdentical((*read)[i].tensor, Trained(s, at::kFloat), s.name);
    const int64_t elements = at::ones(s.shape).numel();
    expected_size += 4 + static_cast<int64_t>(s.name.size()) + 4 +
                     8 * static_cast<int64_t>(s.shape.size()) + 8 + 4 * elements + 4;
  }
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(path)), expected_size);
  std::ifstream in(path, std::ios::binary);
  std::string magic(8, '\0');
  in.read(magic.data(), 8);
  EXPECT_EQ(magic, "HETPARAM");
}

TEST_F(ExportTest, DtypeIsConvertedOnLoad) {
  const std::string path = dir_ + "/f64.hpar";
  SaveAt(2, path, at::kDouble);
  auto set = MakeSet(Specs(), 1, 2, at::kFloat);
  ASSERT_TRUE(LoadFullParameters(*set, path).ok());
  for (size_t i = 0; i < Specs().size(); ++i) {
    const NamedParameter& p = set->parameters()[i];
    ExpectIdentical(p.tensor, SliceOf(Trained(Specs()[i], at::kDouble), p).to(at::kFloat), p.name);
  }
}

// A byte of the file changed at `offset`.
void FlipByte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(offset);
  f.write(&c, 1);
}

TEST_F(ExportTest, CorruptionIsDetectedAndLeavesTheModelUnchanged) {
  const std::string path = dir_ + "/m.hpar";
  SaveAt(2, path, at::kFloat);
  const int64_t size = static_cast<int64_t>(fs::file_size(path));
  // Entry 0 ("a.weight", 8x6 float32) starts at 32: 4 + 8 name bytes + 4 + 16 dims + 8 = 40 bytes
  // of description, then 192 data bytes, then its checksum. Entry 1 follows at 268.
  struct Case {
    int64_t offset;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {3, "is not a hetpar parameter file"},
      {17, "corrupt header"},
      {32 + 40 + 100, "'a.weight' fails its checksum"},
      {32 + 40 + 192 + 1, "'a.weight' fails its checksum"},
      {268 + 40 + 5, "'b.weight' fails its checksum"},
      {268 + 4 + 2, "fails its checksum"},  // a letter of the name "b.weight"
      {size - 1, "fails its checksum"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("byte ", c.offset));
    const std::string corrupt = absl::StrCat(dir_, "/corrupt-", c.offset, ".hpar");
    fs::copy_file(path, corrupt);
    FlipByte(corrupt, c.offset);
    auto set = MakeSet(Specs(), 0, 1, at::kFloat);
    std::vector<at::Tensor> before;
    for (const NamedParameter& p : set->parameters()) before.push_back(p.tensor.clone());
    absl::Status status = LoadFullParameters(*set, corrupt);
    EXPECT_FALSE(status.ok());
    EXPECT_THAT(std::string(status.message()), HasSubstr(corrupt));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.expected));
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(at::equal(before[i], set->parameters()[i].tensor)) << set->parameters()[i].name;
    }
    EXPECT_FALSE(ReadFullParameters(corrupt).ok());
  }
  // A changed dim makes the description inconsistent with the data size.
  const std::string dims = dir_ + "/dims.hpar";
  fs::copy_file(path, dims);
  FlipByte(dims, 32 + 4 + 8 + 4);
  absl::Status status = LoadFullParameters(*MakeSet(Specs(), 0, 1, at::kFloat), dims);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("'a.weight'"));
}

TEST_F(ExportTest, TruncatedOrExtendedFilesAreRejected) {
  const std::string path = dir_ + "/m.hpar";
  SaveAt(2, path, at::kDouble);
  const int64_t size = static_cast<int64_t>(fs::file_size(path));
  for (int64_t cut : {int64_t{0}, int64_t{20}, int64_t{32}, int64_t{35}, int64_t{60}, int64_t{300},
                      size / 2, size - 4, size - 1}) {
    SCOPED_TRACE(absl::StrCat("cut at ", cut, " of ", size));
    const std::string truncated = absl::StrCat(dir_, "/cut-", cut, ".hpar");
    fs::copy_file(path, truncated);
    fs::resize_file(truncated, static_cast<uintmax_t>(cut));
    absl::Status status = LoadFullParameters(*MakeSet(Specs(), 0, 2, at::kDouble), truncated);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(status.message()), HasSubstr(truncated));
    EXPECT_THAT(std::string(status.message()), HasSubstr("truncated"));
  }
  // Mid-entry cuts name the parameter being read.
  const std::string mid = dir_ + "/mid.hpar";
  fs::copy_file(path, mid);
  fs::resize_file(mid, 300);  // inside "a.weight"'s 384 data bytes
  EXPECT_THAT(std::string(LoadFullParameters(*MakeSet(Specs(), 0, 1, at::kDouble), mid).message()),
              HasSubstr("'a.weight'"));
  const std::string longer = dir_ + "/longer.hpar";
  fs::copy_file(path, longer);
  std::ofstream(longer, std::ios::app | std::ios::binary) << "extra";
  absl::Status status = LoadFullParameters(*MakeSet(Specs(), 0, 1, at::kDouble), longer);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("5 bytes after its 6 entries"));
}

TEST_F(ExportTest, ModelAndFileMustHoldTheSameParameters) {
  const std::string path = dir_ + "/m.hpar";
  SaveAt(2, path, at::kFloat);
  // The model has a parameter the file lacks.
  std::vector<Spec> more = Specs();
  more.push_back({"g.extra", {4}, 0});
  absl::Status missing = LoadFullParameters(*MakeSet(more, 0, 2, at::kFloat), path);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.message()), HasSubstr("no parameter 'g.extra'"));
  EXPECT_THAT(std::string(missing.message()), HasSubstr(path));
  // The file has a parameter the model lacks.
  std::vector<Spec> fewer = Specs();
  fewer.erase(fewer.begin() + 2);
  absl::Status extra = LoadFullParameters(*MakeSet(fewer, 0, 2, at::kFloat), path);
  EXPECT_EQ(extra.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(extra.message()), HasSubstr("'c.norm', which the model does not have"));
  // Same name, other shape.
  std::vector<Spec> reshaped = Specs();
  reshaped[1].shape = {6, 4};
  absl::Status shape = LoadFullParameters(*MakeSet(reshaped, 0, 2, at::kFloat), path);
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(shape.message()),
              HasSubstr("'b.weight' has shape [6, 8] in " + path + "; the model expects [6, 4]"));
  // No file; not a parameter file.
  absl::Status none = LoadFullParameters(*MakeSet(Specs(), 0, 1, at::kFloat), dir_ + "/none");
  EXPECT_EQ(none.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(none.message()), HasSubstr(dir_ + "/none"));
  std::ofstream(dir_ + "/text") << "not a parameter file, just some text here";
  absl::Status text = LoadFullParameters(*MakeSet(Specs(), 0, 1, at::kFloat), dir_ + "/text");
  EXPECT_EQ(text.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(text.message()), HasSubstr("is not a hetpar parameter file"));
}

// How pipeline stages export and start: parts saved separately and joined by
// WriteFullParameters read back as one whole file; a stage loads its part of a whole file.
TEST_F(ExportTest, StagePartsJoinIntoOneFileAndAStageLoadsItsPart) {
  const std::vector<Spec> specs = Specs();
  const std::vector<Spec> first(specs.begin(), specs.begin() + 2);
  const std::vector<Spec> second(specs.begin() + 2, specs.end());
  SaveAt(2, dir_ + "/part-0", at::kFloat, first);
  SaveAt(4, dir_ + "/part-1", at::kFloat, second);
  std::vector<FullParameter> whole;
  for (const char* part : {"/part-0", "/part-1"}) {
    auto read = ReadFullParameters(dir_ + part);
    ASSERT_TRUE(read.ok()) << read.status();
    for (FullParameter& p : *read) whole.push_back(std::move(p));
  }
  const std::string joined = dir_ + "/joined.hpar";
  WrittenFile written;
  ASSERT_TRUE(WriteFullParameters(whole, joined, &written).ok());
  // Byte for byte what one save of the whole model writes.
  const std::string saved = dir_ + "/whole.hpar";
  SaveAt(1, saved, at::kFloat);
  auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(bytes(joined), bytes(saved));
  // The size and checksum summed while writing are the file's.
  const std::string file = bytes(joined);
  EXPECT_EQ(written.bytes, file.size());
  EXPECT_EQ(written.crc32, static_cast<uint32_t>(crc32_z(
                               0, reinterpret_cast<const Bytef*>(file.data()), file.size())));
  // The second stage's rank 1 of 2 loads its slices of the whole file; as a whole model it may not.
  auto stage = MakeSet(second, 1, 2, at::kFloat);
  EXPECT_EQ(LoadFullParameters(*stage, joined).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(LoadFullParameters(*stage, joined, FileScope::kModelIsPart).ok());
  for (const NamedParameter& p : stage->parameters()) {
    const Spec& spec = *std::find_if(second.begin(), second.end(),
                                     [&](const Spec& s) { return s.name == p.name; });
    ExpectIdentical(p.tensor, SliceOf(Trained(spec, at::kFloat), p), p.name);
  }
  // What the stage skips must be the whole model's: a file holding more (a larger model's) is
  // refused, naming the first entry no part has, and the stage's parameters stay as they were.
  const std::string last_name = specs.back().name;
  const WholeModelHas all_but_last = [&](std::string_view name) { return name != last_name; };
  auto untouched = MakeSet(first, 0, 1, at::kFloat);
  const at::Tensor before = untouched->parameters().front().tensor.clone();
  const absl::Status larger =
      LoadFullParameters(*untouched, joined, FileScope::kModelIsPart, all_but_last);
  EXPECT_EQ(larger.code(), absl::StatusCode::kInvalidArgument) << larger;
  EXPECT_THAT(std::string(larger.message()),
              HasSubstr("holds parameter '" + last_name + "', which no part of the model has"));
  ExpectIdentical(untouched->parameters().front().tensor, before, "the first parameter");
  const WholeModelHas every = [](std::string_view) { return true; };
  EXPECT_TRUE(LoadFullParameters(*untouched, joined, FileScope::kModelIsPart, every).ok());
  // A repeated name is refused before anything is written.
  whole.push_back(whole.front());
  EXPECT_EQ(WriteFullParameters(whole, dir_ + "/twice.hpar").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(dir_ + "/twice.hpar"));
}

TEST_F(ExportTest, AFailedWriteFailsEveryRankAndLeavesNoTemporaryFile) {
  // The target is a directory: the temporary file is written, the rename fails.
  const std::string path = dir_ + "/occupied";
  fs::create_directories(path + "/inside");
  std::mutex mu;
  std::vector<absl::Status> results(2);
  absl::Status status = testing::RunRanks(2, [&](int rank, Communicator& comm) {
    auto set = MakeSet(Specs(), rank, 2, at::kFloat);
    absl::Status saved = SaveFullParameters(*set, comm, path);
    std::lock_guard<std::mutex> lock(mu);
    results[rank] = saved;
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_FALSE(results[0].ok());
  EXPECT_THAT(std::string(results[0].message()), HasSubstr("renaming"));
  EXPECT_EQ(results[1].code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(results[1].message()), HasSubstr(path));
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_THAT(entry.path().filename().string(), ::testing::Not(HasSubstr(".tmp-")));
  }
  EXPECT_TRUE(fs::is_directory(path + "/inside"));
}

}  // namespace
}  // namespace hetpar::nn
