// libhetpar_sentencepiece.so: sentencepiece behind the C interface of sentencepiece_bridge.h.
// Loaded by tokenizer.cc with dlopen; no Abseil header may be included here.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/data/sentencepiece_bridge.h"

struct HetparSpmProcessor {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

char* CopyOut(const char* data, size_t size) {
  char* out = static_cast<char*>(std::malloc(size + 1));
  if (out == nullptr) return nullptr;
  if (size > 0) std::memcpy(out, data, size);
  out[size] = '\0';
  return out;
}

int Report(const sentencepiece::util::Status& status, char** error) {
  if (status.ok()) return 0;
  if (error != nullptr) {
    const std::string message = status.error_message();
    *error = CopyOut(message.data(), message.size());
  }
  return static_cast<int>(status.code());
}

int Fail(int code, const char* message, char** error) {
  if (error != nullptr) *error = CopyOut(message, std::strlen(message));
  return code;
}

constexpr int kInternal = 13;
constexpr int kResourceExhausted = 8;

class VectorIterator : public sentencepiece::SentenceIterator {
 public:
  explicit VectorIterator(const std::vector<std::string>* sentences) : sentences_(sentences) {}
  bool done() const override { return next_ >= sentences_->size(); }
  void Next() override { ++next_; }
  const std::string& value() const override { return (*sentences_)[next_]; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  const std::vector<std::string>* sentences_;
  size_t next_ = 0;
};

int Load(const char* model, size_t model_size, HetparSpmProcessor** out, char** error) {
  auto* processor = new (std::nothrow) HetparSpmProcessor;
  if (processor == nullptr) return Fail(kResourceExhausted, "out of memory", error);
  const int code =
      Report(processor->processor.LoadFromSerializedProto(std::string(model, model_size)), error);
  if (code != 0) {
    delete processor;
    return code;
  }
  *out = processor;
  return 0;
}

void Destroy(HetparSpmProcessor* processor) { delete processor; }

int Encode(const HetparSpmProcessor* processor, const char* text, size_t text_size, int** ids,
           size_t* count, char** error) {
  std::vector<int> out;
  const int code =
      Report(processor->processor.Encode(std::string_view(text, text_size), &out), error);
  if (code != 0) return code;
  *count = out.size();
  *ids = static_cast<int*>(std::malloc(sizeof(int) * (out.empty() ? 1 : out.size())));
  if (*ids == nullptr) return Fail(kResourceExhausted, "out of memory", error);
  if (!out.empty()) std::memcpy(*ids, out.data(), sizeof(int) * out.size());
  return 0;
}

int Decode(const HetparSpmProcessor* processor, const int* ids, size_t count, char** text,
           size_t* text_size, char** error) {
  std::string out;
  const int code =
      Report(processor->processor.Decode(std::vector<int>(ids, ids + count), &out), error);
  if (code != 0) return code;
  *text = CopyOut(out.data(), out.size());
  if (*text == nullptr) return Fail(kResourceExhausted, "out of memory", error);
  *text_size = out.size();
  return 0;
}

int PieceSize(const HetparSpmProcessor* processor) { return processor->processor.GetPieceSize(); }

int IdToPiece(const HetparSpmProcessor* processor, int id, char** piece, size_t* piece_size) {
  if (id < 0 || id >= processor->processor.GetPieceSize()) return 3;  // InvalidArgument
  const std::string& p = processor->processor.IdToPiece(id);
  *piece = CopyOut(p.data(), p.size());
  if (*piece == nullptr) return kResourceExhausted;
  *piece_size = p.size();
  return 0;
}

int SpecialId(const HetparSpmProcessor* processor, int which) {
  switch (which) {
    case 0:
      return processor->processor.unk_id();
    case 1:
      return processor->processor.bos_id();
    case 2:
      return processor->processor.eos_id();
    case 3:
      return processor->processor.pad_id();
  }
  return -1;
}

int Train(const char* const* sentences, const size_t* sentence_sizes, size_t count,
          const char* const* keys, const char* const* values, size_t flags, char** model,
          size_t* model_size, char** error) {
  // The trainer keeps process-wide state (flags, log level): one training at a time.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::vector<std::string> corpus;
  corpus.reserve(count);
  for (size_t i = 0; i < count; ++i) corpus.emplace_back(sentences[i], sentence_sizes[i]);
  std::unordered_map<std::string, std::string> kwargs;
  for (size_t i = 0; i < flags; ++i) kwargs[keys[i]] = values[i];
  VectorIterator iterator(&corpus);
  std::string out;
  const int code =
      Report(sentencepiece::SentencePieceTrainer::Train(kwargs, &iterator, &out), error);
  if (code != 0) return code;
  if (out.empty()) return Fail(kInternal, "the trainer produced an empty model", error);
  *model = CopyOut(out.data(), out.size());
  if (*model == nullptr) return Fail(kResourceExhausted, "out of memory", error);
  *model_size = out.size();
  return 0;
}

void Release(void* buffer) { std::free(buffer); }

const HetparSpmApi kApi = {kHetparSpmApiVersion,
                           Load,
                           Destroy,
                           Encode,
                           Decode,
                           PieceSize,
                           IdToPiece,
                           SpecialId,
                           Train,
                           Release};

}  // namespace

extern "C" __attribute__((visibility("default"))) const HetparSpmApi* hetpar_spm_api(void) {
  return &kApi;
}
