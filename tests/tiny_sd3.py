"""A tiny SD3 pipeline folder, built locally with random weights (no download): what the tests and the cache
benchmark use in place of a real SD3 / SD3.5 download. It has the real interface (16 latent channels, CLIP-L and
CLIP-G with projections to 768 + 1280 = 2048 pooled, T5 4096 wide) at a few MB, so the `sd3-tiny` and every larger
SD3 preset fit it:

    python tests/tiny_sd3.py /tmp/tiny_sd3          # then: python trainer/train_pretrain.py --base /tmp/tiny_sd3 ...

The tokenizers are made here too: CLIP's byte-pair tokenizer over single characters (any text encodes, a letter
a token) and a word-level T5 tokenizer over the built-in captions' words.
"""
import json
import os
import string
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from dataset.shapes import GRAMMAR_WORDS  # noqa: E402
from model.model_sd3light import preset_config  # noqa: E402

CLIP_WIDTHS = {"text_encoder": (32, 768), "text_encoder_2": (48, 1280)}  # (hidden, projection) of CLIP-L, CLIP-G
T5_WIDTH = 4096  # T5-XXL's width: the joint attention dim of every SD3 transformer


def clip_tokenizer(folder):
    """A CLIP BPE tokenizer whose vocabulary is single characters (no merges): any text tokenizes."""
    from transformers import CLIPTokenizer

    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab = {}
    for c in chars:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"),
                         model_max_length=77, pad_token="<|endoftext|>")


def t5_tokenizer():
    """A word-level tokenizer with T5's special tokens; unknown words map to <unk>, every text ends in </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in GRAMMAR_WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=256, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>")


def build_pipeline(seed=0, with_t5=True, transformer_preset="sd3-tiny", latent_channels=16):
    """-> a StableDiffusion3Pipeline with random weights (deterministic in `seed`), on the CPU in fp32.
    `latent_channels`: SD3's 16, or another VAE's (e.g. 4, an SD3-style folder that no SD3 preset fits)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, \
        StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    parts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (hidden, projection) in CLIP_WIDTHS.items():
            tokenizer = clip_tokenizer(os.path.join(tmp, name))
            config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                                    projection_dim=projection, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            parts[name] = CLIPTextModelWithProjection(config).eval()
            parts["tokenizer" + name[len("text_encoder"):]] = tokenizer
    if with_t5:
        tokenizer = t5_tokenizer()
        config = T5Config(vocab_size=len(tokenizer), d_model=T5_WIDTH, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                          relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
                          eos_token_id=1, decoder_start_token_id=0)
        parts["text_encoder_3"], parts["tokenizer_3"] = T5EncoderModel(config).eval(), tokenizer
    else:
        parts["text_encoder_3"] = parts["tokenizer_3"] = None
    # SD3's VAE layout (16 latent channels, no quant convs, its scaling and shift) at 4x downscaling
    parts["vae"] = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                                 up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 8, 16),
                                 layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
                                 scaling_factor=1.5305,
                                 shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False).eval()
    config = preset_config(transformer_preset, in_channels=latent_channels, out_channels=latent_channels)
    parts["transformer"] = SD3Transformer2DModel(**config.to_dict()).eval()
    with torch.no_grad():  # diffusers zero-initialises the output layers: give them weights so the model does something
        for p in parts["transformer"].parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(**parts)


def build_folder(folder, seed=0, with_t5=True, transformer_preset="sd3-tiny", latent_channels=16):
    """Write a tiny SD3 pipeline folder (as save_pretrained writes it); -> folder."""
    build_pipeline(seed, with_t5, transformer_preset, latent_channels).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tiny_sd3.py FOLDER")
    print(build_folder(sys.argv[1]))
