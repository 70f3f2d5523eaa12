// Reading and writing the safetensors format of Hugging Face checkpoints, beside hetpar's own
// parameter file (export.h): how weights come in from and go out to the Python ecosystem.
//
//   HETPAR_ASSIGN_OR_RETURN(auto weights, nn::ReadSafetensorsDirectory("models/tinyllama-1.1b"));
//   const at::Tensor& embed = weights.at("model.embed_tokens.weight");
//
// File layout (https://github.com/huggingface/safetensors):
//
//   [0, 8)        u64 little-endian N, the header's length in bytes
//   [8, 8 + N)    UTF-8 JSON object: tensor name -> {"dtype": "F32", "shape": [2, 3],
//                 "data_offsets": [begin, end]}, and an optional "__metadata__" object of
//                 string -> string. Writers pad it with spaces (this one to a multiple of 8).
//   [8 + N, ...)  the data buffer: each tensor's bytes, row-major, contiguous, little-endian, at
//                 [begin, end) relative to the buffer's start. The ranges tile the buffer exactly
//                 (no holes, no overlaps, nothing after the last), in any order in the JSON.
//
// dtypes: F32, F64, BF16, F16, I64, I32, I16, I8, U8 and BOOL (at::kFloat, kDouble, kBFloat16,
// kHalf, kLong, kInt, kShort, kChar, kByte, kBool). The other safetensors dtypes (F8_*, U16, U32,
// U64, complex) are rejected: no checkpoint hetpar imports holds them. This build runs on
// little-endian hosts only, so tensor bytes are copied as they are.
//
// Every error names the file and, where there is one, the tensor.
#ifndef HETPAR_COMMON_NN_SAFETENSORS_H_
#define HETPAR_COMMON_NN_SAFETENSORS_H_

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hetpar::nn {

struct SafetensorsTensor {
  std::string name;
  at::Tensor tensor;
};

struct SafetensorsFile {
  std::vector<SafetensorsTensor> tensors;       // in data-offset order
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// One .safetensors file, mapped (mmap) and copied tensor by tensor into contiguous CPU tensors
// of the file's dtypes; the mapping is gone when it returns. Errors:
//   NotFound         the file does not exist (other open/stat/mmap failures follow errno,
//                    common/errno_status.h);
//   InvalidArgument  not a regular file; a header that is not a JSON object; an entry that is not
//                    an object or lacks "dtype", "shape" or "data_offsets"; an unknown dtype
//                    (named with its value); a negative or non-integer dim; a non-string
//                    "__metadata__" value; a name given twice in the header;
//   DataLoss         a file shorter than 8 bytes or than its header says (truncated data); a
//                    header length beyond the file or above 100 MB; data offsets out of range,
//                    overlapping, leaving a hole, or not matching shape x dtype size; a BOOL
//                    byte other than 0 or 1.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// A Hugging Face checkpoint directory: `model.safetensors`, or else the shards listed by
// `model.safetensors.index.json` ("weight_map": name -> shard file name in `dir`), as
// transformers looks for them. Returns every tensor of the file or of the shards by name
// (a tensor of a shard that the index does not list is included). Errors:
//   NotFound         the directory has neither file; a shard the index names is missing;
//   InvalidArgument  an index that is not JSON or has no "weight_map" object of string -> string;
//                    a shard name that is absolute or climbs out of `dir` ("..");
//   DataLoss         a tensor in the index but missing from its shard (naming the tensor, the
//                    shard and the index); a tensor in two shards (naming both);
//   and any error of ReadSafetensors for a shard.
absl::StatusOr<std::map<std::string, at::Tensor>> ReadSafetensorsDirectory(const std::string& dir);

// Writes `tensors` (any of the dtypes above, any strides: written contiguous; in this order in
// the data buffer) and `metadata` (as "__metadata__", omitted when empty) to `path`, the header
// padded with spaces to a multiple of 8, through AtomicFileWriter (common/atomic_file.h), which
// creates missing parent directories: a reader sees the old file or the whole new one, and a
// failed write leaves nothing at `path`. Errors:
//   InvalidArgument  an empty or repeated name, the name "__metadata__", an undefined tensor, an
//                    unsupported dtype, a name or metadata string that is not valid UTF-8;
//   write errors (errno_status.h) naming the path.
absl::Status WriteSafetensors(const std::vector<SafetensorsTensor>& tensors,
                              const std::string& path,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_SAFETENSORS_H_
