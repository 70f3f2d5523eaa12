#!/usr/bin/env python3
"""Answers for hetpar's Hugging Face tests, computed by transformers (not by hetpar's code).

  hf_oracle.py llama --out DIR --seed S [--tied] [--kv-heads K] [--rope-theta T]
      A random LlamaForCausalLM saved in float64 to DIR (config.json, model.safetensors), random
      token sequences in DIR/tokens.jsonl, and the log-probability of each next token in
      DIR/expected-float32.jsonl and DIR/expected-float64.jsonl.
  hf_oracle.py siglip --out DIR --seed S [--act gelu_pytorch_tanh]
      A random SiglipVisionModel saved in float64 to DIR, random pixels in DIR/pixels.safetensors
      and the last hidden state in DIR/features.safetensors ("float32", "float64").
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
import sys

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
        for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
            m = model.to(dtype)
            out[name] = m(pixel_values=pixels.to(dtype)).last_hidden_state.contiguous()
    return out


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
