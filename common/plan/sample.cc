#include "common/plan/sample.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace hetpar::plan {

bool operator==(const SampleDescriptor& a, const SampleDescriptor& b) {
  return a.id == b.id && a.text_tokens == b.text_tokens && a.loss_tokens == b.loss_tokens &&
         a.tokens_per_image == b.tokens_per_image && a.image_starts == b.image_starts &&
         a.id_checksum == b.id_checksum && a.token_checksum == b.token_checksum;
}

SampleDescriptor MakeSample(int64_t id, int64_t image_count, int64_t tokens_per_image,
                            int64_t text_tokens, int64_t loss_tokens) {
  SampleDescriptor sample;
  sample.id = id;
  sample.text_tokens = text_tokens;
  sample.loss_tokens = loss_tokens;
  sample.tokens_per_image = tokens_per_image;
  sample.image_starts.reserve(image_count);
  for (int64_t k = 0; k < image_count; ++k) sample.image_starts.push_back(k * tokens_per_image);
  return sample;
}

absl::Status ValidateSample(const SampleDescriptor& s, int64_t index, int64_t seq_len) {
  const std::string where = absl::StrCat("sample ", s.id, " (batch position ", index, ")");
  if (s.text_tokens < 0 || s.loss_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": text_tokens=", s.text_tokens,
                                                   " and loss_tokens=", s.loss_tokens,
                                                   " must be >= 0"));
  }
  if (s.loss_tokens > s.text_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": loss_tokens=", s.loss_tokens,
                                                   " is more than text_tokens=", s.text_tokens));
  }
  if (s.image_count() > 0 && s.tokens_per_image < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " has ", s.image_count(),
                     " images of tokens_per_image=", s.tokens_per_image, "; expected >= 1"));
  }
  const int64_t length = s.sequence_length();
  if (length > seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " is ", length, " tokens (", s.text_tokens, " text + ", s.image_count(),
        " images x ", s.tokens_per_image, "); expected at most llm seq_len=", seq_len));
  }
  int64_t next_free = 0;
  for (int64_t k = 0; k < s.image_count(); ++k) {
    const int64_t start = s.image_starts[k];
    if (start < next_free || start + s.tokens_per_image > length) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": image ", k, " starts at position ", start, " (", s.tokens_per_image,
          " tokens); expected a start >= ", next_free,
          " (after the previous image) with the image ending by the sequence length ", length));
    }
    next_free = start + s.tokens_per_image;
  }
  return absl::OkStatus();
}

absl::Status ValidateBatch(const std::vector<SampleDescriptor>& samples, int64_t seq_len) {
  // A sample may appear twice: a batch that crosses an epoch's end continues into the next
  // epoch's order, which can start with a sample the batch already holds. Everything the plan
  // routes is keyed by batch position, not by sample id.
  for (int64_t i = 0; i < static_cast<int64_t>(samples.size()); ++i) {
    if (absl::Status s = ValidateSample(samples[i], i, seq_len); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace hetpar::plan
