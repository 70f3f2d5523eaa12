// What the coordinator needs to plan a step with one sample, without decoding any image: one
// record of the data index (index.h), as DataLoader::Describe computes it.
#ifndef HETPAR_COMMON_DATA_RECORD_H_
#define HETPAR_COMMON_DATA_RECORD_H_

#include <cstdint>
#include <string>
#include <vector>

namespace hetpar::data {

struct IndexRecord {
  std::string id;
  int64_t ordinal = 0;      // position among the manifest's readable records (DataLoader::Load)
  int64_t line = 0;         // 1-based line of a JSONL manifest, 0-based array index of a .json one
  int32_t image_count = 0;  // images in the sequence (after truncation, if any)
  int32_t tokens_per_image = 0;        // placeholder rows per image
  int32_t text_tokens = 0;             // sequence positions that are not image placeholders
  int32_t loss_tokens = 0;             // positions with loss (see sequence.h)
  std::vector<int32_t> image_offsets;  // where each image's placeholder rows start
  bool truncated = false;
  // TokenSequence::Checksum of the sample's sequence; 0: not recorded (an index written before
  // it was), not compared.
  uint32_t token_checksum = 0;

  // Sequence length: text and image placeholders together (<= seq_len).
  int32_t total_tokens() const { return text_tokens + image_count * tokens_per_image; }
  bool operator==(const IndexRecord& o) const {
    return id == o.id && ordinal == o.ordinal && line == o.line && image_count == o.image_count &&
           tokens_per_image == o.tokens_per_image && text_tokens == o.text_tokens &&
           loss_tokens == o.loss_tokens && image_offsets == o.image_offsets &&
           truncated == o.truncated && token_checksum == o.token_checksum;
  }
};

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_RECORD_H_
