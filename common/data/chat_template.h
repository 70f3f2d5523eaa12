// Chat templates: how a conversation (system, user and assistant turns) becomes one token
// sequence, and which of its tokens carry loss.
//
// ApplyChatTemplate is pure: it turns (template, turns) into a list of parts, each a piece of
// text (or the tokenizer's bos or eos id) with a flag saying whether it is trained on. Loss is on
// each assistant turn's text and on the end-of-turn marker that closes it, never on role headers,
// system or user text, image placeholders or bos. EncodeChatParts then turns the parts into
// sequence segments (sequence.h) with a tokenizer, one part at a time:
//
//   - kContent (a turn's text, as written in the manifest): split at each image placeholder
//     (data.image_token); every piece between placeholders is encoded on its own and each
//     placeholder becomes an image segment (never trained on);
//   - kMarker (a template string such as " USER: ", "<|im_start|>" or "\n"): one id when the
//     whole string is one piece of the tokenizer (a special or user-defined token, e.g.
//     "<|im_end|>" in a Qwen tokenizer), otherwise encoded like any text (hetpar's synthetic
//     tokenizer splits "<|im_end|>" into several pieces, which still trains);
//   - kBos, kEos: the tokenizer's bos / eos id (Tokenizer::bos_id, eos_id), left out when the
//     tokenizer has none.
//
// Since parts are encoded separately, a part boundary is always a token boundary (a
// sentencepiece model adds its word-start mark at the start of every part). Templates, for the
// turns system S (optional), user U1, assistant A1, user U2, assistant A2; [x] is a loss part:
//
//   plain:   <bos> S U1 [A1] [<eos>] U2 [A2] [<eos>]
//            (one user and one assistant turn give exactly the sequence of a prompt/text record
//            with prompt = U1 and text = A1)
//   vicuna:  <bos> S " USER: " U1 " ASSISTANT: " [A1] [<eos>] "USER: " U2 " ASSISTANT: " [A2]
//            [<eos>]   (LLaVA-1.5 "v1"; S defaults to kVicunaSystemPrompt; its "</s>" is the eos
//            id)
//   llama3:  "<|begin_of_text|>" then per turn "<|start_header_id|>" ROLE "<|end_header_id|>"
//            "\n\n" TEXT "<|eot_id|>", ROLE = system, user or assistant; loss on an assistant
//            TEXT and its "<|eot_id|>". The bos is the string "<|begin_of_text|>", not bos_id.
//   chatml:  per turn "<|im_start|>" ROLE"\n" TEXT "<|im_end|>" "\n" (Qwen); loss on an
//            assistant TEXT and its "<|im_end|>". No bos, no default system prompt.
#ifndef HETPAR_COMMON_DATA_CHAT_TEMPLATE_H_
#define HETPAR_COMMON_DATA_CHAT_TEMPLATE_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/sequence.h"
#include "common/data/tokenizer.h"

namespace hetpar::data {

enum class ChatTemplate { kPlain, kVicuna, kLlama3, kChatml };

// "plain" (also ""), "vicuna", "llama3", "chatml"; InvalidArgument naming the value otherwise.
absl::StatusOr<ChatTemplate> ParseChatTemplate(std::string_view name);
const char* ChatTemplateName(ChatTemplate chat_template);

// LLaVA-1.5's conversation system prompt (conv_vicuna_v1), used by `vicuna` when the
// conversation has no system turn.
inline constexpr char kVicunaSystemPrompt[] =
    "A chat between a curious human and an artificial intelligence assistant. The assistant "
    "gives helpful, detailed, and polite answers to the human's questions.";

enum class ChatRole { kSystem, kUser, kAssistant };

struct ChatTurn {
  ChatRole role = ChatRole::kUser;
  std::string text;  // may hold image placeholders

  bool operator==(const ChatTurn& o) const { return role == o.role && text == o.text; }
};

struct ChatPart {
  enum class Kind { kContent, kMarker, kBos, kEos };
  Kind kind = Kind::kContent;
  std::string text;   // empty for kBos and kEos
  bool loss = false;  // the part's tokens are training targets

  bool operator==(const ChatPart& o) const {
    return kind == o.kind && text == o.text && loss == o.loss;
  }
};

// The parts of `turns` under `chat_template`. Expects a conversation as the manifest checks it:
// an optional leading system turn, then user and assistant turns alternating, ending on an
// assistant turn (other orders are rendered turn by turn all the same).
std::vector<ChatPart> ApplyChatTemplate(ChatTemplate chat_template,
                                        const std::vector<ChatTurn>& turns);

struct EncodedChat {
  std::vector<Segment> segments;  // text segments carry their part's loss flag
  int image_placeholders = 0;     // image segments, = placeholders found in content parts
};

// Encodes `parts` with `tokenizer` as described above; `image_token` splits content parts.
// Errors are the tokenizer's.
absl::StatusOr<EncodedChat> EncodeChatParts(const std::vector<ChatPart>& parts,
                                            const Tokenizer& tokenizer,
                                            std::string_view image_token);

}  // namespace hetpar::data

#endif  // HETPAR_COMMON_DATA_CHAT_TEMPLATE_H_
