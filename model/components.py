"""The frozen parts around the transformer, behind one small interface (the stage scripts use nothing else):

    encode(images in [-1, 1] [B, 3, H, W], captions) -> features: what the cache stores, per sample
        "latents" (the latent distribution's mean, scaled), "latents_std" (its spread, if the autoencoder is
        stochastic), and per text encoder "<name>_tokens" [B, L, width] and "<name>_pooled" [B, width]
    latents(features, generator) -> latents [B, C, h, w] (a sample of the latent distribution)
    condition(features, drop=None) -> (token sequence [B, L, joint_attention_dim], pooled [B, pooled_dim]);
        drop [B, len(text_encoders)] zeroes the text of the dropped encoders (caption dropout)
    encode_prompts(captions) -> condition(encode_text(captions))
    decode_latents(latents) -> images in [-1, 1]

Two kinds: the built-in components (no download: a lossless pixel-space autoencoder and a tiny frozen CLIP text
encoder; an empty caption encodes to zeros, the unconditional input) and SD3Components, the real SD3 / SD3.5 VAE
and text encoders read from a local diffusers folder (`--base`), whose text embeddings are formed exactly as
diffusers' StableDiffusion3Pipeline forms them.
"""
import json
import os
import re
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.block_swap import BlockSwap, swap_sizes
from model.clip_text import CLIPText
from model.errors import UserError
from model.token_routing import to_device


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
        self.max_words = max_length - 2  # bos and eos take two of the tokens; longer captions are cut to these
        self.word_ids = {w: i for i, w in enumerate(self.vocab)}
        self.pad_id = len(self.vocab) + hash_buckets
        self.bos_id, self.eos_id = self.pad_id + 1, self.pad_id + 2
        self.vocab_size = self.eos_id + 1

    def word_id(self, word):
        if word in self.word_ids:
            return self.word_ids[word]
        return len(self.vocab) + zlib.crc32(word.encode("utf-8")) % self.hash_buckets

    @staticmethod
    def words(caption):
        return re.findall(r"\w+", caption.lower())

    def __call__(self, captions):
        """-> LongTensor [B, max_length]: bos, words (truncated), eos, padding."""
        rows = []
        for caption in captions:
            words = self.words(caption)[: self.max_words]
            ids = [self.bos_id] + [self.word_id(w) for w in words] + [self.eos_id]
            rows.append(ids + [self.pad_id] * (self.max_length - len(ids)))
        return torch.tensor(rows, dtype=torch.long)


class BuiltinTextEncoder(nn.Module):
    """A tiny random-init CLIP text model, frozen. Random but contextual: word order changes its output, and the
    pooled vector (at the eos token) sees the whole caption. Its weights are saved with the model."""

    def __init__(self, vocab, width=128, layers=2, heads=4, max_length=24, hash_buckets=512, seed=0):
        super().__init__()
        self.tokenizer = WordTokenizer(vocab, max_length, hash_buckets)
        with torch.random.fork_rng(devices=[]):  # the same random encoder on every machine and rank
            torch.manual_seed(seed)
            self.model = CLIPText(self.tokenizer.vocab_size, width, layers, heads, max_length).eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def forward(self, captions):
        device = self.model.text_projection.weight.device
        return self.model(to_device(self.tokenizer(captions), device), self.tokenizer.eos_id)

    def encode_ids(self, ids, blank):
        """Token ids (the tokenizer's) -> (tokens, pooled), with gradients where adapters on it train; where
        `blank` (an empty caption), zeros: the unconditional input."""
        device = self.model.text_projection.weight.device
        tokens, pooled = self.model(to_device(ids, device), self.tokenizer.eos_id)
        return drop_captions(tokens, pooled, to_device(blank, device))


