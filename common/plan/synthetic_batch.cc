#include "common/plan/synthetic_batch.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hetpar::plan {
namespace {

// Deterministic stream of values from one seed.
class SplitMix {
 public:
  explicit SplitMix(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    return Mix64(state_);
  }
  // Uniform in [lo, hi] (hi >= lo).
  int64_t Uniform(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>(Next() % span);
  }

 private:
  uint64_t state_;
};

}  // namespace

uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

uint64_t HashValues(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t h = Mix64(a + 0x9e3779b97f4a7c15ULL);
  h = Mix64(h ^ (b + 0x632be59bd9b4e019ULL));
  h = Mix64(h ^ (c + 0x85ebca6b3c5a1d27ULL));
  return Mix64(h ^ (d + 0xc2b2ae3d27d4eb4fULL));
}

absl::StatusOr<std::vector<SampleDescriptor>> SyntheticBatch(const SyntheticBatchOptions& o) {
  if (o.samples < 0 || o.min_images < 0 || o.max_images < o.min_images || o.min_text_tokens < 0 ||
      o.max_text_tokens < o.min_text_tokens || o.tokens_per_image < 1 || o.seq_len < 1 ||
      o.dataset_size < 0 || o.first_id < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic batch: expected samples >= 0, 0 <= min_images <= max_images, 0 <= "
        "min_text_tokens <= max_text_tokens, tokens_per_image >= 1, seq_len >= 1, first_id >= 0, "
        "dataset_size >= 0; got samples=",
        o.samples, " images=", o.min_images, "-", o.max_images, " text_tokens=", o.min_text_tokens,
        "-", o.max_text_tokens, " tokens_per_image=", o.tokens_per_image, " seq_len=", o.seq_len,
        " first_id=", o.first_id, " dataset_size=", o.dataset_size));
  }
  if (o.dataset_size > 0 && o.samples > o.dataset_size) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic batch: samples=", o.samples,
                                                   " is more than dataset_size=", o.dataset_size,
                                                   "; ids would repeat inside one batch"));
  }
  const int64_t min_length = o.min_text_tokens + o.min_images * o.tokens_per_image;
  if (min_length > o.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic batch: the smallest sample (", o.min_text_tokens, " text tokens + ",
                     o.min_images, " images x ", o.tokens_per_image, " tokens = ", min_length,
                     ") does not fit in seq_len=", o.seq_len));
  }
  std::vector<SampleDescriptor> samples;
  samples.reserve(o.samples);
  for (int64_t i = 0; i < o.samples; ++i) {
    int64_t id = o.first_id + i;
    if (o.dataset_size > 0) id %= o.dataset_size;
    SplitMix rng(HashValues(o.seed, static_cast<uint64_t>(id), 0x5a3b1e));
    int64_t images = rng.Uniform(o.min_images, o.max_images);
    int64_t text = rng.Uniform(o.min_text_tokens, o.max_text_tokens);
    if (text + images * o.tokens_per_image > o.seq_len) {
      text = std::max(o.min_text_tokens, o.seq_len - images * o.tokens_per_image);
    }
    while (images > o.min_images && text + images * o.tokens_per_image > o.seq_len) --images;
    SampleDescriptor s;
    s.id = id;
    s.text_tokens = text;
    s.loss_tokens = text > 0 ? rng.Uniform(1, text) : 0;
    s.tokens_per_image = o.tokens_per_image;
    // Cut the text into images + 1 segments: text before image 0, between images, after the last.
    std::vector<int64_t> cuts;
    cuts.reserve(images);
    for (int64_t k = 0; k < images; ++k) cuts.push_back(rng.Uniform(0, text));
    std::sort(cuts.begin(), cuts.end());
    s.image_starts.reserve(images);
    for (int64_t k = 0; k < images; ++k) s.image_starts.push_back(cuts[k] + k * o.tokens_per_image);
    samples.push_back(std::move(s));
  }
  return samples;
}

}  // namespace hetpar::plan
