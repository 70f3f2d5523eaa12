#include "common/nn/safetensors.h"

#include <ATen/ATen.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

#ifndef HETPAR_PYTHON
#error "HETPAR_PYTHON must name the project's Python (common/nn/CMakeLists.txt)"
#endif

namespace hetpar::nn {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using ::testing::HasSubstr;

// Same dtype, shape and bytes (so NaN and -0.0 must match too), with the first differing byte
// reported.
void ExpectBitIdentical(const at::Tensor& actual, const at::Tensor& expected,
                        const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_TRUE(actual.is_contiguous()) << what;
  const at::Tensor e = expected.contiguous();
  const size_t bytes = static_cast<size_t>(e.numel()) * e.element_size();
  const auto* a_bytes = static_cast<const unsigned char*>(actual.data_ptr());
  const auto* e_bytes = static_cast<const unsigned char*>(e.data_ptr());
  for (size_t i = 0; i < bytes; ++i) {
    ASSERT_EQ(a_bytes[i], e_bytes[i])
        << what << ": mismatch at byte " << i << " (element " << i / e.element_size() << ")";
  }
}

// The tensors of the round trip: every dtype, scalar, empty and non-contiguous shapes. Not in
// name order, so that offset order and the header's (sorted) key order differ.
std::vector<SafetensorsTensor> MixedTensors() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  at::Tensor f32 = at::arange(12, at::kFloat).reshape({3, 4}).mul(0.5).sub(1.0);
  f32[0][0] = nan;
  f32[0][1] = -0.0f;
  f32[2][3] = std::numeric_limits<float>::infinity();
  const at::Tensor f16_transposed =
      at::arange(12, at::kFloat).mul(0.125).to(at::kHalf).reshape({3, 4}).t();
  at::Tensor i64 = at::arange(5, at::kLong).mul(1000003);
  i64[0] = std::numeric_limits<int64_t>::min();
  i64[4] = std::numeric_limits<int64_t>::max();
  return {
      {"z.f32.matrix", f32},
      {"y.f64.scalar", at::full({}, 3.141592653589793, at::kDouble)},
      {"x.bf16.empty", at::empty({0}, at::kBFloat16)},
      {"w.f16.transposed", f16_transposed},
      {"v.i64", i64},
      {"u.bool", at::arange(6, at::kLong).remainder(3).eq(1).reshape({2, 3})},
      {"t.bf16", at::arange(8, at::kFloat).sub(3.5).to(at::kBFloat16).reshape({2, 2, 2})},
      {"s.i32", at::arange(-3, 3, at::kInt)},
      {"r.i16", at::arange(-2, 2, at::kShort)},
      {"q.i8", at::arange(-128, 128, 64, at::kChar)},
      {"p.u8", at::arange(0, 256, 51, at::kByte)},
  };
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / "hetpar_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // A file of the given header text and data buffer; the length field is the header's unless
  // `declared` overrides it.
  std::string WriteRaw(const std::string& name, const std::string& header, const std::string& data,
                       std::optional<uint64_t> declared = std::nullopt) {
    const std::string path = Path(name);
    const uint64_t length = declared.value_or(header.size());
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(&length), sizeof(length));
    out << header << data;
    EXPECT_TRUE(out.good()) << path;
    return path;
  }

  // Runs `script` with HETPAR_PYTHON and `args`; the exit status and stdout + stderr.
  int RunPython(const std::string& script, const std::string& args, std::string* output) {
    const std::string script_path = Path("oracle.py");
    {
      std::ofstream out(script_path);
      out << script;
    }
    const std::string command =
        absl::StrCat("'", HETPAR_PYTHON, "' '", script_path, "' ", args, " 2>&1");
    FILE* pipe = ::popen(command.c_str(), "r");
    if (pipe == nullptr) {
      *output = absl::StrCat("popen failed: ", std::strerror(errno));
      return -1;
    }
    output->clear();
    char buffer[4096];
    size_t n;
    while ((n = ::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output->append(buffer, n);
    const int status = ::pclose(pipe);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // Fails the test (not skips it) when the oracle cannot run.
  void RequirePythonSafetensors() {
    std::string output;
    const int rc = RunPython("import torch, safetensors.torch\n", "", &output);
    ASSERT_EQ(rc, 0) << "HETPAR_PYTHON (" << HETPAR_PYTHON
                     << ") cannot import torch and safetensors, the oracle of this test; run "
                        "deploy/install-deps.sh. Python said:\n"
                     << output;
  }

  std::string dir_;
};

TEST_F(SafetensorsTest, RoundTripsEveryDtypeAndShapeBitForBitInOffsetOrder) {
  const std::vector<SafetensorsTensor> tensors = MixedTensors();
  ASSERT_FALSE(tensors[3].tensor.is_contiguous());  // the transpose
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "héllo"}};
  const std::string path = Path("nested/dir/model.safetensors");  // parents are created
  ASSERT_TRUE(WriteSafetensors(tensors, path, metadata).ok());

  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->metadata, metadata);
  ASSERT_EQ(read->tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(read->tensors[i].name, tensors[i].name) << "position " << i;
    ExpectBitIdentical(read->tensors[i].tensor, tensors[i].tensor, tensors[i].name);
  }
  EXPECT_EQ(read->tensors[1].tensor.dim(), 0);

  // The header is padded with spaces to a multiple of 8 and the data follows it exactly.
  std::ifstream in(path, std::ios::binary);
  uint64_t header_bytes = 0;
  in.read(reinterpret_cast<char*>(&header_bytes), sizeof(header_bytes));
  EXPECT_EQ(header_bytes % 8, 0u);
  std::string header(header_bytes, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_bytes));
  const Json json = Json::parse(header);
  EXPECT_EQ(json["__metadata__"]["note"], "héllo");
  EXPECT_EQ(json["z.f32.matrix"]["data_offsets"], Json({0, 48}));
  EXPECT_EQ(json["w.f16.transposed"]["shape"], Json({4, 3}));
  EXPECT_EQ(json["y.f64.scalar"]["shape"], Json::array());
  int64_t data_bytes = 0;
  for (const SafetensorsTensor& t : tensors)
    data_bytes += t.tensor.numel() * t.tensor.element_size();
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(path)),
            8 + static_cast<int64_t>(header_bytes) + data_bytes);
}

