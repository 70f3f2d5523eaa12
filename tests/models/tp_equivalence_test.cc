// Tensor-parallel equivalence of the encoder and the LLM: TP groups of 2 and 4 real processes
// (Gloo over loopback, a file store) against the single-process model.
//
// For every case (module x sequence parallelism x dtype) and every rank: the forward output
// (encoder) or loss (LLM) equals the reference; each parameter's initial values are exactly this
// rank's slice of the reference tensor; each parameter gradient equals the slice of the reference
// gradient (float64: relative error <= 1e-10, float32: <= 1e-5, relative to the largest element
// of the reference tensor); the gradient of the image rows equals the reference on every rank
// without SP, and summed over the ranks with SP. bfloat16 runs are held to bfloat16 tolerances.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/models/model_cases.h"
#include "tests/util/subprocess.h"

namespace hetpar::models_test {
namespace {

namespace fs = std::filesystem;

constexpr int kTpSizes[] = {2, 4};

struct GroupRun {
  std::vector<AllRecords> ranks;  // by rank
  std::string error;              // why the group did not produce records
};

class Environment {
 public:
  static Environment& Get() {
    static Environment* environment = new Environment();
    return *environment;
  }
  const AllRecords& reference() const { return reference_; }
  const std::string& reference_error() const { return reference_error_; }
  const GroupRun& group(int tp) const { return groups_.at(tp); }

