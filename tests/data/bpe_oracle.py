#!/usr/bin/env python3
"""The Hugging Face oracle of hetpar's byte-level BPE tokenizer (common/data/bpe_tokenizer_test.cc).

Usage: bpe_oracle.py OUT_DIR

Trains small byte-level BPE tokenizers with the `tokenizers` library and writes, for each, a folder
under OUT_DIR holding what hetpar must reproduce, as computed by `transformers` and `tokenizers`:

  llama3/             Llama-3 style: Sequence[Split(<Llama 3 regex>, isolated),
                      ByteLevel(no regex)], ignore_merges (every tenth merge dropped, so that it
                      matters), merges written as "a b" strings (as Meta's files have them), the
                      Llama 3 special tokens added after the learned vocabulary, and a
                      tokenizer_config.json naming bos (a string) and eos (an AddedToken object),
                      with added_tokens_decoder.
  gpt2/               GPT-2 / Qwen style: a lone ByteLevel(use_regex=true), merges as ["a", "b"]
                      pairs, <|endoftext|> inside the model vocabulary, and added tokens with every
                      flag: lstrip, rstrip, single_word, normalized, non-special, a token already in
                      the vocabulary, tokens that are prefixes of each other. No
                      tokenizer_config.json.
  gpt2_prefix_space/  gpt2's model and added tokens with ByteLevel(add_prefix_space=true), and a
                      tokenizer_config.json with "bos_token": null.
  gpt2_escapes/       gpt2's model and added tokens behind Sequence[Split(r"\h+|\w+|\s+|\W"),
                      ByteLevel(no regex)]: the escapes whose meaning differs between Oniguruma
                      (the library's engine) and PCRE2 (hetpar's).
  gpt2_unk/           gpt2 without the byte-level characters of "q", "Z" and the bytes 0xF0, 0x9F
                      (renamed, so that ids stay put; the merges that use them dropped), with
                      unk_token <|endoftext|> and fuse_unk: bytes missing from the vocabulary.

Each folder gets:
  tokenizer.json, [tokenizer_config.json]
  encode.jsonl  one record per text: {"text", "ids", "decoded", "decoded_skip"}: the ids of
                PreTrainedTokenizerFast(tokenizer_file=...).encode(text, add_special_tokens=False)
                and decode(ids) with skip_special_tokens False / True.
  decode.jsonl  random id lists (cut UTF-8 sequences, special tokens): {"ids", "decoded",
                "decoded_skip"}.
  meta.json     {"vocab_size": largest id + 1, "pieces": [[id, token], ...] for every id,
                "special_ids": {"bos", "eos", "pad", "unk"} (-1 for none), "special_ids_from"}.

Everything is deterministic: fixed seeds, fixed fragment lists, single-threaded training.
Exits 3 with a message naming deploy/install-deps.sh when transformers or tokenizers is missing.
"""

import json
import os
import random
import sys

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"