TEST_F(SafetensorsTest, RoundTripsAnEmptyFile) {
  const std::string path = Path("empty.safetensors");
  ASSERT_TRUE(WriteSafetensors({}, path).ok());
  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->tensors.empty());
  EXPECT_TRUE(read->metadata.empty());
}

TEST_F(SafetensorsTest, ReadsWhatPythonSafetensorsWrote) {
  RequirePythonSafetensors();
  const std::string path = Path("python.safetensors");
  const std::string script = R"(
import json, sys, torch
from safetensors.torch import save_file
tensors = {
    "a.arange": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
    "b.bf16": (torch.arange(6, dtype=torch.float32) * 0.25 - 0.5).to(torch.bfloat16).reshape(3, 2),
    "c.f64": torch.tensor([1.0 / 3, -2.5e-300, 1e300], dtype=torch.float64),
    "d.i64": torch.tensor([-(2**63), 2**63 - 1, 7], dtype=torch.int64),
    "e.bool": torch.tensor([True, False, True]),
    "f.scalar": torch.tensor(2.5, dtype=torch.float16),
    "g.slice": torch.arange(12, dtype=torch.int32).reshape(3, 4)[:, 1:3].contiguous(),
}
save_file(tensors, sys.argv[1], metadata={"format": "pt", "source": "oracle"})
# The order of the tensors' data in the file, as Python's own header says.
with open(sys.argv[1], "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
header.pop("__metadata__")
print(" ".join(sorted(header, key=lambda k: header[k]["data_offsets"][0])))
)";
  std::string output;
  ASSERT_EQ(RunPython(script, absl::StrCat("'", path, "'"), &output), 0) << output;

  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->metadata,
            (std::map<std::string, std::string>{{"format", "pt"}, {"source", "oracle"}}));
  std::vector<std::string> names;
  for (const SafetensorsTensor& t : read->tensors) names.push_back(t.name);
  std::istringstream expected_order(output);
  std::vector<std::string> python_order;
  for (std::string name; expected_order >> name;) python_order.push_back(name);
  EXPECT_EQ(names, python_order) << "hetpar returns tensors in data-offset order";

  at::Tensor i64 = at::empty({3}, at::kLong);
  i64[0] = std::numeric_limits<int64_t>::min();
  i64[1] = std::numeric_limits<int64_t>::max();
  i64[2] = 7;
  const std::map<std::string, at::Tensor> expected = {
      {"a.arange", at::arange(24, at::kFloat).reshape({2, 3, 4})},
      {"b.bf16", at::arange(6, at::kFloat).mul(0.25).sub(0.5).to(at::kBFloat16).reshape({3, 2})},
      {"c.f64", at::tensor(std::vector<double>{1.0 / 3, -2.5e-300, 1e300}, at::kDouble)},
      {"d.i64", i64},
      {"e.bool", at::tensor(std::vector<int64_t>{1, 0, 1}).ne(0)},
      {"f.scalar", at::full({}, 2.5, at::kHalf)},
      {"g.slice", at::arange(12, at::kInt).reshape({3, 4}).slice(1, 1, 3)},
  };
  ASSERT_EQ(read->tensors.size(), expected.size());
  for (const SafetensorsTensor& t : read->tensors) {
    ASSERT_TRUE(expected.count(t.name)) << t.name;
    ExpectBitIdentical(t.tensor, expected.at(t.name), t.name);
  }
}