class BuiltinComponents(nn.Module):
    """Pixel autoencoder + built-in text encoder, for the tiny/small presets (12 latent channels, width 128)."""

    text_encoders = ("text",)  # one encoder: caption dropout drops the whole text

    def __init__(self, vocab, factor=2, text_width=128, text_layers=2, text_max_length=24, seed=0):
        super().__init__()
        self.spec = dict(kind="builtin", vocab=list(vocab), factor=factor, text_width=text_width,
                         text_layers=text_layers, text_max_length=text_max_length, seed=seed)
        self.autoencoder = PixelAutoencoder(factor)
        self.text_encoder = BuiltinTextEncoder(vocab, width=text_width, layers=text_layers,
                                               max_length=text_max_length, seed=seed)
        self.latent_channels, self.downscale = self.autoencoder.latent_channels, factor
        self.joint_attention_dim = self.pooled_projection_dim = text_width
        self.trained_text = ()  # the text encoders that train (train_text_encoders): encoded at each step

    def identity(self):
        """What the cached features depend on (the encoder is seeded random: its spec says it all; a trained one is
        cached as token ids)."""
        return {**self.spec, **({"text_ids": list(self.trained_text)} if self.trained_text else {})}

    def text_models(self):
        """{name: the text encoder's network}: what adapters go on (--train_text_encoders)."""
        return {"text": self.text_encoder.model}

    def train_text_encoders(self, names):
        """From now on the encoders `names` encode to token ids, and condition runs them (with their adapters,
        with gradients) at each call: they train. The others stay as they were."""
        self.trained_text = check_text_names(names, self.text_models())

    def encode_images(self, images):
        return self.autoencoder.encode_images(images)

    def decode_latents(self, latents):
        return self.autoencoder.decode_latents(latents).clamp(-1, 1)

    @torch.no_grad()
    def encode_text(self, captions):
        empty = torch.tensor([not c.strip() for c in captions], device=self.device)
        if self.trained_text:  # encoded at each step, from its ids
            return {"text_ids": to_device(self.text_encoder.tokenizer(captions), self.device), "text_blank": empty}
        tokens, pooled = self.text_encoder(captions)
        tokens, pooled = drop_captions(tokens, pooled, empty)
        return {"text_tokens": tokens, "text_pooled": pooled}

    @torch.no_grad()
    def encode(self, images, captions):
        return {"latents": self.encode_images(images), **self.encode_text(captions)}

    def latents(self, features, generator=None):
        return features["latents"].float()  # lossless: nothing to sample

    @property
    def device(self):
        return self.text_encoder.model.text_projection.weight.device

    def condition(self, features, drop=None):
        if "text_ids" in features:  # a trained encoder: run now
            tokens, pooled = self.text_encoder.encode_ids(features["text_ids"], features["text_blank"])
        else:
            tokens, pooled = features["text_tokens"].float(), features["text_pooled"].float()
        return (tokens, pooled) if drop is None else drop_captions(tokens, pooled, drop[:, 0])

    def encode_prompts(self, captions):
        return self.condition(self.encode_text(captions))

    def trained_outputs(self, captions):
        """The encoder's output for `captions` if it trains, run from their ids as condition runs it at a step
        (with gradients) -> {feature name: tensor}, empty if it does not train."""
        if not self.trained_text:
            return {}
        tokens, pooled = self.encode_prompts(captions)
        return {"text_tokens": tokens, "text_pooled": pooled}

    def trained_state_dict(self):
        """What must be saved with the transformer for sampling to be identical later."""
        return {"text_encoder." + k: v for k, v in self.text_encoder.model.state_dict().items()}

    def load_trained_state_dict(self, state_dict):
        prefix = "text_encoder."
        self.text_encoder.model.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items()}, strict=True)


# The parts of a diffusers SD3 folder (StableDiffusion3Pipeline.save_pretrained): T5 may be left out, as
# diffusers allows (its tokens are then zeros).
SD3_REQUIRED = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
SD3_OPTIONAL = ("text_encoder_3", "tokenizer_3")
SD3_HOW_TO = ("a diffusers SD3 folder as StableDiffusion3Pipeline.save_pretrained writes it (vae, text_encoder, "
              "tokenizer, text_encoder_2, tokenizer_2, optionally text_encoder_3 + tokenizer_3, transformer)")


def quiet_hub_libraries():
    """diffusers and transformers print a progress bar per loaded part and advice meant for their own users; our
    logs and one-line errors stay readable without them."""
    import diffusers
    import transformers

    for library in (diffusers, transformers):
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()


class ComponentsError(UserError, ValueError):
    """A --base folder that cannot be used: the message is one line naming what is wrong."""


