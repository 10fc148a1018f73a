"""What the text encoders that train keep for backward, a sample: model/memory.py's text_activation_bytes (the
tensors autograd saves while one caption is encoded, their weights left out) on random-init encoders of the
published sizes, in bf16 with LoRA on the layers --train_text_encoders adapts. T5-XXL is built with
--t5_layers of its 24 layers and scaled to 24 (all its layers are alike but the first, which also computes the
position bias: the scaled figure is a little high).

    python bench/bench_text_activations.py                       # CLIP-L, CLIP-G at 77 tokens; T5-XXL at 77 and 256
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.memory import text_activation_bytes  # noqa: E402
from model.model_lora import TEXT_TARGETS, apply_lora  # noqa: E402


class OneEncoder(torch.nn.Module):
    """What text_activation_bytes reads of components, for one encoder that trains on `tokens` token ids."""

    def __init__(self, encoder, tokens, t5):
        super().__init__()
        self.encoder, self.tokens, self.t5, self.trained_text = encoder, tokens, t5, ("t5" if t5 else "clip",)

    def trained_outputs(self, captions):
        ids = torch.ones(len(captions), self.tokens, dtype=torch.long)
        return {"tokens": (self.encoder(ids) if self.t5 else self.encoder(ids, output_hidden_states=True))[0]}


def kept_bytes(encoder, tokens, t5, rank):
    encoder = encoder.to(torch.bfloat16).requires_grad_(False)
    apply_lora(encoder, TEXT_TARGETS["t5" if t5 else "clip_l"], rank=rank)
    return text_activation_bytes(OneEncoder(encoder, tokens, t5))


def main():
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--t5_layers", type=int, default=2)
    parser.add_argument("--t5_tokens", default="77,256")
    args = parser.parse_args()
    torch.manual_seed(0)
    clips = {"CLIP-L": CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, projection_dim=768),
             "CLIP-G": CLIPTextConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                      num_attention_heads=20, projection_dim=1280, hidden_act="gelu")}
    print("| encoder | tokens | kept for backward, a sample |\n|---|---|---|")
    for name, config in clips.items():
        kept = kept_bytes(CLIPTextModelWithProjection(config), 77, False, args.rank)
        print(f"| {name} | 77 | {kept / 2 ** 20:.1f} MiB |", flush=True)
    t5 = T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=args.t5_layers,
                  feed_forward_proj="gated-gelu", vocab_size=32128)
    for tokens in map(int, args.t5_tokens.split(",")):
        kept = kept_bytes(T5EncoderModel(t5), tokens, True, args.rank) * 24 / args.t5_layers
        print(f"| T5-XXL ({args.t5_layers} of 24 layers, scaled) | {tokens} | {kept / 2 ** 20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
