// Full-model export and import: one file holding a module's full (unsliced) parameters, written
// from any TP size and loaded into any other.
//
//   HETPAR_RETURN_IF_ERROR(nn::SaveFullParameters(llm->parameters(), *tp, "out/llm.hpar"));
//   ...                                                    // later, at another TP size
//   HETPAR_RETURN_IF_ERROR(nn::LoadFullParameters(llm->parameters(), "out/llm.hpar"));
//
// The file holds weights only (no gradients, no optimizer state): it is an export of a trained
// model, not a resumable checkpoint.
//
// File layout (version 1). Integers are little-endian; tensor bytes are the host's (this build
// runs on little-endian machines only), row-major, contiguous.
//
//   header, 32 bytes:
//     [0, 8)    magic "HETPARAM"
//     [8, 12)   u32 version = 1
//     [12, 16)  u32 flags = 0
//     [16, 24)  u64 number of entries
//     [24, 28)  u32 CRC-32 (zlib's) of bytes [0, 24)
//     [28, 32)  u32 zero
//   then one entry per parameter, in the ParameterSet's registration order:
//     u32 name length (1..65536), the name's bytes
//     u8 dtype: 1 float32, 2 float64, 3 bfloat16, 4 float16
//     u8 number of dims (0..16), u16 zero
//     i64 full size of each dim
//     u64 data bytes (= elements x element size)
//     the full tensor's bytes
//     u32 CRC-32 of every byte of the entry before it
//   and nothing after the last entry.
//
// Writes go through AtomicFileWriter (common/atomic_file.h): a temporary file beside `path`,
// fsynced and renamed over it, so a reader sees the old file or the whole new one.
#ifndef HETPAR_COMMON_NN_EXPORT_H_
#define HETPAR_COMMON_NN_EXPORT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/atomic_file.h"
#include "common/nn/communicator.h"
#include "common/nn/parameters.h"

namespace hetpar::nn {

// Every rank of `tp` calls it with its own slice of the same ParameterSet. Each full tensor is
// gathered (GatherFullTensor, one parameter at a time, so rank 0 holds at most one full tensor
// besides its slices) and TP rank 0 writes `path`, creating missing parent directories. Every
// rank returns the same outcome: rank 0's write error, or FailedPrecondition on the other ranks
// naming the path. A failed write leaves any previous file at `path` untouched.
absl::Status SaveFullParameters(const ParameterSet& params, Communicator& tp,
                                const std::string& path);

// Reads `path` and copies this rank's slice (split_dim, offset, length of each entry of
// `params`) of every full tensor into the local tensors, whatever the TP size that saved it. The
// file's dtype is converted to the model's (bit-exact when they are equal). The file and the
// model must hold the same parameter names with the same full shapes. Errors name the file and
// the parameter: NotFound (the file or a parameter missing from it), InvalidArgument (a shape
// mismatch, a parameter the model lacks, not a parameter file), DataLoss (truncated, a failed
// checksum, malformed). On any error the parameters are left unchanged. Gradients are untouched.
absl::Status LoadFullParameters(ParameterSet& params, const std::string& path);

// What a parameter file is to the model loading it.
enum class FileScope {
  kWholeModel,  // the file holds exactly the model's parameters
  // The model is a part of the file's (a pipeline stage of the model the file holds): entries
  // the model lacks are skipped; every parameter of the model must still be in the file.
  kModelIsPart,
};
// Whether a parameter name is one of the whole model's, of which the loading model is a part
// (LanguageModel::WholeModelHas).
using WholeModelHas = std::function<bool(std::string_view name)>;
// With kModelIsPart and `whole_model_has`, an entry the part lacks is skipped only where the
// whole model has it; any other (a layer past the model's last, from a larger model's file) is
// InvalidArgument naming it, as kWholeModel has it.
absl::Status LoadFullParameters(ParameterSet& params, const std::string& path, FileScope scope,
                                const WholeModelHas& whole_model_has = nullptr);

// LoadFullParameters for a RunSpec field naming the file a run starts from (encoder.init_from,
// llm.init_from): its errors begin with the field and keep their code.
absl::Status LoadInitialParameters(ParameterSet& params, const std::string& field,
                                   const std::string& path,
                                   FileScope scope = FileScope::kWholeModel,
                                   const WholeModelHas& whole_model_has = nullptr);

// One entry of a parameter file with its full tensor (checksum verified).
struct FullParameter {
  std::string name;
  at::Tensor tensor;  // full shape, the dtype it was saved in
};

// Every entry of `path`, in file order; the same errors as LoadFullParameters for the file.
absl::StatusOr<std::vector<FullParameter>> ReadFullParameters(const std::string& path);

// The dtype of an entry's dtype code (1 float32, 2 float64, 3 bfloat16, 4 float16); false for
// an unknown code.
bool DtypeOfCode(uint8_t code, at::ScalarType* dtype);

// Where one entry lies in a parameter file: the byte offset of its name-length field and its
// size through its trailing CRC-32, so [offset, offset + bytes) is the whole entry; and the
// CRC-32 of each kDataBlockBytes block of its tensor data (the last one possibly short), summed
// in the pass that sums the entry's own CRC-32.
inline constexpr int64_t kDataBlockBytes = int64_t{1} << 20;
struct EntryRange {
  int64_t offset = 0;
  int64_t bytes = 0;
  std::vector<uint32_t> block_crc32;
};

// Writes `params` (full tensors, in this order) to `path` as SaveFullParameters does, from one
// process: how the pipeline stages' files of a model are joined into one. InvalidArgument for an
// empty, overlong or repeated name; write errors name the path.
// `written`, when given, receives the file's size and zlib CRC-32, summed while it was written;
// `entries`, when given, where each of `params` lies in the file (in the order of `params`). Both
// are set only when the file is committed.
absl::Status WriteFullParameters(const std::vector<FullParameter>& params, const std::string& path,
                                 WrittenFile* written = nullptr,
                                 std::vector<EntryRange>* entries = nullptr);

}  // namespace hetpar::nn

#endif  // HETPAR_COMMON_NN_EXPORT_H_
