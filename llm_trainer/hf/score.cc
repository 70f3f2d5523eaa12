#include "llm_trainer/hf/score.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/config/config.h"
#include "common/data/image.h"
#include "common/json_depth.h"
#include "common/nn/communicator.h"
#include "common/nn/export.h"
#include "common/nn/torch_status.h"
#include "common/status.h"
#include "encoder_service/encoder.h"
#include "llm_trainer/hf/hf_convert.h"
#include "llm_trainer/language_model.h"
#include "nlohmann/json.hpp"

namespace hetpar::hf {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kImageMarker = -1;

struct Line {
  int64_t number = 0;               // 1-based line of the input file
  std::vector<int64_t> tokens;      // as given, -1 = an image
  std::vector<std::string> images;  // resolved paths
};

absl::StatusOr<std::vector<Line>> ReadLines(const std::string& path, const ModelDirectory& model) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open --tokens file ", path));
  const fs::path base = fs::path(path).parent_path();
  std::vector<Line> lines;
  std::string text;
  for (int64_t number = 1; std::getline(in, text); ++number) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = absl::StrCat(path, ":", number);
    bool too_deep = false;
    json j = ParseJsonWithinDepth<json>(&too_deep, text);
    if (j.is_discarded() || !j.is_object() || too_deep) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": not a JSON object", JsonDepthNote(too_deep)));
    }
    auto tokens = j.find("tokens");
    if (tokens == j.end() || !tokens->is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": \"tokens\" is missing or not a list"));
    }
    Line line;
    line.number = number;
    int64_t markers = 0;
    for (size_t i = 0; i < tokens->size(); ++i) {
      const json& t = (*tokens)[i];
      if (!t.is_number_integer()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": tokens[", i, "]=", t.dump(), " is not an integer"));
      }
      const int64_t id = t.get<int64_t>();
      if (id == kImageMarker) {
        ++markers;
      } else if (id < 0 || id >= model.llm.vocab()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": tokens[", i, "]=", id,
                                                       " is outside the vocabulary [0, ",
                                                       model.llm.vocab(), ") (-1 marks an image)"));
      }
      line.tokens.push_back(id);
    }
    if (line.tokens.size() < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", line.tokens.size(), " tokens; at least 2 are needed"));
    }
    if (auto images = j.find("images"); images != j.end()) {
      if (!images->is_array()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": \"images\" is not a list"));
      }
      for (const json& image : *images) {
        if (!image.is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": \"images\" holds ", image.dump(), ", not a path"));
        }
        const fs::path p = image.get<std::string>();
        line.images.push_back(p.is_absolute() ? p.string() : (base / p).string());
      }
    }
    if (static_cast<int64_t>(line.images.size()) != markers) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", markers,
                                                     " image markers (-1) in \"tokens\" but ",
                                                     line.images.size(), " \"images\""));
    }
    if (markers > 0 && !model.encoder.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": the line has images but the model in ", model.dir, " has no encoder"));
    }
    lines.push_back(std::move(line));
  }
  if (lines.empty()) return absl::InvalidArgumentError(absl::StrCat(path, " holds no lines"));
  return lines;
}

// A line as the LLM sees it, images expanded into placeholder rows.
struct Expanded {
  llm::LlmSample sample;
  std::vector<bool> image_row;  // per position
};

Expanded Expand(const Line& line, int64_t tokens_per_image) {
  Expanded e;
  e.sample.id = absl::StrCat("line ", line.number);
  for (int64_t id : line.tokens) {
    if (id == kImageMarker) {
      for (int64_t r = 0; r < tokens_per_image; ++r) {
        e.sample.image_positions.push_back(static_cast<int64_t>(e.sample.tokens.size()));
        e.sample.tokens.push_back(0);
        e.image_row.push_back(true);
      }
      e.sample.image_rows += tokens_per_image;
    } else {
      e.sample.tokens.push_back(id);
      e.image_row.push_back(false);
    }
  }
  const size_t n = e.sample.tokens.size();
  e.sample.labels.assign(n, 0);
  e.sample.loss_mask.assign(n, 0);
  return e;
}

