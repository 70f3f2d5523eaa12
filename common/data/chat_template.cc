#include "common/data/chat_template.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hetpar::data {
namespace {

using Kind = ChatPart::Kind;

const char* RoleName(ChatRole role) {
  switch (role) {
    case ChatRole::kSystem:
      return "system";
    case ChatRole::kUser:
      return "user";
    case ChatRole::kAssistant:
      return "assistant";
  }
  return "user";
}

// Appends parts; a builder so that the templates below read like their strings.
class PartList {
 public:
  void Content(const std::string& text, bool loss) {
    parts_.push_back({Kind::kContent, text, loss});
  }
  void Marker(std::string text, bool loss = false) {
    parts_.push_back({Kind::kMarker, std::move(text), loss});
  }
  void Bos() { parts_.push_back({Kind::kBos, "", false}); }
  void Eos() { parts_.push_back({Kind::kEos, "", true}); }
  std::vector<ChatPart> Take() { return std::move(parts_); }

 private:
  std::vector<ChatPart> parts_;
};

void Plain(const std::vector<ChatTurn>& turns, PartList* out) {
  out->Bos();
  for (const ChatTurn& turn : turns) {
    const bool assistant = turn.role == ChatRole::kAssistant;
    out->Content(turn.text, assistant);
    if (assistant) out->Eos();
  }
}

// LLaVA-1.5 conv_vicuna_v1: SeparatorStyle.TWO, sep " ", sep2 "</s>", roles USER / ASSISTANT.
void Vicuna(const std::vector<ChatTurn>& turns, PartList* out) {
  out->Bos();
  size_t first = 0;
  if (!turns.empty() && turns[0].role == ChatRole::kSystem) {
    out->Content(turns[0].text, false);
    first = 1;
  } else {
    out->Content(kVicunaSystemPrompt, false);
  }
  bool after_system = true;
  for (size_t i = first; i < turns.size(); ++i) {
    const ChatTurn& turn = turns[i];
    switch (turn.role) {
      case ChatRole::kAssistant:
        out->Marker(" ASSISTANT: ");
        out->Content(turn.text, true);
        out->Eos();  // "</s>", which LLaMA's tokenizer turns into its eos id
        break;
      case ChatRole::kUser:
      case ChatRole::kSystem:
        out->Marker(after_system ? " USER: " : "USER: ");
        out->Content(turn.text, false);
        break;
    }
    after_system = false;
  }
}

void Llama3(const std::vector<ChatTurn>& turns, PartList* out) {
  out->Marker("<|begin_of_text|>");
  for (const ChatTurn& turn : turns) {
    const bool assistant = turn.role == ChatRole::kAssistant;
    out->Marker("<|start_header_id|>");
    out->Marker(RoleName(turn.role));
    out->Marker("<|end_header_id|>");
    out->Marker("\n\n");
    out->Content(turn.text, assistant);
    out->Marker("<|eot_id|>", assistant);
  }
}

void Chatml(const std::vector<ChatTurn>& turns, PartList* out) {
  for (const ChatTurn& turn : turns) {
    const bool assistant = turn.role == ChatRole::kAssistant;
    out->Marker("<|im_start|>");
    out->Marker(absl::StrCat(RoleName(turn.role), "\n"));
    out->Content(turn.text, assistant);
    out->Marker("<|im_end|>", assistant);
    out->Marker("\n");
  }
}

}  // namespace

absl::StatusOr<ChatTemplate> ParseChatTemplate(std::string_view name) {
  if (name.empty() || name == "plain") return ChatTemplate::kPlain;
  if (name == "vicuna") return ChatTemplate::kVicuna;
  if (name == "llama3") return ChatTemplate::kLlama3;
  if (name == "chatml") return ChatTemplate::kChatml;
  return absl::InvalidArgumentError(absl::StrCat("data.chat_template='", std::string(name),
                                                 "' is not one of: plain, vicuna, llama3, chatml"));
}

const char* ChatTemplateName(ChatTemplate chat_template) {
  switch (chat_template) {
    case ChatTemplate::kPlain:
      return "plain";
    case ChatTemplate::kVicuna:
      return "vicuna";
    case ChatTemplate::kLlama3:
      return "llama3";
    case ChatTemplate::kChatml:
      return "chatml";
  }
  return "plain";
}

std::vector<ChatPart> ApplyChatTemplate(ChatTemplate chat_template,
                                        const std::vector<ChatTurn>& turns) {
  PartList parts;
  switch (chat_template) {
    case ChatTemplate::kPlain:
      Plain(turns, &parts);
      break;
    case ChatTemplate::kVicuna:
      Vicuna(turns, &parts);
      break;
    case ChatTemplate::kLlama3:
      Llama3(turns, &parts);
      break;
    case ChatTemplate::kChatml:
      Chatml(turns, &parts);
      break;
  }
  return parts.Take();
}

absl::StatusOr<EncodedChat> EncodeChatParts(const std::vector<ChatPart>& parts,
                                            const Tokenizer& tokenizer,
                                            std::string_view image_token) {
  EncodedChat out;
  // Appends the tokens of `text` as one text segment (nothing when it encodes to no token).
  auto append_text = [&](std::string_view text, bool loss) -> absl::Status {
    if (text.empty()) return absl::OkStatus();
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(text);
    if (!ids.ok()) return ids.status();
    if (ids->empty()) return absl::OkStatus();
    out.segments.push_back(Segment{false, std::move(*ids), loss});
    return absl::OkStatus();
  };
  auto append_id = [&](int32_t id, bool loss) {
    if (id >= 0) out.segments.push_back(Segment{false, {id}, loss});
  };
  for (const ChatPart& part : parts) {
    switch (part.kind) {
      case Kind::kBos:
        append_id(tokenizer.bos_id(), part.loss);
        break;
      case Kind::kEos:
        append_id(tokenizer.eos_id(), part.loss);
        break;
      case Kind::kMarker: {
        if (std::optional<int32_t> id = tokenizer.PieceId(part.text)) {
          append_id(*id, part.loss);
        } else if (absl::Status s = append_text(part.text, part.loss); !s.ok()) {
          return s;
        }
        break;
      }
      case Kind::kContent: {
        std::string_view text = part.text;
        while (true) {
          const size_t found =
              image_token.empty() ? std::string_view::npos : text.find(image_token);
          if (absl::Status s = append_text(text.substr(0, found), part.loss); !s.ok()) return s;
          if (found == std::string_view::npos) break;
          out.segments.push_back(Segment{true, {}, false});
          ++out.image_placeholders;
          text.remove_prefix(found + image_token.size());
        }
        break;
      }
    }
  }
  return out;
}

}  // namespace hetpar::data
