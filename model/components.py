"""The frozen parts around the transformer, behind one small interface:

    encode_images(x in [-1, 1], [B, 3, H, W]) -> latents [B, C, h, w]
    decode_latents(latents) -> images in [-1, 1]
    encode_prompts(list of captions) -> (token sequence [B, L, joint_attention_dim], pooled [B, pooled_projection_dim])

The stage scripts only use this interface, so the built-in components (no download: a lossless pixel-space
autoencoder and a tiny frozen CLIP text encoder) and real SD3 components (a later issue) are interchangeable.
An empty caption, and a caption dropped for classifier-free guidance, both encode to zeros: that is the
unconditional input, at training and at sampling alike.
"""
import re
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F


class PixelAutoencoder(nn.Module):
    """Lossless 'autoencoder': space-to-depth by `factor` (RGB 32x32 -> 12 x 16x16 for factor 2)."""

    def __init__(self, factor=2):
        super().__init__()
        self.factor = factor
        self.latent_channels = 3 * factor * factor

    def encode_images(self, images):
        return F.pixel_unshuffle(images, self.factor)

    def decode_latents(self, latents):
        return F.pixel_shuffle(latents, self.factor)


class WordTokenizer:
    """Needs no files and accepts any UTF-8 text: words of `vocab` get their own ids, any other word one of
    `hash_buckets` ids by a stable hash. Ids: [vocab words][hash buckets][pad, bos, eos] (eos is the largest id,
    which is also what transformers' CLIP pooling looks for)."""

    def __init__(self, vocab, max_length=24, hash_buckets=512):
        self.vocab, self.max_length, self.hash_buckets = list(vocab), max_length, hash_buckets
        self.word_ids = {w: i for i, w in enumerate(self.vocab)}
        self.pad_id = len(self.vocab) + hash_buckets
        self.bos_id, self.eos_id = self.pad_id + 1, self.pad_id + 2
        self.vocab_size = self.eos_id + 1

    def word_id(self, word):
        if word in self.word_ids:
            return self.word_ids[word]
        return len(self.vocab) + zlib.crc32(word.encode("utf-8")) % self.hash_buckets

    def __call__(self, captions):
        """-> LongTensor [B, max_length]: bos, words (truncated), eos, padding."""
        rows = []
        for caption in captions:
            words = re.findall(r"\w+", caption.lower())[: self.max_length - 2]
            ids = [self.bos_id] + [self.word_id(w) for w in words] + [self.eos_id]
            rows.append(ids + [self.pad_id] * (self.max_length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)


class BuiltinTextEncoder(nn.Module):
    """A tiny random-init CLIP text model, frozen. Random but contextual: word order changes its output, and the
    pooled vector (at the eos token) sees the whole caption. Its weights are saved with the model."""

    def __init__(self, vocab, width=128, layers=2, heads=4, max_length=24, hash_buckets=512, seed=0):
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        self.tokenizer = WordTokenizer(vocab, max_length, hash_buckets)
        config = CLIPTextConfig(
            vocab_size=self.tokenizer.vocab_size, hidden_size=width, intermediate_size=4 * width,
            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=max_length,
            projection_dim=width, pad_token_id=self.tokenizer.pad_id, bos_token_id=self.tokenizer.bos_id,
            eos_token_id=self.tokenizer.eos_id,
        )
        with torch.random.fork_rng(devices=[]):  # the same random encoder on every machine and rank
            torch.manual_seed(seed)
            self.model = CLIPTextModelWithProjection(config).eval().requires_grad_(False)

    @torch.no_grad()
    def forward(self, captions):
        device = self.model.text_projection.weight.device
        out = self.model(input_ids=self.tokenizer(captions).to(device))
        return out.last_hidden_state, out.text_embeds


class BuiltinComponents(nn.Module):
    """Pixel autoencoder + built-in text encoder, for the tiny/small presets (12 latent channels, width 128)."""

    def __init__(self, vocab, factor=2, text_width=128, text_layers=2, text_max_length=24, seed=0):
        super().__init__()
        self.spec = dict(kind="builtin", vocab=list(vocab), factor=factor, text_width=text_width,
                         text_layers=text_layers, text_max_length=text_max_length, seed=seed)
        self.autoencoder = PixelAutoencoder(factor)
        self.text_encoder = BuiltinTextEncoder(vocab, width=text_width, layers=text_layers,
                                               max_length=text_max_length, seed=seed)
        self.latent_channels = self.autoencoder.latent_channels
        self.joint_attention_dim = self.pooled_projection_dim = text_width

    def encode_images(self, images):
        return self.autoencoder.encode_images(images)

    def decode_latents(self, latents):
        return self.autoencoder.decode_latents(latents).clamp(-1, 1)

    @torch.no_grad()
    def encode_prompts(self, captions):
        tokens, pooled = self.text_encoder(captions)
        empty = torch.tensor([not c.strip() for c in captions], device=tokens.device)
        return drop_captions(tokens, pooled, empty)

    def trained_state_dict(self):
        """What must be saved with the transformer for sampling to be identical later."""
        return {"text_encoder." + k: v for k, v in self.text_encoder.model.state_dict().items()}

    def load_trained_state_dict(self, state_dict):
        prefix = "text_encoder."
        self.text_encoder.model.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items()}, strict=True)


def drop_captions(tokens, pooled, drop):
    """Zero the text of the samples where `drop` [B] is True: the unconditional input."""
    keep = (~drop).to(tokens.dtype)
    return tokens * keep[:, None, None], pooled * keep[:, None]


def check_fits(components, config):
    """The transformer preset must fit the components; a mismatch is a one-line error."""
    pairs = [("in_channels", components.latent_channels, config.in_channels),
             ("joint_attention_dim", components.joint_attention_dim, config.joint_attention_dim),
             ("pooled_projection_dim", components.pooled_projection_dim, config.pooled_projection_dim)]
    bad = [f"{name}={want} (model has {have})" for name, want, have in pairs if want != have]
    if bad:
        raise ValueError("the model preset does not fit the components: they need " + ", ".join(bad))


def build_components(spec):
    """Rebuild components from the spec saved in a weights config (kind 'builtin' for now)."""
    if spec["kind"] != "builtin":
        raise ValueError(f"unknown components kind {spec['kind']!r}")
    return BuiltinComponents(**{k: v for k, v in spec.items() if k != "kind"})  # spec keys = constructor args
