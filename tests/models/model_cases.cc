#include "tests/models/model_cases.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "encoder_service/encoder.h"
#include "llm_trainer/language_model.h"
#include "tests/util/tiny_llm.h"

namespace hetpar::models_test {
namespace {

constexpr char kMagic[8] = {'H', 'P', 'M', 'R', 'E', 'C', '1', '\n'};

at::Tensor Random(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::normal(0.0, 1.0, shape, generator, at::TensorOptions().dtype(at::kDouble));
}

Record Plain(const at::Tensor& t) {
  Record r;
  r.value = t.detach().to(at::kDouble).contiguous();
  r.full_shape = r.value.sizes().vec();
  return r;
}

void AddParameters(const nn::ParameterSet& parameters, CaseRecords& out) {
  for (const nn::NamedParameter& p : parameters.parameters()) {
    Record init;
    init.value = p.tensor.detach().to(at::kDouble).contiguous();
    init.split_dim = p.slice.split_dim;
    init.offset = p.slice.offset;
    init.full_shape = p.full_shape;
    Record grad = init;
    grad.value = p.tensor.grad().defined() ? p.tensor.grad().to(at::kDouble).contiguous()
                                           : at::zeros_like(init.value);
    out["init/" + p.name] = std::move(init);
    out["grad/" + p.name] = std::move(grad);
  }
}

hetpar::v1::EncoderModel EncoderModel() {
  hetpar::v1::EncoderModel m;
  m.set_image_size(6);
  m.set_patch(2);  // 9 tokens per image; 3 images = 27 rows
  m.set_hidden(16);
  m.set_layers(2);
  m.set_heads(4);
  m.set_mlp(32);
  m.set_out_hidden(16);
  m.set_channels(3);
  return m;
}

hetpar::v1::LlmModel LlmModel() { return testing::TinyLlm(40); }

llm::LlmSample Sample(std::string id, int64_t length, int64_t salt,
                      std::vector<int64_t> image_positions) {
  llm::LlmSample s;
  s.id = std::move(id);
  for (int64_t i = 0; i < length; ++i) s.tokens.push_back((i * 7 + salt * 13 + 3) % 39);
  s.labels.assign(length, 0);
  s.loss_mask.assign(length, 1);
  for (int64_t i = 0; i + 1 < length; ++i) s.labels[i] = s.tokens[i + 1];
  s.loss_mask[length - 1] = 0;
  for (int64_t p : image_positions) {
    s.tokens[p] = 39;  // the image placeholder
    s.loss_mask[p] = 0;
  }
  s.image_positions = std::move(image_positions);
  s.image_rows = static_cast<int64_t>(s.image_positions.size());
  return s;
}

absl::StatusOr<CaseRecords> RunEncoder(const ModelCase& c, nn::Communicator& tp) {
  encoder::EncoderOptions options;
  options.dtype = c.dtype;
  options.seed = 21;
  options.sequence_parallel = c.sequence_parallel;
  options.init_style = nn::InitStyle::kAllRandom;
  HETPAR_ASSIGN_OR_RETURN(auto model, encoder::VisionEncoder::Create(EncoderModel(), options, tp));
  HETPAR_ASSIGN_OR_RETURN(at::Tensor output, model->Forward(Random({3, 3, 6, 6}, 1)));
  HETPAR_RETURN_IF_ERROR(model->Backward(output, Random({27, 16}, 2).to(c.dtype)));
  HETPAR_RETURN_IF_ERROR(model->FinishGradients());
  CaseRecords out;
  out["output"] = Plain(output);
  AddParameters(model->parameters(), out);
  return out;
}

absl::StatusOr<CaseRecords> RunLlm(const ModelCase& c, nn::Communicator& tp) {
  llm::LlmOptions options;
  options.dtype = c.dtype;
  options.seed = 31;
  options.sequence_parallel = c.sequence_parallel;
  options.init_style = nn::InitStyle::kAllRandom;
  HETPAR_ASSIGN_OR_RETURN(auto model, llm::LanguageModel::Create(LlmModel(), options, tp));
  // 0, 1 and 2 images per sample; 9 + 12 + 16 = 37 rows.
  const std::vector<llm::LlmSample> samples = {Sample("text", 9, 1, {}),
                                               Sample("one-image", 12, 2, {2, 3, 4}),
                                               Sample("two-images", 16, 3, {1, 2, 9, 10, 11})};
  at::Tensor rows = Random({8, 32}, 3).mul(0.5).to(c.dtype);
  if (c.sequence_parallel) {
    // Only the rows this rank reads are delivered; the others are zeros here, and the results
    // must still equal the single-process model's.
    at::Tensor delivered = at::zeros_like(rows);
    for (int64_t k : llm::ImageRowsReadByRank(samples, tp.rank(), tp.size(), true)) {
      delivered[k].copy_(rows[k]);
    }
    rows = delivered;
  }
  rows.requires_grad_(true);
  HETPAR_ASSIGN_OR_RETURN(llm::LlmForwardResult result, model->Forward(samples, rows, 50));
  HETPAR_RETURN_IF_ERROR(model->Backward(result.loss));
  HETPAR_RETURN_IF_ERROR(model->FinishGradients());
  CaseRecords out;
  out["loss"] = Plain(result.loss.reshape({1}));
  // A rank whose sequence shard holds no image row has no gradient for them: zero.
  out["image_rows.grad"] = Plain(rows.grad().defined() ? rows.grad() : at::zeros_like(rows));
  AddParameters(model->parameters(), out);
  return out;
}

template <typename T>
void Put(std::ofstream& out, T value) {
  out.write(reinterpret_cast<const char*>(&value), sizeof(T));
}

template <typename T>
bool Get(std::ifstream& in, T* value) {
  return static_cast<bool>(in.read(reinterpret_cast<char*>(value), sizeof(T)));
}

void PutShape(std::ofstream& out, const std::vector<int64_t>& shape) {
  Put<uint32_t>(out, static_cast<uint32_t>(shape.size()));
  for (int64_t d : shape) Put<int64_t>(out, d);
}

bool GetShape(std::ifstream& in, std::vector<int64_t>* shape) {
  uint32_t dims = 0;
  if (!Get(in, &dims) || dims > 8) return false;
  shape->resize(dims);
  for (auto& d : *shape) {
    if (!Get(in, &d) || d < 0) return false;
  }
  return true;
}

}  // namespace

std::vector<ModelCase> AllCases() {
  std::vector<ModelCase> cases;
  for (const char* module : {"encoder", "llm"}) {
    for (bool sp : {false, true}) {
      std::vector<at::ScalarType> dtypes = {at::kDouble, at::kFloat};
      if (std::string(module) == "llm") dtypes.push_back(at::kBFloat16);
      for (at::ScalarType dtype : dtypes) {
        cases.push_back(
            {absl::StrCat(module, sp ? "_sp_" : "_", nn::DtypeName(dtype)), module, sp, dtype});
      }
    }
  }
  return cases;
}

absl::StatusOr<CaseRecords> RunCase(const ModelCase& c, nn::Communicator& tp) {
  auto records = c.module == "encoder" ? RunEncoder(c, tp) : RunLlm(c, tp);
  if (!records.ok()) return Annotate(records.status(), absl::StrCat("case ", c.name));
  return records;
}

absl::Status WriteRecords(const std::string& path, const AllRecords& records) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  out.write(kMagic, sizeof(kMagic));
  uint32_t count = 0;
  for (const auto& [c, entries] : records) count += static_cast<uint32_t>(entries.size());
  Put<uint32_t>(out, count);
  for (const auto& [case_name, entries] : records) {
    for (const auto& [key, record] : entries) {
      const std::string name = case_name + "|" + key;
      Put<uint32_t>(out, static_cast<uint32_t>(name.size()));
      out.write(name.data(), static_cast<std::streamsize>(name.size()));
      Put<int32_t>(out, record.split_dim);
      Put<int64_t>(out, record.offset);
      PutShape(out, record.full_shape);
      const at::Tensor value = record.value.to(at::kDouble).contiguous();
      PutShape(out, value.sizes().vec());
      out.write(reinterpret_cast<const char*>(value.data_ptr<double>()),
                static_cast<std::streamsize>(value.numel() * sizeof(double)));
    }
  }
  out.flush();
  if (!out) return absl::UnavailableError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

absl::StatusOr<AllRecords> ReadRecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  char magic[sizeof(kMagic)];
  uint32_t count = 0;
  if (!in.read(magic, sizeof(magic)) || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0 ||
      !Get(in, &count)) {
    return absl::DataLossError(absl::StrCat(path, ": not a record file"));
  }
  AllRecords all;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t length = 0;
    if (!Get(in, &length) || length > 4096) {
      return absl::DataLossError(absl::StrCat(path, ": bad name at record ", i));
    }
    std::string name(length, '\0');
    Record record;
    int32_t split_dim = 0;
    std::vector<int64_t> shape;
    if (!in.read(name.data(), length) || !Get(in, &split_dim) || !Get(in, &record.offset) ||
        !GetShape(in, &record.full_shape) || !GetShape(in, &shape)) {
      return absl::DataLossError(absl::StrCat(path, ": truncated at record ", i));
    }
    record.split_dim = split_dim;
    record.value = at::empty(shape, at::TensorOptions().dtype(at::kDouble));
    if (!in.read(reinterpret_cast<char*>(record.value.data_ptr<double>()),
                 static_cast<std::streamsize>(record.value.numel() * sizeof(double)))) {
      return absl::DataLossError(absl::StrCat(path, ": truncated data of ", name));
    }
    const size_t bar = name.find('|');
    if (bar == std::string::npos) {
      return absl::DataLossError(absl::StrCat(path, ": record name ", name, " has no case"));
    }
    all[name.substr(0, bar)][name.substr(bar + 1)] = std::move(record);
  }
  return all;
}

}  // namespace hetpar::models_test