TEST_F(SafetensorsTest, PythonSafetensorsReadsWhatHetparWrote) {
  RequirePythonSafetensors();
  std::vector<SafetensorsTensor> tensors = MixedTensors();
  // JSON has no NaN or infinity: keep the values finite for the comparison below.
  tensors[0].tensor = at::arange(12, at::kFloat).reshape({3, 4}).mul(0.5).sub(1.0);
  const std::string path = Path("hetpar.safetensors");
  ASSERT_TRUE(WriteSafetensors(tensors, path, {{"format", "pt"}, {"writer", "hetpar"}}).ok());

  // Python loads it with the reference implementation and prints every value as JSON.
  const std::string script = R"(
import json, sys, torch
from safetensors import safe_open
out = {"tensors": {}}
with safe_open(sys.argv[1], framework="pt") as f:
    out["metadata"] = f.metadata()
    for name in f.keys():
        t = f.get_tensor(name)
        out["tensors"][name] = {
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "values": (t.double() if t.is_floating_point() else t).flatten().tolist(),
        }
print(json.dumps(out))
)";
  std::string output;
  ASSERT_EQ(RunPython(script, absl::StrCat("'", path, "'"), &output), 0) << output;
  const Json python = Json::parse(output, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(python.is_discarded()) << output;

  EXPECT_EQ(python["metadata"], Json({{"format", "pt"}, {"writer", "hetpar"}}));
  ASSERT_EQ(python["tensors"].size(), tensors.size());
  const std::map<at::ScalarType, std::string> torch_names = {
      {at::kFloat, "torch.float32"},     {at::kDouble, "torch.float64"},
      {at::kBFloat16, "torch.bfloat16"}, {at::kHalf, "torch.float16"},
      {at::kLong, "torch.int64"},        {at::kInt, "torch.int32"},
      {at::kShort, "torch.int16"},       {at::kChar, "torch.int8"},
      {at::kByte, "torch.uint8"},        {at::kBool, "torch.bool"}};
  for (const SafetensorsTensor& t : tensors) {
    SCOPED_TRACE(t.name);
    ASSERT_TRUE(python["tensors"].contains(t.name));
    const Json& p = python["tensors"][t.name];
    EXPECT_EQ(p["dtype"], torch_names.at(t.tensor.scalar_type()));
    EXPECT_EQ(p["shape"].get<std::vector<int64_t>>(), t.tensor.sizes().vec());
    const at::Tensor flat = t.tensor.contiguous().view(-1);
    ASSERT_EQ(static_cast<int64_t>(p["values"].size()), flat.numel());
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const Json& v = p["values"][i];
      if (t.tensor.is_floating_point()) {
        ASSERT_EQ(v.get<double>(), flat[i].item<double>()) << "element " << i;
      } else if (t.tensor.scalar_type() == at::kBool) {
        ASSERT_EQ(v.get<bool>(), flat[i].item<bool>()) << "element " << i;
      } else {
        ASSERT_EQ(v.get<int64_t>(), flat[i].item<int64_t>()) << "element " << i;
      }
    }
  }
}

