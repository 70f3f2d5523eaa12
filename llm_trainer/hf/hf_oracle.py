#!/usr/bin/env python3
"""Answers for hetpar's Hugging Face tests, computed by transformers (not by hetpar's code).

  hf_oracle.py llama --out DIR --seed S [--tied] [--kv-heads K] [--rope-theta T]
      A random LlamaForCausalLM saved in float64 to DIR (config.json, model.safetensors), random
      token sequences in DIR/tokens.jsonl, and the log-probability of each next token in
      DIR/expected-float32.jsonl and DIR/expected-float64.jsonl.
  hf_oracle.py siglip --out DIR --seed S [--act gelu_pytorch_tanh]
      A random SiglipVisionModel saved in float64 to DIR, random pixels in DIR/pixels.safetensors
      and the last hidden state in DIR/features.safetensors ("float32", "float64"), with, in
      float64, the hidden states LLaVA's projector reads (before post_layernorm):
      "float64_layer_-1" and "float64_layer_-2" (vision_feature_layer -1 and -2).
  hf_oracle.py multimodal --llama DIR --siglip DIR --out DIR --seed S
      A random LLaVA-style projector (DIR/projector.safetensors, multi_modal_projector.*), PNG
      images at the tower's size, DIR/tokens.jsonl whose -1 entries are images, and
      DIR/expected-float64.jsonl: SigLIP's last hidden state, through the projector (linear,
      exact GELU, linear), replaces the embedding rows of each image, and the Llama scores the
      sequence (null where the next position is an image row).
  hf_oracle.py load-llama --dir DIR --tokens FILE --out FILE --dtype float32|float64
  hf_oracle.py load-siglip --dir DIR --pixels FILE --out FILE
      Load an exported directory; exit 3 if transformers reports a missing, unexpected or
      mismatched weight; write its log-probabilities / features.

float64: transformers' Llama computes RMSNorm and the rotary tables in float32 whatever the model
dtype, and its eager attention takes the softmax in float32. For the float64 answers the two
modules are evaluated in the input dtype (same formulas, no downcast) and attention runs through
torch's scaled_dot_product_attention, which keeps float64.
"""
import argparse
import json
import struct
import sys
import zlib

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, SiglipVisionConfig, SiglipVisionModel
from transformers.models.llama import modeling_llama

_rms_forward = modeling_llama.LlamaRMSNorm.forward
_rope_forward = modeling_llama.LlamaRotaryEmbedding.forward


def _rms_forward_keep_dtype(self, hidden_states):
    if hidden_states.dtype != torch.float64:
        return _rms_forward(self, hidden_states)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rope_forward_keep_dtype(self, x, position_ids):
    if x.dtype != torch.float64:
        return _rope_forward(self, x, position_ids)
    config = self.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


modeling_llama.LlamaRMSNorm.forward = _rms_forward_keep_dtype
modeling_llama.LlamaRotaryEmbedding.forward = _rope_forward_keep_dtype
# One thread: the test suite runs two tests at a time on small machines.
torch.set_num_threads(1)


