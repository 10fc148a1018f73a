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


def test_the_text_encoder_is_transformers_clip_weight_for_weight_and_bit_for_bit():
    """The built-in encoder's network is our own (model/clip_text.py): from the same seed it holds the weights that
    transformers' CLIPTextModelWithProjection draws, under the same names, and computes its outputs bitwise, so that
    the runs, checkpoints and caches made with transformers' class are this one's."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    for layers, seed in ((2, 0), (1, 3)):
        ours = BuiltinComponents(GRAMMAR_WORDS, text_layers=layers, seed=seed).text_encoder
        tok = ours.tokenizer
        config = CLIPTextConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=512,
                                num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=24,
                                projection_dim=128, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                                eos_token_id=tok.eos_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            theirs = CLIPTextModelWithProjection(config).eval()
        mine, reference = ours.model.state_dict(), theirs.state_dict()
        assert mine.keys() == reference.keys()
        assert all(torch.equal(mine[k], reference[k]) for k in mine), [k for k in mine
                                                                       if not torch.equal(mine[k], reference[k])]
        captions = ["a red star above a green circle", "a green circle", "", "word " * 40]
        with torch.no_grad():
            out = theirs(input_ids=tok(captions))
        tokens, pooled = ours(captions)
        assert torch.equal(tokens, out.last_hidden_state) and torch.equal(pooled, out.text_embeds)
