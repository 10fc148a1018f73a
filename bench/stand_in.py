"""A stand-in for a published SD3 / SD3.5 folder (the weights cannot be downloaded here): a random-init diffusers
folder whose transformer has a preset's published size, stored as published folders store it (bf16, sharded
safetensors of at most 10 GB with an index), with SD3's VAE (its real config, 84M parameters) and the three text
encoders at their real output widths (CLIP-L 768, CLIP-G 1280, T5 4096) but one layer deep. What memory a stage
takes on it is what it takes on the real folder, but for the text encoders' depth.

    python bench/stand_in.py /tmp/sd35_large --preset sd3.5-large     # 15 GiB on disk, about 2 GiB of RAM
    python trainer/train_lora.py --base /tmp/sd35_large --from_weight base --preset sd3.5-large ...

The transformer is never whole in memory, in fp32 or at all: each tensor is made in bf16 (normal, std 0.02;
biases zero, norms one, the position table SD3's) and streamed into its shard, whose header is written first from
the shapes of a model built on the meta device.
"""
import argparse
import json
import os
import struct
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from model.model_sd3light import DIFFUSERS_FORMAT_VERSION, meta_model, preset_config, sincos_2d_table  # noqa: E402

SHARD_BYTES = 10 * 10 ** 9  # diffusers' save_pretrained default (max_shard_size="10GB")
WEIGHTS = "diffusion_pytorch_model"
SD3_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
               up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
               latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False)


def stand_in_tensor(name, shape, config, generator):
    """One tensor of the stand-in transformer, made in bf16."""
    if name == "pos_embed.pos_embed":
        table = sincos_2d_table(config.inner_dim, config.pos_embed_max_size, config.sample_size // config.patch_size)
        return table.unsqueeze(0).to(torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if "norm" in name.split(".")[-2]:  # the RMSNorm scales of qk_norm
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)


def write_transformer(folder, config, seed=0):
    """folder/transformer/: config.json, the bf16 shards and their index. -> bytes written."""
    folder = os.path.join(folder, "transformer")
    os.makedirs(folder, exist_ok=True)
    shapes = {name: tuple(t.shape) for name, t in meta_model(config).state_dict().items()}
    shards, size = [[]], 0
    for name, shape in shapes.items():  # the model's order, cut where a shard would pass SHARD_BYTES
        nbytes = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards, size = shards + [[]], 0
        shards[-1].append(name)
        size += nbytes
    generator, weight_map, total = torch.Generator().manual_seed(seed), {}, 0
    for i, names in enumerate(shards):
        file = f"{WEIGHTS}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(os.path.join(folder, file), names, shapes, config, generator)
        weight_map.update({name: file for name in names})
    with open(os.path.join(folder, f"{WEIGHTS}.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_json(os.path.join(folder, "config.json"))
    return total


def write_shard(path, names, shapes, config, generator):
    """A safetensors file written tensor by tensor: its header from the shapes, then each tensor as it is made."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        nbytes = 2 * int(torch.Size(shapes[name]).numel())
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            tensor = stand_in_tensor(name, shapes[name], config, generator)
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    os.replace(path + ".tmp", path)
    return offset


def write_components(folder, seed=0):
    """SD3's VAE, CLIP-L and CLIP-G with projections, T5 (one layer each, real widths), tokenizers, scheduler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from tests.tiny_sd3 import clip_tokenizer, t5_tokenizer

    torch.manual_seed(seed)
    AutoencoderKL(**SD3_VAE).to(torch.bfloat16).save_pretrained(os.path.join(folder, "vae"))
    for part, width, heads in (("text_encoder", 768, 12), ("text_encoder_2", 1280, 20)):
        tokenizer = clip_tokenizer(os.path.join(folder, part.replace("text_encoder", "tokenizer")))
        tokenizer.save_pretrained(os.path.join(folder, part.replace("text_encoder", "tokenizer")))
        config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=4 * width,
                                num_hidden_layers=1, num_attention_heads=heads, max_position_embeddings=77,
                                projection_dim=width, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        CLIPTextModelWithProjection(config).to(torch.bfloat16).save_pretrained(os.path.join(folder, part))
    tokenizer = t5_tokenizer()
    tokenizer.save_pretrained(os.path.join(folder, "tokenizer_3"))
    config = T5Config(vocab_size=len(tokenizer), d_model=4096, d_kv=64, d_ff=1024, num_layers=1, num_heads=8,
                      feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    T5EncoderModel(config).to(torch.bfloat16).save_pretrained(os.path.join(folder, "text_encoder_3"))
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(os.path.join(folder, "scheduler"))
    index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": DIFFUSERS_FORMAT_VERSION,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
             "transformer": ["diffusers", "SD3Transformer2DModel"], "feature_extractor": [None, None],
             "image_encoder": [None, None]}
    for part, cls in (("text_encoder", "CLIPTextModelWithProjection"), ("text_encoder_2", "CLIPTextModelWithProjection"),
                      ("text_encoder_3", "T5EncoderModel"), ("tokenizer", "CLIPTokenizer"),
                      ("tokenizer_2", "CLIPTokenizer"), ("tokenizer_3", "PreTrainedTokenizerFast")):
        index[part] = ["transformers", cls]
    with open(os.path.join(folder, "model_index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)


def write_stand_in(folder, preset, seed=0):
    """The whole folder (skipped if it is there, complete, for this preset). -> the transformer's bytes."""
    done = os.path.join(folder, ".stand_in.json")
    if os.path.isfile(done):
        with open(done, encoding="utf-8") as f:
            record = json.load(f)
        if record["preset"] == preset and record["seed"] == seed:
            return record["bytes"]
    write_components(folder, seed)
    written = write_transformer(folder, preset_config(preset), seed)
    with open(done, "w", encoding="utf-8") as f:
        json.dump({"preset": preset, "seed": seed, "bytes": written}, f)
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--preset", default="sd3.5-large", help="the transformer's size (model/model_sd3light.py)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    written = write_stand_in(args.folder, args.preset, args.seed)
    print(f"{args.folder}: a {args.preset} stand-in, transformer {written / 2 ** 30:.2f} GiB in bf16")


if __name__ == "__main__":
    main()