def randomise(model, generator):
    """Every weight random, norm scales and biases too, so a misplaced one changes the output."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator, dtype=torch.float64))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator, dtype=torch.float64))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=generator, dtype=torch.float64))
            else:
                std = 1.0 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.2
                p.copy_(1.5 * std * torch.randn(p.shape, generator=generator, dtype=torch.float64))


def llama_logprobs(model, lines, dtype):
    model = model.to(dtype)
    out = []
    with torch.no_grad():
        for tokens in lines:
            ids = torch.tensor([tokens])
            logits = model(input_ids=ids).logits[0].to(torch.float64)
            logp = torch.log_softmax(logits, dim=-1)
            out.append([logp[i, tokens[i + 1]].item() for i in range(len(tokens) - 1)])
    return out


def write_logprobs(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"logprobs": row}) + "\n")


def cmd_llama(args):
    gen = torch.Generator().manual_seed(args.seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=args.kv_heads, vocab_size=256, max_position_embeddings=128,
        rope_theta=args.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=args.tied,
        attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.float64)
    randomise(model, gen)
    if args.tied:
        model.tie_weights()
    model.eval()
    model.save_pretrained(args.out)
    lengths = [2, 3, 7, 16, 33, 48]
    lines = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    with open(f"{args.out}/tokens.jsonl", "w") as f:
        for tokens in lines:
            f.write(json.dumps({"tokens": tokens}) + "\n")
    write_logprobs(f"{args.out}/expected-float64.jsonl", llama_logprobs(model, lines, torch.float64))
    write_logprobs(f"{args.out}/expected-float32.jsonl", llama_logprobs(model, lines, torch.float32))


def cmd_siglip(args):
    gen = torch.Generator().manual_seed(args.seed)
    config = SiglipVisionConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_channels=3, image_size=32, patch_size=8, hidden_act=args.act, layer_norm_eps=1e-6,
        vision_use_head=args.head, attn_implementation="sdpa")
    model = SiglipVisionModel(config).to(torch.float64)
    randomise(model, gen)
    model.eval()
    model.save_pretrained(args.out)
    pixels = torch.randn((2, 3, 32, 32), generator=gen, dtype=torch.float64)
    save_file({"pixels": pixels}, f"{args.out}/pixels.safetensors")
    save_file(siglip_features(model, pixels), f"{args.out}/features.safetensors")


def siglip_features(model, pixels):
    out = {}
    with torch.no_grad():
        # In float64 first: Module.to converts the model in place, and a float32 round trip would
        # round its weights.
        states = model.to(torch.float64)(pixel_values=pixels.to(torch.float64),
                                         output_hidden_states=True).hidden_states
        for k in (-1, -2):
            out[f"float64_layer_{k}"] = states[k].contiguous()
        for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
            m = model.to(dtype)
            out[name] = m(pixel_values=pixels.to(dtype)).last_hidden_state.contiguous()
    return out


def write_png(path, pixels):
    """pixels: uint8 [height, width, 3]. A plain 8-bit RGB PNG (zlib and struct only)."""
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + bytes(pixels[y].flatten().tolist()) for y in range(height))

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data +
                struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw)))
        f.write(chunk(b"IEND", b""))


def cmd_multimodal(args):
    gen = torch.Generator().manual_seed(args.seed)
    llama = LlamaForCausalLM.from_pretrained(args.llama, attn_implementation="sdpa",
                                             dtype=torch.float64).eval()
    siglip = SiglipVisionModel.from_pretrained(args.siglip, attn_implementation="sdpa",
                                               dtype=torch.float64).eval()
    vision_hidden = siglip.config.hidden_size
    text_hidden = llama.config.hidden_size
    projector = {
        "multi_modal_projector.linear_1.weight":
            torch.randn((text_hidden, vision_hidden), generator=gen, dtype=torch.float64) * 0.2,
        "multi_modal_projector.linear_1.bias":
            torch.randn((text_hidden,), generator=gen, dtype=torch.float64) * 0.1,
        "multi_modal_projector.linear_2.weight":
            torch.randn((text_hidden, text_hidden), generator=gen, dtype=torch.float64) * 0.2,
        "multi_modal_projector.linear_2.bias":
            torch.randn((text_hidden,), generator=gen, dtype=torch.float64) * 0.1,
    }
    save_file(projector, f"{args.out}/projector.safetensors")
    size = siglip.config.image_size
    images = []
    for k in range(3):
        pixels = torch.randint(0, 256, (size, size, 3), generator=gen, dtype=torch.uint8)
        write_png(f"{args.out}/image-{k}.png", pixels.numpy())
        # What the data loader feeds the encoder: (pixel / 255 - 0.5) / 0.5, computed in
        # float32 as hetpar's loader does (its images are float buffers), then widened.
        images.append(((pixels.to(torch.float32) / 255.0 - 0.5) / 0.5).to(torch.float64))
    rows_per_image = (size // siglip.config.patch_size) ** 2
    vocab = llama.config.vocab_size
    lines = [  # (tokens with -1 for images, image indices)
        ([5, -1, 7, 9, 11], [0]),
        ([3, 4, -1, -1, 8, 2, 6], [1, 2]),
        ([-1, 12, 13], [2]),
        ([14, 15, 16, 17], []),
    ]
    with open(f"{args.out}/tokens.jsonl", "w") as f, \
            open(f"{args.out}/expected-float64.jsonl", "w") as g, torch.no_grad():
        for tokens, which in lines:
            f.write(json.dumps({"tokens": tokens,
                                "images": [f"image-{k}.png" for k in which]}) + "\n")
            pieces, ids = [], []
            image_iter = iter(which)
            for t in tokens:
                if t == -1:
                    pixels = images[next(image_iter)].permute(2, 0, 1).unsqueeze(0)
                    features = siglip(pixel_values=pixels).last_hidden_state[0]
                    h = torch.nn.functional.linear(
                        features, projector["multi_modal_projector.linear_1.weight"],
                        projector["multi_modal_projector.linear_1.bias"])
                    h = torch.nn.functional.gelu(h)
                    h = torch.nn.functional.linear(
                        h, projector["multi_modal_projector.linear_2.weight"],
                        projector["multi_modal_projector.linear_2.bias"])
                    pieces.append(h)
                    ids += [None] * rows_per_image
                else:
                    assert 0 <= t < vocab
                    pieces.append(llama.model.embed_tokens(torch.tensor([t])))
                    ids.append(t)
            embeds = torch.cat(pieces).unsqueeze(0)
            logp = torch.log_softmax(llama(inputs_embeds=embeds).logits[0], dim=-1)
            out = [None if ids[i + 1] is None else logp[i, ids[i + 1]].item()
                   for i in range(len(ids) - 1)]
            g.write(json.dumps({"logprobs": out}) + "\n")


def check_loading_info(info):
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                        "mismatched_keys", "error_msgs")}
    if bad:
        print(f"loading reported: {bad}", file=sys.stderr)
        sys.exit(3)


def cmd_load_llama(args):
    model, info = LlamaForCausalLM.from_pretrained(
        args.dir, output_loading_info=True, attn_implementation="sdpa",
        dtype=torch.float64)
    check_loading_info(info)
    model.eval()
    with open(args.tokens) as f:
        lines = [json.loads(line)["tokens"] for line in f if line.strip()]
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    write_logprobs(args.out, llama_logprobs(model, lines, dtype))


def cmd_load_siglip(args):
    model, info = SiglipVisionModel.from_pretrained(
        args.dir, output_loading_info=True, attn_implementation="sdpa", dtype=torch.float64)
    check_loading_info(info)
    model.eval()
    pixels = load_file(args.pixels)["pixels"]
    save_file(siglip_features(model, pixels), args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("llama")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rope-theta", type=float, default=5000.0)
    p.set_defaults(fn=cmd_llama)
    p = sub.add_parser("siglip")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--act", default="gelu_pytorch_tanh")
    p.add_argument("--head", action="store_true")
    p.set_defaults(fn=cmd_siglip)
    p = sub.add_parser("multimodal")
    p.add_argument("--llama", required=True)
    p.add_argument("--siglip", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(fn=cmd_multimodal)
    p = sub.add_parser("load-llama")
    p.add_argument("--dir", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float64")
    p.set_defaults(fn=cmd_load_llama)
    p = sub.add_parser("load-siglip")
    p.add_argument("--dir", required=True)
    p.add_argument("--pixels", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_load_siglip)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