try:
    import tokenizers
    import transformers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError as e:  # the test fails (not skips) on this message
    print(
        f"bpe_oracle.py: cannot import the Hugging Face libraries ({e}); "
        "run deploy/install-deps.sh to install transformers and tokenizers into .venv",
        file=sys.stderr,
    )
    sys.exit(3)

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<image>",
]
# The added tokens of the gpt2 tokenizer, one per behaviour of the HF added vocabulary.
GPT2_ADDED = [
    AddedToken("<mask>", lstrip=True, normalized=False, special=True),
    AddedToken("[SEP]", rstrip=True, normalized=False, special=True),
    AddedToken("hetpar", single_word=True, normalized=True, special=False),
    AddedToken("the", single_word=True, normalized=True, special=False),  # already in the vocab
    AddedToken("<|tool|>", normalized=False, special=True),
    AddedToken("<|tool|>_call", normalized=True, special=False),  # loses to <|tool|> (first pass)
    AddedToken("<|fim|>", normalized=False, special=False),
    AddedToken("<|fim|><|fim|>", normalized=False, special=False),  # longest match wins
    AddedToken(" spaced token ", normalized=False, special=False),  # decodes from raw bytes
    AddedToken("café", normalized=False, special=False),  # "é" is a byte-level character
]

ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll like it; we've tried, they'd agree, and it's DONE.",
    "DON'T PANIC! You'RE fine, WE'LL see, SHE'S here, I'D go, THEY'VE left, I'M in.",
    "Hello, world! How are you doing today?",
    "A tokenizer turns text into integers, and back again -- losslessly.",
    "the theory of the thesis: the other theme",
    "hetpar trains hetpar's models; xhetpar and hetparx are not hetpar.",
    "Rock 'n' roll isn't dead, 'tis said, o'clock, y'all, ma'am.",
    "It costs $19.99 (or €17,50) -- 20% off!",
    "naïve café résumé coöperate façade jalapeño",
    "Combining: e\u0301 a\u0300 n\u0303 and precomposed: é à ñ",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!???...,,,;;;:::---___***",
    "E-mail: someone@example.com, URL: https://example.com/a/b?c=d&e=f#g",
    "**bold** _italic_ `code` [link](http://x.y) > quote",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D 'ſ",
    "snake_case tie‿bar deadBEEF 0xC0FFEE Ⅻ½ ٣ e\u0301",
]
CODE = [
    "def foo(x):\n\tif x > 0:\n\t\treturn x * 2\n\treturn -x\n",
    "for (int i = 0; i < n; ++i) {\r\n    sum += a[i];\r\n}\r\n",
    "class Foo:\n    def __init__(self):\n        self.bar = {'a': 1, \"b\": [2, 3]}\n",
    "#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; return v.size(); }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "    indented by four\n        by eight\n\t\tby two tabs\n",
    "x=1;y=2;z=x+y  # comment\n",
    "if (a && b || !c) { return a->b.c[0]; }",
]
NUMBERS = [
    "1234567",
    "3.14159",
    "-42",
    "1,000,000",
    "0x1F 0b1010 0o777",
    "2024-06-01T12:30:45Z",
    "1e-9 6.022e23",
    "12345678901234567890",
    "v1.2.3-rc4",
    "٣٤٥ ١٢ ४२ 四十二 Ⅻ ½ ²³",
]
SCRIPTS = [
    "我们今天去公园散步。天气很好！",
    "东京は日本の首都です。ひらがなとカタカナ、そして漢字。",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Привет, мир! Ёжик в тумане.",
    "Καλημέρα κόσμε, τι κάνεις;",
    "안녕하세요 세계",
    "สวัสดีครับ ขอบคุณ",
    "שלום עולם",
    "Ünïcödé ĀĒĪŌŪ ŁŚŹŻ ǅ ǈ ǋ",
]
EMOJI = [
    "👍",
    "👨‍👩‍👧‍👦",
    "🇩🇪🇯🇵🇺🇸",
    "👋🏽",
    "❤️",
    "🏳️‍🌈",
    "🙂🙃😀",
    "a👍b",
    "🧑🏿‍💻 at work",
]
SPACES = [
    " ",
    "  ",
    "   ",
    "\t",
    "\t\t",
    "\n",
    "\n\n\n",
    "\r\n",
    "\r\n\r\n",
    " \n ",
    "  \t \n",
    "\u00a0",
    "\u2009",
    "\u3000",
    "\u180e",
    "\u0085",
    "\u200b",
    "\ufeff",
    "\u2028",
    "\x0b\x0c",
]
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\n",
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "<image>",
    "<image><image>",
    "<|begin_of",
    "<|eot_id|",
    "<imag",
    "<|endoftext|>",
    "  <mask>",
    "x<mask>",
    "[SEP]  y",
    "[SEP]\n",
    "<|tool|>_call",
    "<|fim|><|fim|><|fim|>",
    " spaced token  ",
    "café",
    "hetpar",
    " the ",
]
SEPARATORS = ["", " ", " ", " ", "  ", "\n", "\t", "\r\n", "\n\n"]
GROUPS = [ENGLISH, ENGLISH, CODE, NUMBERS, SCRIPTS, EMOJI, SPACES, SPECIALS]

