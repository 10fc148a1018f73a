"""The built-in components: lossless pixel autoencoder, file-free tokenizer, frozen contextual text encoder."""
import torch

from dataset.shapes import GRAMMAR_WORDS
from model.components import BuiltinComponents, WordTokenizer, build_components


def test_pixel_autoencoder_is_lossless():
    comp = BuiltinComponents(GRAMMAR_WORDS)
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    latents = comp.encode_images(images)
    assert latents.shape == (2, comp.latent_channels, 16, 16)
    assert torch.equal(comp.decode_latents(latents), images)


def test_tokenizer_accepts_any_utf8_without_files():
    tok = WordTokenizer(GRAMMAR_WORDS, max_length=8)
    ids = tok(["a red circle", "ein rotes Quadrat über dem Kreis 🙂", "", "word " * 50])
    assert ids.shape == (4, 8)
    assert ids[0, 0] == tok.bos_id and ids[0, 4] == tok.eos_id and ids[0, 5] == tok.pad_id
    assert ids[0, 2] == tok.word_ids["red"]
    assert tok(["Quadrat"])[0, 1] == tok(["quadrat"])[0, 1]  # case-insensitive, stable hash
    assert (ids[3] != tok.pad_id).all()  # long captions are truncated to max_length


def test_text_encoder_is_deterministic_contextual_and_empty_is_zero():
    a, b = BuiltinComponents(GRAMMAR_WORDS), BuiltinComponents(GRAMMAR_WORDS)
    captions = ["a red star above a green circle", "a green circle above a red star", ""]
    tokens, pooled = a.encode_prompts(captions)
    tokens_b, pooled_b = b.encode_prompts(captions)
    assert torch.equal(tokens, tokens_b) and torch.equal(pooled, pooled_b)  # the same encoder on every machine
    assert tokens.shape == (3, 24, a.joint_attention_dim) and pooled.shape == (3, a.pooled_projection_dim)
    # Same words, other order: the meaning differs, so must the encoding (sequence and pooled vector).
    assert not torch.allclose(tokens[0], tokens[1], atol=1e-3)
    assert not torch.allclose(pooled[0], pooled[1], atol=1e-3)
    assert tokens[2].abs().max() == 0 and pooled[2].abs().max() == 0  # empty caption = unconditional input


def test_components_rebuild_from_their_spec_and_saved_state():
    comp = BuiltinComponents(GRAMMAR_WORDS, text_layers=1, seed=3)
    rebuilt = build_components(comp.spec)
    rebuilt.load_trained_state_dict(comp.trained_state_dict())
    caption = ["three pink diamonds"]
    assert torch.equal(comp.encode_prompts(caption)[0], rebuilt.encode_prompts(caption)[0])