// One TP rank's share of the work: every rank computes every batch, rank 0 keeps the output.
absl::Status ScoreOnRank(const ScoreOptions& options, const ModelDirectory& model,
                         const std::vector<Line>& lines, nn::Communicator& tp,
                         std::vector<std::string>* out) {
  const at::ScalarType dtype = options.dtype == "float64" ? at::kDouble : at::kFloat;
  hetpar::v1::LlmModel llm_model = model.llm;
  const int64_t tokens_per_image =
      model.encoder.has_value() ? config::TokensPerImage(*model.encoder) : 0;
  std::vector<Expanded> expanded;
  int64_t longest = 0;
  for (const Line& line : lines) {
    expanded.push_back(Expand(line, tokens_per_image));
    longest =
        std::max<int64_t>(longest, static_cast<int64_t>(expanded.back().sample.tokens.size()));
  }
  llm_model.set_seq_len(std::max(llm_model.seq_len(), longest));
  llm::LlmOptions llm_options;
  llm_options.dtype = dtype;
  HETPAR_ASSIGN_OR_RETURN(auto language, llm::LanguageModel::Create(llm_model, llm_options, tp));
  HETPAR_RETURN_IF_ERROR(nn::LoadFullParameters(language->parameters(), model.llm_path));
  std::unique_ptr<encoder::VisionEncoder> vision;
  if (model.encoder.has_value()) {
    encoder::EncoderOptions enc_options;
    enc_options.dtype = dtype;
    HETPAR_ASSIGN_OR_RETURN(vision,
                            encoder::VisionEncoder::Create(*model.encoder, enc_options, tp));
    HETPAR_RETURN_IF_ERROR(nn::LoadFullParameters(vision->parameters(), model.encoder_path));
  }
  const int64_t vocab_local = llm_model.vocab() / tp.size();
  const int64_t vocab_begin = vocab_local * tp.rank();
  for (size_t first = 0; first < lines.size(); first += static_cast<size_t>(options.micro_batch)) {
    const size_t last = std::min(lines.size(), first + static_cast<size_t>(options.micro_batch));
    std::vector<llm::LlmSample> samples;
    std::vector<float> pixels;
    int64_t images = 0;
    for (size_t i = first; i < last; ++i) {
      samples.push_back(expanded[i].sample);
      for (const std::string& path : lines[i].images) {
        const int size = static_cast<int>(model.encoder->image_size());
        auto image = data::LoadImageForEncoder(path, size, data::Normalization());
        if (!image.ok()) {
          return absl::Status(image.status().code(),
                              absl::StrCat(options.tokens_path, ":", lines[i].number, ": ",
                                           image.status().message()));
        }
        pixels.insert(pixels.end(), image->begin(), image->end());
        ++images;
      }
    }
    at::Tensor image_rows;
    if (images > 0) {
      const int64_t size = model.encoder->image_size();
      at::Tensor batch =
          at::from_blob(pixels.data(), {images, model.encoder->channels(), size, size}, at::kFloat)
              .clone();
      at::NoGradGuard no_grad;
      HETPAR_ASSIGN_OR_RETURN(image_rows, vision->Forward(batch));
    }
    HETPAR_ASSIGN_OR_RETURN(at::Tensor logits, language->LocalLogits(samples, image_rows));
    // log p(target) = logit[target] - max - log(sum exp(logit - max)), reduced over the ranks
    // that each hold a slice of the vocabulary.
    std::vector<int64_t> targets;
    std::vector<uint8_t> scored;
    for (const auto& sample : samples) {
      for (size_t i = 0; i < sample.tokens.size(); ++i) {
        const bool has_next = i + 1 < sample.tokens.size();
        const size_t s = static_cast<size_t>(&sample - samples.data());
        const bool next_is_image = has_next && expanded[first + s].image_row[i + 1];
        targets.push_back(has_next ? sample.tokens[i + 1] : 0);
        scored.push_back(has_next && !next_is_image ? 1 : 0);
      }
    }
    std::vector<double> logprob;
    at::Tensor l, max, sum, picked;
    HETPAR_RETURN_IF_ERROR(nn::RunTorch("score: row maxima", [&] {
      l = logits.to(at::kDouble);
      max = std::get<0>(l.max(1)).contiguous();
    }));
    HETPAR_RETURN_IF_ERROR(tp.AllReduce(max, nn::ReduceOp::kMax));
    HETPAR_RETURN_IF_ERROR(nn::RunTorch("score: sums and targets", [&] {
      sum = (l - max.unsqueeze(1)).exp().sum(1).contiguous();
      at::Tensor local = at::tensor(targets, at::kLong) - vocab_begin;
      at::Tensor mine = (local >= 0).logical_and(local < vocab_local).to(at::kDouble);
      picked = (l.gather(1, local.clamp(0, vocab_local - 1).unsqueeze(1)).squeeze(1) * mine)
                   .contiguous();
    }));
    HETPAR_RETURN_IF_ERROR(tp.AllReduce(sum));
    HETPAR_RETURN_IF_ERROR(tp.AllReduce(picked));
    HETPAR_RETURN_IF_ERROR(nn::RunTorch("score: log-probabilities", [&] {
      at::Tensor result = (picked - max - sum.log()).contiguous();
      logprob.assign(result.data_ptr<double>(), result.data_ptr<double>() + result.numel());
    }));
    if (tp.rank() != 0) continue;
    size_t row = 0;
    for (const auto& sample : samples) {
      json values = json::array();
      for (size_t i = 0; i < sample.tokens.size(); ++i, ++row) {
        if (i + 1 == sample.tokens.size()) continue;
        if (scored[row]) {
          values.push_back(logprob[row]);
        } else {
          values.push_back(nullptr);
        }
      }
      out->push_back(
          json{{"logprobs", values}}.dump(-1, ' ', false, json::error_handler_t::replace));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Score(const ScoreOptions& options) {
  if (options.dtype != "float32" && options.dtype != "float64") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype=", options.dtype, " is not one of: float32, float64"));
  }
  if (options.tp < 1 || options.micro_batch < 1) {
    return absl::InvalidArgumentError("--tp and --micro-batch must be >= 1");
  }
  HETPAR_ASSIGN_OR_RETURN(ModelDirectory model, OpenModelDirectory(options.model_dir));
  HETPAR_ASSIGN_OR_RETURN(std::vector<Line> lines, ReadLines(options.tokens_path, model));
  std::vector<std::string> out;
  if (options.tp == 1) {
    auto comm = nn::Communicator::CreateSingle();
    HETPAR_RETURN_IF_ERROR(ScoreOnRank(options, model, lines, *comm, &out));
  } else {
    // The TP ranks are threads of this process, joined by Gloo over an in-memory store.
    auto store = nn::OpenHashStore();
    std::vector<absl::Status> results(static_cast<size_t>(options.tp));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < options.tp; ++rank) {
      threads.emplace_back([&, rank] {
        nn::CommunicatorOptions comm_options;
        comm_options.prefix = "score-tp";
        comm_options.rank = rank;
        comm_options.size = options.tp;
        auto comm = nn::Communicator::Create(store, comm_options);
        if (!comm.ok()) {
          results[rank] = comm.status();
          return;
        }
        results[rank] = ScoreOnRank(options, model, lines, **comm, &out);
        // No rank tears its group down while another still reduces.
        if (results[rank].ok()) results[rank] = (*comm)->Barrier();
      });
    }
    for (auto& thread : threads) thread.join();
    for (int rank = 0; rank < options.tp; ++rank) {
      if (!results[rank].ok()) {
        return absl::Status(results[rank].code(), absl::StrCat("TP rank ", rank, " of ", options.tp,
                                                               ": ", results[rank].message()));
      }
    }
  }
  std::string text;
  for (const std::string& line : out) absl::StrAppend(&text, line, "\n");
  if (options.out_path.empty()) {
    std::cout << text << std::flush;
    return absl::OkStatus();
  }
  return WriteFileAtomically(options.out_path, text);
}

}  // namespace hetpar::hf
