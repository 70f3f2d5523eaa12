// data_bench: can the data pipeline keep the encoder fed?
//
// Generates a synthetic data set with the tiny config's shapes (32x32 images, 16 tokens per
// image, seq_len 128, vocab 256) in a temporary directory, then measures on one core:
//   read_only  reading every sample's image files (the I/O floor),
//   tokenize   the text path alone (manifest record -> token sequence),
//   load       DataLoader::Load: read + decode + resize + normalise + tokenise,
//   one_image  what an encoder rank given one image of each sample reads: the tokens and that
//              image (DataLoader::LoadImage), with its ratio to load in the same run,
//   encoder    the tiny encoder's forward + backward over the same samples, in jobs of
//              global_batch / (waves x encoder dp) samples (1 for tiny), images stacked,
// and prints one JSON object per measurement plus a summary with the ratios
// load / encoder (must stay well above 1: loading must never be the bottleneck) and
// load / read_only. The encoder lines are absent when hetpar_encoder was not built.
//
//   data_bench [--samples=512] [--min_seconds=1.0] [--config=configs/tiny.yaml]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config/config.h"
#include "common/data/file_util.h"
#include "common/data/loader.h"
#include "common/data/synth.h"
#include "common/nn/communicator.h"
#include "encoder_service/encoder.h"

namespace hetpar::data {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Flags {
  int64_t samples = 512;
  double min_seconds = 1.0;
  std::string config = std::string(HETPAR_SOURCE_DIR) + "/configs/tiny.yaml";
};

bool ParseFlags(int argc, char** argv, Flags* flags) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const std::string& name) -> const char* {
      return arg.rfind(name + "=", 0) == 0 ? argv[i] + name.size() + 1 : nullptr;
    };
    if (const char* v = value("--samples")) {
      flags->samples = std::atoll(v);
    } else if (const char* v = value("--min_seconds")) {
      flags->min_seconds = std::atof(v);
    } else if (const char* v = value("--config")) {
      flags->config = v;
    } else {
      std::cerr << "data_bench: unknown flag " << arg
                << "; expected --samples=N --min_seconds=S --config=FILE\n";
      return false;
    }
  }
  return flags->samples >= 1 && flags->min_seconds > 0;
}

std::string Num(double v) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.4g", v);
  return buffer;
}

// Runs `pass` (one pass over every sample; returns false on an error) until min_seconds have
// passed; returns passes per second.
template <typename Pass>
double PassesPerSecond(double min_seconds, Pass pass) {
  int passes = 0;
  const Clock::time_point start = Clock::now();
  double elapsed = 0;
  do {
    if (!pass()) return -1;
    ++passes;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < min_seconds);
  return passes / elapsed;
}