# Texts every run checks verbatim, before the generated ones.
EDGE_TEXTS = [
    "",
    " ",
    "\n",
    "a",
    " a",
    "<|eot_id|>",
    "<|eot_id|><|eot_id|>",
    "<mask>",
    " <mask> ",
    "[SEP]",
    "the",
    "the hetpar",
    "<|tool|>",
    "'s",
    "   leading and trailing   ",
    "\u180e\u180e x \u180e",
]


def bytes_to_unicode():
    """GPT-2's byte -> character table, as a list indexed by byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0x100)]
    out, extra = [], 0
    for b in range(256):
        if b in kept:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def mixed_text(rng):
    """A deterministic mix of fragments from every group."""
    pieces = []
    for _ in range(rng.randint(1, 6)):
        group = rng.choice(GROUPS)
        fragment = rng.choice(group)
        if group is ENGLISH and rng.random() < 0.3:
            words = fragment.split(" ")
            fragment = " ".join(words[: rng.randint(1, len(words))])
        if rng.random() < 0.1:
            fragment = fragment.upper()
        pieces.append(fragment)
        pieces.append(rng.choice(SEPARATORS))
    if rng.random() < 0.5:
        pieces.pop()
    return "".join(pieces)


def training_corpus():
    rng = random.Random(20240601)
    corpus = [mixed_text(rng) for _ in range(4000)]
    for group in GROUPS:
        corpus.extend(group * 20)
    return corpus


def train(pre_tokenizer, vocab_size, special_tokens):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer)
    return tok


def rewrite(tok, path, merges_as_strings=None, ignore_merges=None, drop_merges_every=None):
    """Saves `tok` to `path`, editing the model section; returns the reloaded tokenizer.

    drop_merges_every=n removes every n-th merge but keeps the tokens it made in the vocabulary,
    so that (as in Llama 3's converted vocabulary) some tokens cannot be reached by merging and
    ignore_merges changes results.
    """
    data = json.loads(tok.to_str())
    model = data["model"]
    if ignore_merges is not None:
        model["ignore_merges"] = ignore_merges
    if drop_merges_every is not None:
        model["merges"] = [m for i, m in enumerate(model["merges"]) if i % drop_merges_every != 1]
    if merges_as_strings is not None:
        merges = [m if isinstance(m, str) else m[0] + " " + m[1] for m in model["merges"]]
        if merges_as_strings:
            assert all(len(m.split(" ")) == 2 for m in merges)
            model["merges"] = merges
        else:
            model["merges"] = [m.split(" ") for m in merges]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
    return Tokenizer.from_file(path)


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def emit(folder, texts, special_ids, special_ids_from):
    path = os.path.join(folder, "tokenizer.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    backend = Tokenizer.from_file(path)
    records = []
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False)
        records.append(
            {
                "text": text,
                "ids": ids,
                "decoded": hf.decode(ids, skip_special_tokens=False),
                "decoded_skip": hf.decode(ids, skip_special_tokens=True),
            }
        )
    write_jsonl(os.path.join(folder, "encode.jsonl"), records)

    vocab = backend.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values()) + 1
    rng = random.Random(7)
    specials = sorted(vocab[t.content] for t in backend.get_added_tokens_decoder().values())
    decodes = []
    for n in range(400):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        if n % 3 == 0:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        decodes.append(
            {
                "ids": ids,
                "decoded": hf.decode(ids, skip_special_tokens=False),
                "decoded_skip": hf.decode(ids, skip_special_tokens=True),
            }
        )
    write_jsonl(os.path.join(folder, "decode.jsonl"), decodes)

    pieces = []
    for i in range(vocab_size):
        token = backend.id_to_token(i)
        if token is not None:
            pieces.append([i, token])
    meta = {
        "vocab_size": vocab_size,
        "pieces": pieces,
        "special_ids": special_ids,
        "special_ids_from": special_ids_from,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, ensure_ascii=False)
    return len(records)


def ids_from_transformers(folder):
    """bos/eos/pad/unk ids as transformers loads the folder (tokenizer_config.json included)."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    out = {}
    for name in ("bos", "eos", "pad", "unk"):
        value = getattr(tok, name + "_token_id")
        out[name] = -1 if value is None else value
    return out


def main():
    if len(sys.argv) != 2:
        print("usage: bpe_oracle.py OUT_DIR", file=sys.stderr)
        return 2
    out = sys.argv[1]
    rng = random.Random(1234)
    texts = list(EDGE_TEXTS) + [mixed_text(rng) for _ in range(3000)]

    # Llama 3 style.
    llama = train(
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
        vocab_size=1500,
        special_tokens=[],
    )
    llama.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in LLAMA3_SPECIALS]
    )
    folder = os.path.join(out, "llama3")
    os.makedirs(folder, exist_ok=True)
    rewrite(
        llama,
        os.path.join(folder, "tokenizer.json"),
        merges_as_strings=True,
        ignore_merges=True,
        drop_merges_every=10,
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {
            "__type": "AddedToken",
            "content": "<|end_of_text|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": True,
        # As save_pretrained writes it: the added tokens again, which must agree with the file.
        "added_tokens_decoder": {
            str(t["id"]): {k: v for k, v in t.items() if k != "id"}
            for t in json.loads(llama.to_str())["added_tokens"]
        },
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    counts = {"llama3": emit(folder, texts, ids_from_transformers(folder), "transformers")}

    # GPT-2 / Qwen style.
    gpt2 = train(
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), 1200, ["<|endoftext|>"]
    )
    gpt2.add_tokens(GPT2_ADDED)
    folder = os.path.join(out, "gpt2")
    os.makedirs(folder, exist_ok=True)
    gpt2 = rewrite(gpt2, os.path.join(folder, "tokenizer.json"), merges_as_strings=False)
    endoftext = gpt2.token_to_id("<|endoftext|>")
    # No tokenizer_config.json: hetpar's fallback picks <|endoftext|> for bos and eos.
    counts["gpt2"] = emit(
        folder, texts, {"bos": endoftext, "eos": endoftext, "pad": -1, "unk": -1}, "hetpar fallback"
    )

    # The same with add_prefix_space.
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    folder = os.path.join(out, "gpt2_prefix_space")
    os.makedirs(folder, exist_ok=True)
    rewrite(gpt2, os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": {
            "__type": "AddedToken",
            "content": "<mask>",
            "lstrip": True,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    counts["gpt2_prefix_space"] = emit(folder, texts, ids_from_transformers(folder), "transformers")

    # The same model behind a pattern of the escapes that Oniguruma and PCRE2 read differently.
    gpt2.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\h+|\w+|\s+|\W"), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    folder = os.path.join(out, "gpt2_escapes")
    os.makedirs(folder, exist_ok=True)
    rewrite(gpt2, os.path.join(folder, "tokenizer.json"))
    counts["gpt2_escapes"] = emit(
        folder, texts, {"bos": endoftext, "eos": endoftext, "pad": -1, "unk": -1}, "hetpar fallback"
    )

    # gpt2 with bytes missing from the vocabulary, which become (fused) unk tokens.
    data = json.loads(Tokenizer.from_file(os.path.join(out, "gpt2", "tokenizer.json")).to_str())
    byte_chars = {b: c for b, c in zip(range(256), bytes_to_unicode())}
    removed = {byte_chars[b] for b in (ord("q"), ord("Z"), 0xF0, 0x9F)}
    model = data["model"]
    model["vocab"] = {
        (f"<unused {i}>" if t in removed else t): i for t, i in model["vocab"].items()
    }
    model["merges"] = [m for m in model["merges"] if m[0] not in removed and m[1] not in removed]
    model["unk_token"] = "<|endoftext|>"
    model["fuse_unk"] = True
    folder = os.path.join(out, "gpt2_unk")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
    counts["gpt2_unk"] = emit(
        folder,
        texts,
        {"bos": endoftext, "eos": endoftext, "pad": -1, "unk": endoftext},
        "hetpar fallback",
    )
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
