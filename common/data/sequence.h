// One sample's token sequence: image placeholders expanded, next-token labels and the loss mask.
//
// A sequence is built from segments in order: runs of text token ids, each flagged as a loss run
// or not, and images. The convention (the LLM trainer relies on it):
//   input_ids  = the segments' ids in order, where each image is `tokens_per_image` copies of the
//                image placeholder id (the encoder's output rows for that image replace those
//                positions; image_offsets[k] is where image k's rows start). For a prompt and a
//                response: [bos] prompt... response... [eos].
//   labels[i]  = input_ids[i + 1] where loss_mask[i] = 1, else kIgnoreLabel. The shift is
//                already applied: position i is trained to predict the token at i + 1.
//   loss_mask[i] = 1 exactly when input_ids[i + 1] is a token of a loss segment (for a prompt
//                and a response: a response text token or the final eos; for a conversation: an
//                assistant turn's tokens and its end-of-turn marker, see chat_template.h).
//                Image placeholders never carry loss, nor does the last position (nothing
//                follows it).
//   loss_tokens = sum(loss_mask), the count that N_global sums.
// A sequence longer than seq_len is rejected, or (truncate) cut to its first seq_len tokens; an
// image block never straddles the cut: an image that does not fit whole is dropped together with
// everything after it, so `images` can be smaller than the sample's image count.
#ifndef HETPAR_COMMON_DATA_SEQUENCE_H_
#define HETPAR_COMMON_DATA_SEQUENCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace hetpar::data {

inline constexpr int32_t kIgnoreLabel = -100;

enum class OverlongPolicy { kReject, kTruncate };

// A run of the sample's text: either text token ids or one image.
struct Segment {
  bool is_image = false;
  std::vector<int32_t> ids;  // text token ids; empty for an image
  bool loss = false;         // text tokens that are training targets (ignored for an image)
};

struct SequenceOptions {
  int32_t tokens_per_image = 0;
  int32_t seq_len = 0;
  OverlongPolicy overlong = OverlongPolicy::kReject;
  int32_t image_token_id = -1;  // placeholder id written at image positions
  // Used by the prompt/response form only (the segment form takes bos and eos as segments).
  int32_t bos_id = -1;  // < 0: no bos
  int32_t eos_id = -1;  // < 0: no eos (then loss_tokens = response text tokens)
};

struct TokenSequence {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> labels;
  std::vector<uint8_t> loss_mask;
  std::vector<int32_t> image_offsets;  // start of each kept image's placeholder block
  int32_t text_tokens = 0;             // positions that are not image placeholders
  int32_t loss_tokens = 0;
  bool truncated = false;

  int32_t length() const { return static_cast<int32_t>(input_ids.size()); }
  int32_t images() const { return static_cast<int32_t>(image_offsets.size()); }
  // CRC-32 of the token ids and the loss mask (ids as 4 little-endian bytes each, then one byte
  // per mask entry), never 0 (a 0 is taken as 1): what a sample trains on, beyond its shape. Two
  // tokenizers that give a sample the same lengths but other ids (another bos, a revised vocab)
  // differ in it.
  uint32_t Checksum() const;
};

// Builds the sequence of `segments`, in order; a text segment's tokens are targets when its
// `loss` is set (options.bos_id and eos_id are not used: bos and eos are segments here). Errors
// are InvalidArgument with the reason only (the caller adds the sample id and path):
//   - the sequence is longer than seq_len and overlong = reject,
//   - no token carries loss, or truncation would leave none,
//   - options out of range.
absl::StatusOr<TokenSequence> BuildTokenSequence(const std::vector<Segment>& segments,
                                                 const SequenceOptions& options);

// The prompt/response form: [bos] prompt response [eos] with loss on the response's text
// segments and the eos (bos and eos from options, left out when < 0); the `loss` flags of the
// given segments are ignored. Either part may hold images.
absl::StatusOr<TokenSequence> BuildTokenSequence(const std::vector<Segment>& prompt,
                                                 const std::vector<Segment>& response,
                                                 const SequenceOptions& options);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_SEQUENCE_H_