int Run(const Flags& flags) {
  config::LoadOptions load;
  load.check_files = false;
  absl::StatusOr<config::LoadedRunSpec> spec = config::LoadRunSpecFile(flags.config, load);
  if (!spec.ok()) {
    std::cerr << "data_bench: " << spec.status().message() << "\n";
    return 2;
  }
  const hetpar::v1::RunSpec& s = spec->spec;
  std::string dir = (fs::temp_directory_path() / "hetpar_data_bench_XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) {
    std::cerr << "data_bench: cannot create a temporary directory\n";
    return 1;
  }
  SynthOptions synth = SynthOptionsForDirectory(dir);
  synth.samples = flags.samples;
  synth.val_samples = 0;
  synth.val_manifest.clear();
  synth.image_size = static_cast<int32_t>(s.encoder().model().image_size());
  synth.tokens_per_image = static_cast<int32_t>(config::TokensPerImage(s.encoder().model()));
  synth.seq_len = static_cast<int32_t>(s.llm().model().seq_len());
  synth.vocab_size = static_cast<int32_t>(s.llm().model().vocab());
  const Clock::time_point synth_start = Clock::now();
  absl::StatusOr<SynthReport> report = GenerateSyntheticDataset(synth);
  const double synth_seconds = std::chrono::duration<double>(Clock::now() - synth_start).count();
  if (!report.ok()) {
    std::cerr << "data_bench: " << report.status().message() << "\n";
    fs::remove_all(dir);
    return 1;
  }

  LoaderOptions options;
  options.manifest = synth.train_manifest;
  options.tokenizer = synth.tokenizer;
  options.image_size = synth.image_size;
  options.tokens_per_image = synth.tokens_per_image;
  options.seq_len = synth.seq_len;
  options.max_vocab = synth.vocab_size;
  absl::StatusOr<std::unique_ptr<DataLoader>> loader = DataLoader::Create(options);
  if (!loader.ok()) {
    std::cerr << "data_bench: " << loader.status().message() << "\n";
    fs::remove_all(dir);
    return 1;
  }
  const DataLoader& data = **loader;
  const int64_t n = data.size();
  const double images_per_sample = static_cast<double>(report->images) / n;
  const std::string head = absl::StrCat("{\"bench\":\"data\",\"samples\":", n,
                                        ",\"images_per_sample\":", Num(images_per_sample),
                                        ",\"image_size\":", synth.image_size, ",\"threads\":1");
  std::cout << head << ",\"what\":\"synth\",\"samples_per_s\":" << Num(n / synth_seconds) << "}"
            << std::endl;

  // read_only: the image files' bytes, nothing else.
  int64_t sink = 0;
  const double read_rate = PassesPerSecond(flags.min_seconds, [&] {
    for (int64_t i = 0; i < n; ++i) {
      for (const std::string& image : data.manifest().records[static_cast<size_t>(i)].images) {
        absl::StatusOr<std::string> bytes =
            ReadFileToString(data.manifest().ResolveImagePath(image));
        if (!bytes.ok()) return false;
        sink += static_cast<int64_t>(bytes->size());
      }
    }
    return true;
  });
  const double tokenize_rate = PassesPerSecond(flags.min_seconds, [&] {
    for (int64_t i = 0; i < n; ++i) {
      absl::StatusOr<TokenSequence> t = data.Tokenize(i);
      if (!t.ok()) return false;
      sink += t->length();
    }
    return true;
  });
  const double load_rate = PassesPerSecond(flags.min_seconds, [&] {
    for (int64_t i = 0; i < n; ++i) {
      absl::StatusOr<LoadedSample> sample = data.Load(i);
      if (!sample.ok()) {
        std::cerr << "data_bench: " << sample.status().message() << "\n";
        return false;
      }
      sink += sample->tokens.length() + static_cast<int64_t>(sample->images.size());
    }
    return true;
  });
  // one_image: what an encoder rank given one image of each sample reads: the sample's tokens
  // (checked against the index) and that image alone (DataLoader::LoadImage), where `load` is
  // what it read before (every image of the sample).
  const double one_image_rate = PassesPerSecond(flags.min_seconds, [&] {
    for (int64_t i = 0; i < n; ++i) {
      absl::StatusOr<TokenSequence> t = data.Tokenize(i);
      if (!t.ok()) return false;
      sink += t->length();
      if (t->images() == 0) continue;
      absl::StatusOr<std::vector<float>> image = data.LoadImage(i, 0);
      if (!image.ok()) {
        std::cerr << "data_bench: " << image.status().message() << "\n";
        return false;
      }
      sink += static_cast<int64_t>(image->size());
    }
    return true;
  });
  if (read_rate < 0 || tokenize_rate < 0 || load_rate < 0 || one_image_rate < 0) {
    fs::remove_all(dir);
    return 1;
  }
  const double read_sps = read_rate * n;
  const double tokenize_sps = tokenize_rate * n;
  const double load_sps = load_rate * n;
  std::cout << head << ",\"what\":\"read_only\",\"samples_per_s\":" << Num(read_sps) << "}"
            << std::endl;
  std::cout << head << ",\"what\":\"tokenize\",\"samples_per_s\":" << Num(tokenize_sps) << "}"
            << std::endl;
  std::cout << head << ",\"what\":\"load\",\"samples_per_s\":" << Num(load_sps)
            << ",\"images_per_s\":" << Num(load_sps * images_per_sample) << "}" << std::endl;
  std::cout << head << ",\"what\":\"one_image\",\"samples_per_s\":" << Num(one_image_rate * n)
            << ",\"over_load\":" << Num(one_image_rate / load_rate) << "}" << std::endl;

  std::string summary =
      absl::StrCat(head, ",\"what\":\"summary\",\"load_samples_per_s\":", Num(load_sps),
                   ",\"read_only_samples_per_s\":", Num(read_sps),
                   ",\"load_over_read_only\":", Num(load_sps / read_sps));

  {
    at::set_num_threads(1);
    // Samples per encoder job in this config: global_batch / (waves x encoder dp), waves =
    // global_batch / (micro_batch x llm dp).
    const int64_t llm_dp = std::max<int64_t>(1, s.llm().layout().dp());
    const int64_t enc_dp = std::max<int64_t>(1, s.encoder().layout().dp());
    const int64_t micro = std::max<int64_t>(1, s.run().micro_batch());
    const int64_t waves = std::max<int64_t>(1, s.run().global_batch() / (micro * llm_dp));
    const int64_t per_job = std::max<int64_t>(1, s.run().global_batch() / (waves * enc_dp));
    std::unique_ptr<nn::Communicator> single = nn::Communicator::CreateSingle();
    absl::StatusOr<encoder::EncoderOptions> encoder_options = encoder::EncoderOptionsFromSpec(s);
    if (!encoder_options.ok()) {
      std::cerr << "data_bench: " << encoder_options.status().message() << "\n";
      fs::remove_all(dir);
      return 1;
    }
    absl::StatusOr<std::unique_ptr<encoder::VisionEncoder>> model =
        encoder::VisionEncoder::Create(s.encoder().model(), *encoder_options, *single);
    if (!model.ok()) {
      std::cerr << "data_bench: " << model.status().message() << "\n";
      fs::remove_all(dir);
      return 1;
    }
    // Jobs of real decoded images, prepared before timing.
    std::vector<at::Tensor> jobs;
    const int64_t size = synth.image_size;
    for (int64_t first = 0; first < n; first += per_job) {
      std::vector<at::Tensor> images;
      for (int64_t i = first; i < std::min(n, first + per_job); ++i) {
        absl::StatusOr<LoadedSample> sample = data.Load(i);
        if (!sample.ok()) return 1;
        for (const std::vector<float>& image : sample->images) {
          images.push_back(at::from_blob(const_cast<float*>(image.data()), {3, size, size},
                                         at::TensorOptions().dtype(at::kFloat))
                               .clone());
        }
      }
      jobs.push_back(images.empty() ? at::Tensor() : at::stack(images));
    }
    bool ok = true;
    const double encoder_rate = PassesPerSecond(flags.min_seconds, [&] {
      for (const at::Tensor& job : jobs) {
        if (!job.defined()) continue;  // a job of text-only samples costs the encoder nothing
        absl::StatusOr<at::Tensor> out = (*model)->Forward(job);
        if (!out.ok()) {
          std::cerr << "data_bench: " << out.status().message() << "\n";
          ok = false;
          return false;
        }
        absl::Status back = (*model)->Backward(*out, at::ones_like(*out));
        if (!back.ok()) {
          std::cerr << "data_bench: " << back.message() << "\n";
          ok = false;
          return false;
        }
      }
      return true;
    });
    if (!ok || encoder_rate < 0) {
      fs::remove_all(dir);
      return 1;
    }
    const double encoder_sps = encoder_rate * n;
    std::cout << head << ",\"what\":\"encoder\",\"samples_per_job\":" << per_job
              << ",\"samples_per_s\":" << Num(encoder_sps)
              << ",\"images_per_s\":" << Num(encoder_sps * images_per_sample) << "}" << std::endl;
    absl::StrAppend(&summary, ",\"encoder_samples_per_s\":", Num(encoder_sps),
                    ",\"load_over_encoder\":", Num(load_sps / encoder_sps));
  }
  std::cout << summary << "}" << std::endl;
  volatile int64_t observed = sink;  // keeps the measured work from being optimised away
  (void)observed;
  fs::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace hetpar::data

int main(int argc, char** argv) {
  hetpar::data::Flags flags;
  if (!hetpar::data::ParseFlags(argc, argv, &flags)) return 2;
  return hetpar::data::Run(flags);
}