 private:
  Environment() {
    at::set_num_threads(1);
    // Start both groups first, so their processes overlap with the reference run here.
    const fs::path dir =
        fs::temp_directory_path() / ("hetpar_tp_equivalence_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::map<int, std::vector<hetpar::testing::ChildProcess>> children;
    for (int tp : kTpSizes) {
      const std::string store = (dir / ("store_tp" + std::to_string(tp))).string();
      for (int rank = 0; rank < tp; ++rank) {
        const std::string name = "tp" + std::to_string(tp) + "_rank" + std::to_string(rank);
        auto child = hetpar::testing::ChildProcess::Start(
            {MODEL_EQUIVALENCE_RANK, "--store", store, "--tp", std::to_string(tp), "--rank",
             std::to_string(rank), "--out", (dir / (name + ".bin")).string()},
            (dir / (name + ".log")).string());
        if (!child.ok()) {
          groups_[tp].error = std::string(child.status().message());
          continue;
        }
        children[tp].push_back(*std::move(child));
      }
    }
    auto single = nn::Communicator::CreateSingle();
    for (const ModelCase& c : AllCases()) {
      auto records = RunCase(c, *single);
      if (!records.ok()) {
        reference_error_ = std::string(records.status().message());
        break;
      }
      reference_[c.name] = *std::move(records);
    }
    for (int tp : kTpSizes) {
      GroupRun& run = groups_[tp];
      for (int rank = 0; rank < static_cast<int>(children[tp].size()); ++rank) {
        const std::string name = "tp" + std::to_string(tp) + "_rank" + std::to_string(rank);
        auto code = children[tp][rank].Wait(150);
        if (!code.ok() || *code != 0) {
          std::ifstream log(dir / (name + ".log"));
          std::stringstream text;
          text << log.rdbuf();
          run.error += name +
                       (code.ok() ? " exited " + std::to_string(*code)
                                  : " " + std::string(code.status().message())) +
                       ":\n" + text.str();
          continue;
        }
        auto records = ReadRecords((dir / (name + ".bin")).string());
        if (!records.ok()) {
          run.error += std::string(records.status().message());
          continue;
        }
        run.ranks.push_back(*std::move(records));
      }
    }
    fs::remove_all(dir);
  }

  AllRecords reference_;
  std::string reference_error_;
  std::map<int, GroupRun> groups_;
};

// max |a - b| / max |reference| over the whole reference tensor.
double RelativeError(const at::Tensor& got, const at::Tensor& expected, double scale) {
  if (got.sizes() != expected.sizes()) return 1e300;
  const double diff = (got - expected).abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

struct Tolerances {
  double value;
  double grad;
};

Tolerances TolerancesFor(at::ScalarType dtype) {
  if (dtype == at::kDouble) return {1e-10, 1e-10};
  if (dtype == at::kFloat) return {1e-5, 1e-5};
  // bfloat16 keeps 8 significant bits: layouts round partial sums differently.
  return {2e-3, 5e-2};
}

}  // namespace

void PrintTo(const ModelCase& c, std::ostream* os) { *os << c.name; }

namespace {

class TpEquivalenceTest : public ::testing::TestWithParam<std::tuple<int, ModelCase>> {};

TEST_P(TpEquivalenceTest, OutputsInitAndGradientsEqualTheSingleProcessModel) {
  const auto& [tp, model_case] = GetParam();
  const Environment& env = Environment::Get();
  ASSERT_TRUE(env.reference_error().empty()) << env.reference_error();
  const GroupRun& run = env.group(tp);
  ASSERT_TRUE(run.error.empty()) << run.error;
  ASSERT_EQ(static_cast<int>(run.ranks.size()), tp);
  const CaseRecords& reference = env.reference().at(model_case.name);
  const Tolerances tolerance = TolerancesFor(model_case.dtype);
  const bool partial_image_grad =
      model_case.sequence_parallel && tp > 1 && reference.count("image_rows.grad") > 0;

  at::Tensor image_grad_sum;
  int checked_parameters = 0;
  double worst_value = 0, worst_grad = 0;
  for (int rank = 0; rank < tp; ++rank) {
    SCOPED_TRACE("tp " + std::to_string(tp) + " rank " + std::to_string(rank));
    ASSERT_EQ(run.ranks[rank].count(model_case.name), 1u);
    const CaseRecords& mine = run.ranks[rank].at(model_case.name);
    ASSERT_EQ(mine.size(), reference.size());
    for (const auto& [key, expected] : reference) {
      ASSERT_EQ(mine.count(key), 1u) << key;
      const Record& got = mine.at(key);
      const double scale = expected.value.abs().max().item<double>();
      if (key == "output" || key == "loss") {
        const double error = RelativeError(got.value, expected.value, scale);
        worst_value = std::max(worst_value, error);
        EXPECT_LE(error, tolerance.value) << key;
        continue;
      }
      if (key == "image_rows.grad") {
        if (partial_image_grad) {
          image_grad_sum =
              image_grad_sum.defined() ? image_grad_sum + got.value : got.value.clone();
        } else {
          const double error = RelativeError(got.value, expected.value, scale);
          worst_grad = std::max(worst_grad, error);
          EXPECT_LE(error, tolerance.grad) << key;
        }
        continue;
      }
      // A parameter: this rank's slice of the full reference tensor.
      EXPECT_EQ(got.full_shape, expected.full_shape) << key;
      at::Tensor slice = expected.value;
      if (got.split_dim >= 0) {
        const int64_t length = expected.full_shape[got.split_dim] / tp;
        EXPECT_EQ(got.offset, rank * length) << key;
        slice = slice.narrow(got.split_dim, got.offset, length);
      }
      if (key.rfind("init/", 0) == 0) {
        EXPECT_TRUE(at::equal(got.value, slice)) << key << " is not the slice of the tp=1 init";
      } else {
        ++checked_parameters;
        const double error = RelativeError(got.value, slice, scale);
        worst_grad = std::max(worst_grad, error);
        EXPECT_LE(error, tolerance.grad) << key;
      }
    }
  }
  if (partial_image_grad) {
    const at::Tensor& expected = reference.at("image_rows.grad").value;
    const double error =
        RelativeError(image_grad_sum, expected, expected.abs().max().item<double>());
    worst_grad = std::max(worst_grad, error);
    EXPECT_LE(error, tolerance.grad) << "image rows gradient summed over the TP ranks";
  }
  EXPECT_GT(checked_parameters, 10 * tp);
  RecordProperty("max_relative_error_output", std::to_string(worst_value));
  RecordProperty("max_relative_error_grad", std::to_string(worst_grad));
  std::cout << "tp" << tp << " " << model_case.name << ": max relative error output " << worst_value
            << ", gradients " << worst_grad << "\n";
}

std::vector<std::tuple<int, ModelCase>> Params() {
  std::vector<std::tuple<int, ModelCase>> params;
  for (int tp : kTpSizes) {
    for (const ModelCase& c : AllCases()) params.emplace_back(tp, c);
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Cases, TpEquivalenceTest, ::testing::ValuesIn(Params()),
                         [](const ::testing::TestParamInfo<std::tuple<int, ModelCase>>& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

// The reference itself: a gradient that does not depend on the parameters would make the
// comparisons above vacuous, so check that the cases produce non-trivial values.
TEST(TpEquivalenceReferenceTest, CasesProduceNonZeroGradientsEverywhere) {
  const Environment& env = Environment::Get();
  ASSERT_TRUE(env.reference_error().empty()) << env.reference_error();
  for (const auto& [name, records] : env.reference()) {
    for (const auto& [key, record] : records) {
      if (key.rfind("grad/", 0) != 0 && key != "image_rows.grad") continue;
      EXPECT_GT(record.value.abs().max().item<double>(), 0.0) << name << " " << key;
    }
  }
}

}  // namespace
}  // namespace hetpar::models_test