TEST_F(SafetensorsTest, ReadsShardedDirectoryThroughItsIndex) {
  const at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3});
  const at::Tensor b = at::arange(4, at::kDouble).neg();
  const at::Tensor c = at::arange(5, at::kFloat).to(at::kBFloat16);
  const std::string checkpoint = Path("checkpoint");
  ASSERT_TRUE(WriteSafetensors({{"layer.0.a", a}, {"layer.0.b", b}},
                               checkpoint + "/model-00001-of-00002.safetensors")
                  .ok());
  ASSERT_TRUE(
      WriteSafetensors({{"layer.1.c", c}}, checkpoint + "/model-00002-of-00002.safetensors").ok());
  Json index = {{"metadata", {{"total_size", 24 + 32 + 10}}},
                {"weight_map",
                 {{"layer.0.a", "model-00001-of-00002.safetensors"},
                  {"layer.0.b", "model-00001-of-00002.safetensors"},
                  {"layer.1.c", "model-00002-of-00002.safetensors"}}}};
  std::ofstream(checkpoint + "/model.safetensors.index.json") << index.dump(2);

  absl::StatusOr<std::map<std::string, at::Tensor>> read = ReadSafetensorsDirectory(checkpoint);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 3u);
  ExpectBitIdentical(read->at("layer.0.a"), a, "layer.0.a");
  ExpectBitIdentical(read->at("layer.0.b"), b, "layer.0.b");
  ExpectBitIdentical(read->at("layer.1.c"), c, "layer.1.c");

  // A name the index places in a shard that lacks it.
  index["weight_map"]["layer.2.missing"] = "model-00002-of-00002.safetensors";
  std::ofstream(checkpoint + "/model.safetensors.index.json") << index.dump(2);
  read = ReadSafetensorsDirectory(checkpoint);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("'layer.2.missing'"));
  EXPECT_THAT(read.status().message(), HasSubstr("model-00002-of-00002.safetensors"));
  index["weight_map"].erase("layer.2.missing");

  // A tensor in two shards.
  ASSERT_TRUE(WriteSafetensors({{"layer.1.c", c}, {"layer.0.b", b}},
                               checkpoint + "/model-00002-of-00002.safetensors")
                  .ok());
  std::ofstream(checkpoint + "/model.safetensors.index.json") << index.dump(2);
  read = ReadSafetensorsDirectory(checkpoint);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("'layer.0.b'"));
  EXPECT_THAT(read.status().message(), HasSubstr("model-00001-of-00002.safetensors"));
  EXPECT_THAT(read.status().message(), HasSubstr("model-00002-of-00002.safetensors"));

  // A shard the index names but the directory lacks.
  fs::remove(checkpoint + "/model-00002-of-00002.safetensors");
  read = ReadSafetensorsDirectory(checkpoint);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kNotFound) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("model-00002-of-00002.safetensors"));

  // A shard name that climbs out of the directory.
  index["weight_map"]["layer.1.c"] = "../elsewhere.safetensors";
  std::ofstream(checkpoint + "/model.safetensors.index.json") << index.dump(2);
  read = ReadSafetensorsDirectory(checkpoint);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("layer.1.c"));

  // An index that is not JSON.
  std::ofstream(checkpoint + "/model.safetensors.index.json") << "{\"weight_map\": ";
  read = ReadSafetensorsDirectory(checkpoint);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("model.safetensors.index.json"));
}

TEST_F(SafetensorsTest, ReadsSingleFileDirectoryAndReportsAnEmptyOne) {
  const at::Tensor w = at::arange(3, at::kHalf);
  ASSERT_TRUE(WriteSafetensors({{"w", w}}, Path("single/model.safetensors")).ok());
  absl::StatusOr<std::map<std::string, at::Tensor>> read = ReadSafetensorsDirectory(Path("single"));
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  ExpectBitIdentical(read->at("w"), w, "w");

  fs::create_directories(Path("empty"));
  read = ReadSafetensorsDirectory(Path("empty"));
  ASSERT_EQ(read.status().code(), absl::StatusCode::kNotFound) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr(Path("empty")));
  read = ReadSafetensorsDirectory(Path("no-such-dir"));
  ASSERT_EQ(read.status().code(), absl::StatusCode::kNotFound) << read.status();
}

