// The C interface of hetpar's sentencepiece module (libhetpar_sentencepiece.so).
//
// Debian's libsentencepiece carries its own copy of protobuf (3.14) and exports its symbols; a
// process that also links the system libprotobuf (hetpar_proto does) would bind one library's
// protobuf calls to the other's and abort. So sentencepiece is never linked into a hetpar binary:
// sentencepiece_module.cc is built as a separate module, linked against libsentencepiece, and
// tokenizer.cc loads it with dlopen(RTLD_LOCAL | RTLD_DEEPBIND), which makes the module and
// libsentencepiece resolve their symbols among themselves first. Only plain C types cross this
// boundary. (RTLD_DEEPBIND is incompatible with AddressSanitizer builds.)
//
// sentencepiece_processor.h also declares `namespace absl { using std::string_view; }`, which
// collides with Abseil's absl::string_view: the module includes no Abseil header.
#ifndef HETPAR_COMMON_DATA_SENTENCEPIECE_BRIDGE_H_
#define HETPAR_COMMON_DATA_SENTENCEPIECE_BRIDGE_H_

#include <stddef.h>

extern "C" {

// A loaded sentencepiece model (opaque; owned by the module).
typedef struct HetparSpmProcessor HetparSpmProcessor;

// Every function returns a canonical status code (0 = OK, numerically absl::StatusCode); on an
// error *error receives a malloc'd NUL-terminated message the caller frees with `release`.
// Output buffers are malloc'd too and freed with `release`.
struct HetparSpmApi {
  int version;  // kHetparSpmApiVersion
  int (*load)(const char* model, size_t model_size, HetparSpmProcessor** out, char** error);
  void (*destroy)(HetparSpmProcessor* processor);
  int (*encode)(const HetparSpmProcessor* processor, const char* text, size_t text_size, int** ids,
                size_t* count, char** error);
  int (*decode)(const HetparSpmProcessor* processor, const int* ids, size_t count, char** text,
                size_t* text_size, char** error);
  int (*piece_size)(const HetparSpmProcessor* processor);
  // The piece of `id` (0 <= id < piece_size), malloc'd.
  int (*id_to_piece)(const HetparSpmProcessor* processor, int id, char** piece, size_t* piece_size);
  // which: 0 unk, 1 bos, 2 eos, 3 pad; -1 when the model has none.
  int (*special_id)(const HetparSpmProcessor* processor, int which);
  // Trains on `count` sentences with trainer flags keys[i]=values[i] (sentencepiece's names).
  int (*train)(const char* const* sentences, const size_t* sentence_sizes, size_t count,
               const char* const* keys, const char* const* values, size_t flags, char** model,
               size_t* model_size, char** error);
  void (*release)(void* buffer);
};

// The module's one exported symbol.
const HetparSpmApi* hetpar_spm_api(void);
typedef const HetparSpmApi* (*HetparSpmApiFn)(void);

}  // extern "C"

inline constexpr int kHetparSpmApiVersion = 1;

#endif  // HETPAR_COMMON_DATA_SENTENCEPIECE_BRIDGE_H_