def check_sd3_folder(path):
    """-> whether the folder has T5; a one-line ComponentsError if it is not a usable SD3 folder."""
    if not os.path.isdir(path):
        raise ComponentsError(f"--base {path} is not a folder: pass {SD3_HOW_TO}")
    missing = [part for part in SD3_REQUIRED if not os.path.isdir(os.path.join(path, part))]
    if missing:
        raise ComponentsError(f"--base {path} lacks {', '.join(p + '/' for p in missing)}: pass {SD3_HOW_TO}")
    has_t5 = [os.path.isdir(os.path.join(path, part)) for part in SD3_OPTIONAL]
    if any(has_t5) and not all(has_t5):
        raise ComponentsError(f"--base {path} has only one of text_encoder_3/ and tokenizer_3/: T5 needs both")
    return all(has_t5)


class SD3Components(nn.Module):
    """The SD3 / SD3.5 VAE and text encoders from a local diffusers folder, frozen. They run without gradients,
    in `dtype` (a run's --frozen_dtype; by default bf16 on a GPU, fp32 on a CPU). The VAE is on `device` at once;
    the text encoders are read into host memory and come to the device when they first encode (never, where the
    cache already holds what they would encode), whole or, for those stream_text_encoders names, with their layers
    streamed from host memory one ahead of their use (model/block_swap.py: T5-XXL on a small card).

    Text, as StableDiffusion3Pipeline.encode_prompt forms it: CLIP-L and CLIP-G each take 77 tokens; their
    penultimate hidden states are joined on the feature axis and zero-padded to T5's width, and T5's sequence
    (t5_max_length tokens; zeros without T5) follows on the token axis. Pooled = the two CLIP projections joined.
    Caption dropout zeroes each encoder's part independently, as SD3 was trained."""

    def __init__(self, path, t5_max_length=77, device="cpu", dtype=None):
        super().__init__()
        from diffusers import AutoencoderKL
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel

        path = os.path.abspath(path)
        has_t5 = check_sd3_folder(path)
        device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.spec = dict(kind="sd3", path=path, t5_max_length=int(t5_max_length))
        self.truncated_captions = 0  # captions longer than CLIP's 77 tokens, counted as they are encoded
        self.prompt_memo = {}  # prompts -> (tokens, pooled), encoded before the text encoders were freed; with
        # trained encoders their features (encode_text's, theirs as ids), conditioned at each use
        self.trained_text, self.freed = (), False  # the text encoders that train; whether the others were freed
        self.path, self.t5_max_length = path, int(t5_max_length)

        quiet_hub_libraries()

        def load(cls, part):
            try:
                if part.startswith("tokenizer"):
                    return cls.from_pretrained(path, subfolder=part)
                return cls.from_pretrained(path, subfolder=part, torch_dtype=self.dtype)
            except Exception as e:  # a broken or foreign folder: say which part, in one line
                raise ComponentsError(f"--base {path}: cannot load {part}/ ({' '.join(str(e).split())[:300]})") \
                    from None

        def frozen(module):
            return module.eval().requires_grad_(False)

        self.vae = frozen(load(AutoencoderKL, "vae")).to(device)
        self.clip_l, self.clip_g = frozen(load(CLIPTextModelWithProjection, "text_encoder")), \
            frozen(load(CLIPTextModelWithProjection, "text_encoder_2"))
        self.streamed, self.placed, self.log = (), False, print  # the text encoders whose layers stream; whether
        # they are on the device; where a warning of their streaming goes
        self.tokenizers = {"clip_l": load(CLIPTokenizer, "tokenizer"), "clip_g": load(CLIPTokenizer, "tokenizer_2")}
        self.t5, self.t5_swap = frozen(load(T5EncoderModel, "text_encoder_3")) if has_t5 else None, None
        if has_t5:
            self.tokenizers["t5"] = load(AutoTokenizer, "tokenizer_3")
        self.text_encoders = ("clip_l", "clip_g", "t5") if has_t5 else ("clip_l", "clip_g")
        vae = self.vae.config
        self.latent_channels = vae.latent_channels
        self.downscale = 2 ** (len(vae.block_out_channels) - 1)
        self.scaling_factor, self.shift_factor = vae.scaling_factor, vae.shift_factor or 0.0
        self.clip_widths = (self.clip_l.config.hidden_size, self.clip_g.config.hidden_size)
        self.pooled_projection_dim = self.clip_l.config.projection_dim + self.clip_g.config.projection_dim
        # joint width: T5's; without T5 the transformer's (diffusers pads to it), else SD3's 4096
        self.joint_attention_dim = self.t5.config.d_model if has_t5 else self._transformer_joint_dim()
        if sum(self.clip_widths) > self.joint_attention_dim:
            raise ComponentsError(f"--base {path}: the CLIP widths {self.clip_widths} do not fit in the joint "
                                  f"width {self.joint_attention_dim}")

    def _transformer_joint_dim(self):
        config = os.path.join(self.path, "transformer", "config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                return json.load(f).get("joint_attention_dim", 4096)
        return 4096

    def identity(self):
        """What the cached features depend on: every file of the parts used (name, size, mtime), the T5 length and
        the dtype. A changed or replaced VAE or text encoder gives another identity, and the cache is rebuilt."""
        files = []
        for part in SD3_REQUIRED + (SD3_OPTIONAL if "t5" in self.text_encoders else ()):
            for root, _, names in sorted(os.walk(os.path.join(self.path, part))):
                for name in sorted(names):
                    stat = os.stat(os.path.join(root, name))
                    files.append([os.path.relpath(os.path.join(root, name), self.path), stat.st_size,
                                  stat.st_mtime_ns])
        trained = {"text_ids": list(self.trained_text)} if self.trained_text else {}  # cached as token ids
        return {**self.spec, "dtype": str(self.dtype).replace("torch.", ""), "files": files, **trained}

    def text_models(self):
        """{name: text encoder}: those adapters can go on (--train_text_encoders), CLIP-L, CLIP-G and T5."""
        return {"clip_l": self.clip_l, "clip_g": self.clip_g, **({"t5": self.t5} if self.t5 is not None else {})}

    def train_text_encoders(self, names):
        """From now on the encoders `names` encode to token ids, and condition runs them (with their adapters,
        with gradients) at each call: they train, on the device from now (T5 whole, never streamed), and are never
        freed. The others are as they were (T5 stays cached unless named)."""
        self.trained_text = check_text_names(names, self.text_models())
        for name in self.trained_text:
            setattr(self, name, getattr(self, name).to(self.device))

    @property
    def device(self):
        return self.vae.device

    @torch.no_grad()
    def encode_latent_distribution(self, images):
        """-> (mean, std) of the latent distribution, scaled and shifted as SD3's transformer sees latents."""
        dist = self.vae.encode(images.to(self.device, self.dtype)).latent_dist
        return (dist.mean - self.shift_factor) * self.scaling_factor, dist.std * self.scaling_factor

    def encode_images(self, images):
        """Deterministic latents (the distribution's mean), e.g. for held-out loss."""
        return self.encode_latent_distribution(images)[0].float()

    @torch.no_grad()
    def decode_latents(self, latents):
        images = self.vae.decode((latents.to(self.device, self.dtype) / self.scaling_factor) + self.shift_factor)
        return images.sample.float().clamp(-1, 1)

    def encoder_sizes(self):
        """{name: (bytes whole, bytes of its layers that can stream, bytes of the buffers they stream through)} of the
        VAE and the text encoders, as held: what building the cache holds on the device (model/memory.py)."""
        sizes = {"VAE": (module_bytes(self.vae), 0, 0), "CLIP-L": (module_bytes(self.clip_l), 0, 0),
                 "CLIP-G": (module_bytes(self.clip_g), 0, 0)}
        if self.t5 is not None and "t5" in self.trained_text:  # it trains: whole on the device, never streamed
            sizes["T5"] = (module_bytes(self.t5), 0, 0)
        elif self.t5 is not None:
            layers = [(module_bytes(layer), tuple(tuple(p.shape) for p in layer.parameters()))
                      for layer in self.t5.encoder.block]  # (the first carries the position bias: a shape alone)
            sizes["T5"] = (module_bytes(self.t5), *swap_sizes(layers, len(layers)))
        return sizes

    def stream_text_encoders(self, names, log=print):
        """Which text encoders (by encoder_sizes' names: "T5") keep their layers in host memory when they come to
        the device, each layer copied in one ahead of its use: what fits the card (model/memory.py
        fit_cache_build). Said before they first encode; the others come whole. `log`: where a warning goes."""
        self.streamed, self.log = tuple(names), log

    def text_encoders_in(self):
        """The text encoders on the device, as stream_text_encoders said (whole by default), once."""
        if self.placed or self.freed:
            return
        self.placed = True
        self.clip_l, self.clip_g = self.clip_l.to(self.device), self.clip_g.to(self.device)
        if self.t5 is not None and "T5" in self.streamed and "t5" not in self.trained_text:
            for name, child in [*self.t5.named_children(), *self.t5.encoder.named_children()]:
                if name not in ("encoder", "block"):  # the embedding, the final norm: on the device for good
                    child.to(self.device)
            self.t5_swap = BlockSwap(self.t5.encoder.block, len(self.t5.encoder.block), self.device, log=self.log)
        elif self.t5 is not None:
            self.t5 = self.t5.to(self.device)

    @torch.no_grad()
    def encode_text(self, captions):
        """-> per encoder "<name>_tokens" and "<name>_pooled" (T5: tokens), or for one that trains "<name>_ids"."""
        captions = list(captions)
        if self.freed:
            raise UserError("the text encoders were freed once training read the cache: only the sample grids' "
                            "prompts are kept encoded")
        self.text_encoders_in()  # on the device, if they are not yet
        features = {}
        clip_limit = self.tokenizers["clip_l"].model_max_length
        self.truncated_captions += sum(len(ids) > clip_limit for ids in self.tokenizers["clip_l"](captions).input_ids)
        for name in self.text_encoders:
            ids = self.token_ids(name, captions)
            features.update({f"{name}_ids": ids} if name in self.trained_text else self.run_encoder(name, ids))
        return features

    def token_ids(self, name, captions):
        """Encoder `name`'s token ids of `captions`, padded to its length (CLIP's 77, --t5_max_length)."""
        tokenizer = self.tokenizers[name]
        length = self.t5_max_length if name == "t5" else tokenizer.model_max_length
        return tokenizer(captions, padding="max_length", max_length=length, truncation=True,
                         return_tensors="pt").input_ids.to(self.device)

    def run_encoder(self, name, ids):
        """Encoder `name` run on token ids -> its features: CLIP's "<name>_tokens" (its penultimate hidden states)
        and "<name>_pooled" (its projection), as diffusers' pipeline takes them; T5's "t5_tokens" (its last
        hidden states). With gradients where its adapters train."""
        encoder = getattr(self, name)
        if name == "t5":
            return {"t5_tokens": encoder(ids.to(encoder.device))[0].to(self.device)}
        out = encoder(ids.to(encoder.device), output_hidden_states=True)
        return {f"{name}_tokens": out.hidden_states[-2].to(self.device),
                f"{name}_pooled": out.text_embeds.to(self.device)}

    def trained_outputs(self, captions):
        """The encoders that train run on `captions` from their ids, as condition runs them at a step (with
        gradients) -> {feature name: tensor}, empty where none trains."""
        return {k: v for name in self.trained_text for k, v in self.run_encoder(name, self.token_ids(name, captions))
                .items()}

    def free_text_encoders(self, prompts, encoded=None):
        """Training from the cache needs no text encoder but for the sample grids' prompts: encode those now (or
        take them `encoded`: condition's tokens and pooled, kept from an earlier run) and free the encoders
        (T5-XXL alone is 9.5 GB in bf16), in GPU and host memory alike; those that train stay, and the prompts'
        features are kept to run through them at each grid."""
        if self.trained_text:
            self.prompt_memo[tuple(prompts)] = self.encode_text(prompts)
        else:
            self.prompt_memo[tuple(prompts)] = encoded or self.condition(self.encode_text(prompts))
        for name in ("clip_l", "clip_g", "t5"):
            if name not in self.trained_text:
                setattr(self, name, None)
        self.t5_swap, self.freed = None, True
        if self.device.type == "cuda":  # torch's allocators keep what they held: give it back to the GPU and the host
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):  # pinned memory (T5's streamed layers)
                torch._C._host_emptyCache()

    @torch.no_grad()
    def encode(self, images, captions):
        mean, std = self.encode_latent_distribution(images)
        return {"latents": mean, "latents_std": std, **self.encode_text(captions)}

    def latents(self, features, generator=None):
        """A sample of the latent distribution (the noise from `generator`, so a resumed run draws the same)."""
        mean, std = features["latents"].float(), features["latents_std"].float()
        return mean + std * to_device(torch.randn(mean.shape, generator=generator), mean.device)

    def condition(self, features, drop=None):
        keep = None if drop is None else (~drop).float()
        for name in self.trained_text:  # run now, from their ids
            if f"{name}_ids" in features:
                features = {**features, **self.run_encoder(name, features[f"{name}_ids"])}

        def part(name, key, index):
            x = features[f"{name}_{key}"].float()
            return x if keep is None else x * keep[:, index].to(x.device).view(-1, *[1] * (x.dim() - 1))

        clip = torch.cat([part("clip_l", "tokens", 0), part("clip_g", "tokens", 1)], dim=-1)
        clip = F.pad(clip, (0, self.joint_attention_dim - clip.shape[-1]))
        if "t5_tokens" in features:
            t5 = part("t5", "tokens", 2)
        else:
            t5 = clip.new_zeros(clip.shape[0], self.t5_max_length, self.joint_attention_dim)
        pooled = torch.cat([part("clip_l", "pooled", 0), part("clip_g", "pooled", 1)], dim=-1)
        return torch.cat([clip, t5], dim=1), pooled

    def encode_prompts(self, captions):
        captions = tuple(captions)
        kept = self.prompt_memo.get(captions)
        if kept is not None:  # features of trained encoders are run through them now
            return self.condition(kept) if isinstance(kept, dict) else kept
        return self.condition(self.encode_text(captions))

    def trained_state_dict(self):
        return {}  # nothing trained: the weights record names the folder

    def load_trained_state_dict(self, state_dict):
        if state_dict:
            raise ValueError(f"SD3 components hold no trained tensors, got {len(state_dict)}")