TEST_F(SafetensorsTest, MissingFileIsNotFoundNamingIt) {
  const std::string path = Path("absent.safetensors");
  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kNotFound) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr(path));
}

TEST_F(SafetensorsTest, TruncatedDataIsDataLossNamingTheLastTensor) {
  const std::string path = Path("truncated.safetensors");
  ASSERT_TRUE(WriteSafetensors(
                  {{"first", at::ones({4}, at::kFloat)}, {"last", at::ones({4}, at::kFloat)}}, path)
                  .ok());
  fs::resize_file(path, fs::file_size(path) - 3);
  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr(path));
  EXPECT_THAT(read.status().message(), HasSubstr("'last'"));
  EXPECT_THAT(read.status().message(), HasSubstr("truncated"));
}

TEST_F(SafetensorsTest, HeaderLengthBeyondTheFileIsDataLoss) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  const std::string data(4, '\0');
  for (const uint64_t declared : {uint64_t{header.size() + data.size() + 1}, uint64_t{200'000'000},
                                  std::numeric_limits<uint64_t>::max()}) {
    SCOPED_TRACE(declared);
    const std::string path = WriteRaw("long_header.safetensors", header, data, declared);
    absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
    ASSERT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
    EXPECT_THAT(read.status().message(), HasSubstr(path));
    EXPECT_THAT(read.status().message(), HasSubstr(absl::StrCat(declared)));
  }
  const std::string path = Path("tiny.safetensors");
  std::ofstream(path) << "abc";
  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr(path));
}

// A hand-made file that must be refused.
struct CorruptCase {
  std::string label;
  std::string header;
  std::string data;
  absl::StatusCode code;
  std::vector<std::string> message_has;  // besides the path
};

TEST_F(SafetensorsTest, CorruptHeadersAreRefusedNamingFileAndTensor) {
  const std::string eight(8, '\0');
  const std::vector<CorruptCase> cases = {
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"( "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       std::string(12, '\0'),
       absl::StatusCode::kDataLoss,
       {"'b'", "overlaps", "'a'"}},
      {"hole",
       R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]},)"
       R"( "a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       std::string(20, '\0'),
       absl::StatusCode::kDataLoss,
       {"'b'", "hole of 4 bytes"}},
      {"hole at the start",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       std::string(12, '\0'),
       absl::StatusCode::kDataLoss,
       {"'a'", "hole"}},
      {"bytes after the last tensor",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       std::string(10, '\0'),
       absl::StatusCode::kDataLoss,
       {"2 bytes after its last tensor"}},
      {"unknown dtype",
       R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})",
       eight,
       absl::StatusCode::kInvalidArgument,
       {"'a'", "\"F99\""}},
      {"byte count not shape x dtype",
       R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}})",
       eight,
       absl::StatusCode::kDataLoss,
       {"'a'", "needs 16 bytes"}},
      {"end before begin",
       R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})",
       eight,
       absl::StatusCode::kDataLoss,
       {"'a'"}},
      {"negative dim",
       R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
       eight,
       absl::StatusCode::kInvalidArgument,
       {"'a'", "[-2]"}},
      {"not JSON", R"({"a": {"dtype": )", eight, absl::StatusCode::kInvalidArgument, {"JSON"}},
      {"not an object", R"([1, 2])", "", absl::StatusCode::kInvalidArgument, {"JSON object"}},
      {"entry not an object",
       R"({"a": 5})",
       "",
       absl::StatusCode::kInvalidArgument,
       {"'a'", "expected an object"}},
      {"missing data_offsets",
       R"({"a":{"dtype":"F32","shape":[2]}})",
       eight,
       absl::StatusCode::kInvalidArgument,
       {"'a'", "data_offsets"}},
      {"name twice",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"( "a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       std::string(16, '\0'),
       absl::StatusCode::kInvalidArgument,
       {"'a' twice"}},
      {"metadata value not a string",
       R"({"__metadata__":{"n":3}})",
       "",
       absl::StatusCode::kInvalidArgument,
       {"__metadata__", "'n'"}},
      // It parses, but printing its shape in the message would recurse 100000 levels deep.
      {"shape nested 100000 deep",
       R"({"t":{"dtype":"F32","shape":)" + std::string(100000, '[') + std::string(100000, ']') +
           R"(,"data_offsets":[0,0]}})",
       "",
       absl::StatusCode::kInvalidArgument,
       {"nests deeper than 64 levels"}},
      {"bool byte not 0 or 1",
       R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})",
       std::string("\x01\x02\x00", 3),
       absl::StatusCode::kDataLoss,
       {"'m'", "byte 2"}},
  };
  for (const CorruptCase& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string path = WriteRaw("corrupt.safetensors", c.header, c.data);
    absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
    ASSERT_EQ(read.status().code(), c.code) << read.status();
    EXPECT_THAT(read.status().message(), HasSubstr(path));
    for (const std::string& part : c.message_has) {
      EXPECT_THAT(read.status().message(), HasSubstr(part));
    }
  }
}