def check_text_names(names, models):
    """`names` (--train_text_encoders) checked against the encoders `models` has -> a tuple of them."""
    unknown = [name for name in names if name not in models]
    if unknown:
        raise UserError(f"--train_text_encoders {','.join(names)}: these components have no {', '.join(unknown)} "
                        f"that trains here; use {', '.join(models)}")
    return tuple(names)


def drop_captions(tokens, pooled, drop):
    """Zero the text of the samples where `drop` [B] is True: the unconditional input."""
    keep = (~drop).to(tokens.dtype)
    return tokens * keep[:, None, None], pooled * keep[:, None]


def module_bytes(module):
    """Bytes of a module's parameters and buffers as held now (None and freed parts count nothing)."""
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def transformer_widths(components):
    """The transformer sizes that the components fix: the latent channels in and out, the width of the text
    sequence and of the pooled text vector. A preset sets the rest (depth, width, heads, patch, position table)."""
    return {"in_channels": components.latent_channels, "out_channels": components.latent_channels,
            "joint_attention_dim": components.joint_attention_dim,
            "pooled_projection_dim": components.pooled_projection_dim}


def text_tokens(components):
    """The length of the text sequence the transformer reads: CLIP's 77 tokens then T5's (zeros without T5), or the
    built-in encoder's."""
    return 77 + components.t5_max_length if components.spec["kind"] == "sd3" else components.spec["text_max_length"]


def check_widths(components, config, where):
    """Trained weights (`config`, from `where`) must fit the components exactly: a one-line ComponentsError naming
    the widths that differ."""
    bad = [f"{name} {getattr(config, name)} (components: {want})"
           for name, want in transformer_widths(components).items() if getattr(config, name) != want]
    if bad:
        raise ComponentsError(f"{where} does not fit the components ({components.spec['kind']}): " + ", ".join(bad))


def new_components(base, t5_max_length, vocabulary, device="cpu", dtype=None):
    """The frozen components of a fresh model: the SD3 VAE and text encoders of the diffusers folder `base` (held
    in `dtype`), or without one the built-in ones over `vocabulary` (the built-in data's words)."""
    if not base:
        return BuiltinComponents(vocabulary)
    return SD3Components(base, t5_max_length=t5_max_length, device=device, dtype=dtype)


def build_components(spec, device="cpu", dtype=None):
    """Rebuild components from the spec saved in a weights config; `dtype`: what SD3 components are held in
    (None: bf16 on a GPU, fp32 on a CPU). The built-in ones are tiny and stay fp32."""
    if spec["kind"] == "sd3":
        return SD3Components(spec["path"], t5_max_length=spec["t5_max_length"], device=device, dtype=dtype)
    if spec["kind"] != "builtin":
        raise ValueError(f"unknown components kind {spec['kind']!r}")
    return BuiltinComponents(**{k: v for k, v in spec.items() if k != "kind"}).to(device)  # spec = constructor args