TEST_F(SafetensorsTest, AcceptsPaddedHeadersAndZeroSizedTensorsAnywhere) {
  // Spaces after the JSON; an empty tensor at offset 0 and another at the end; keys in reverse
  // offset order.
  const std::string header = R"({"c":{"dtype":"I8","shape":[0,5],"data_offsets":[6,6]},)"
                             R"("b":{"dtype":"I16","shape":[3],"data_offsets":[0,6]},)"
                             R"("a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}   )";
  const std::string path =
      WriteRaw("padded.safetensors", header, std::string("\x01\x00\x02\x00\xff\xff", 6));
  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->tensors.size(), 3u);
  EXPECT_EQ(read->tensors[0].name, "a");
  EXPECT_EQ(read->tensors[1].name, "b");
  EXPECT_EQ(read->tensors[2].name, "c");
  ExpectBitIdentical(read->tensors[1].tensor,
                     at::tensor(std::vector<int64_t>{1, 2, -1}).to(at::kShort), "b");
  EXPECT_EQ(read->tensors[2].tensor.sizes(), (std::vector<int64_t>{0, 5}));
}

TEST_F(SafetensorsTest, FailedWritesLeaveNothingAtThePath) {
  const at::Tensor t = at::ones({2}, at::kFloat);
  const std::string path = Path("out/model.safetensors");
  struct BadWrite {
    std::string label;
    std::vector<SafetensorsTensor> tensors;
    std::string message_has;
  };
  const std::vector<BadWrite> bad = {
      {"repeated name", {{"w", t}, {"v", t}, {"w", t}}, "'w'"},
      {"empty name", {{"", t}}, "''"},
      {"reserved name", {{"__metadata__", t}}, "__metadata__"},
      {"unsupported dtype", {{"w", t}, {"c", at::ones({2}, at::kComplexFloat)}}, "'c'"},
      {"undefined tensor", {{"u", at::Tensor()}}, "'u'"},
      {"name not UTF-8", {{std::string("\xff\xfe", 2), t}}, "UTF-8"},
  };
  for (const BadWrite& b : bad) {
    SCOPED_TRACE(b.label);
    absl::Status status = WriteSafetensors(b.tensors, path);
    ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr(path));
    EXPECT_THAT(status.message(), HasSubstr(b.message_has));
    EXPECT_FALSE(fs::exists(path));
    if (fs::exists(Path("out"))) {
      EXPECT_TRUE(fs::is_empty(Path("out"))) << "a temporary file was left behind";
    }
  }

  // A failed write over an existing file keeps it.
  ASSERT_TRUE(WriteSafetensors({{"kept", t}}, path).ok());
  ASSERT_FALSE(WriteSafetensors({{"w", t}, {"w", t}}, path).ok());
  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->tensors.size(), 1u);
  EXPECT_EQ(read->tensors[0].name, "kept");
  ExpectBitIdentical(read->tensors[0].tensor, t, "kept");
}

}  // namespace
}  // namespace hetpar::nn
