"""The built-in text encoder's network: a CLIP text transformer with a projection, in plain PyTorch. It is
transformers' CLIPTextModelWithProjection (quick-GELU, causal attention, pooled at the first eos token), module for
module: the same parameter names, the same initial weights from the same seed, the same outputs (tests/
test_components.py compares them). Written here because importing transformers' model classes costs some 4 s a
process, twice what importing torch does, for two layers of 128; the real SD3 encoders still come from transformers.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        # created in transformers' order: the random draws of their default initialisation follow it
        self.k_proj, self.v_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.q_proj, self.out_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (proj(x).view(batch, length, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(width // self.heads) ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = self.fc1(x)
        return self.fc2(x * torch.sigmoid(1.702 * x))  # quick GELU


class Layer(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.self_attn, self.layer_norm1 = Attention(width, heads), nn.LayerNorm(width)
        self.mlp, self.layer_norm2 = MLP(width), nn.LayerNorm(width)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class TextTransformer(nn.Module):
    def __init__(self, vocab_size, width, layers, heads, max_length):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.token_embedding = nn.Embedding(vocab_size, width)
        self.embeddings.position_embedding = nn.Embedding(max_length, width)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(Layer(width, heads) for _ in range(layers))
        self.final_layer_norm = nn.LayerNorm(width)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embeddings.token_embedding(ids) + self.embeddings.position_embedding(positions)[None]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.final_layer_norm(x)


class CLIPText(nn.Module):
    """forward(ids [B, L], eos_id) -> (the last hidden states [B, L, width], the projected pooled vector [B, width]):
    CLIPTextModelWithProjection's last_hidden_state and text_embeds."""

    def __init__(self, vocab_size, width, layers, heads, max_length):
        super().__init__()
        self.text_model = TextTransformer(vocab_size, width, layers, heads, max_length)
        init_text_model(self.text_model, width, layers)
        self.text_projection = nn.Linear(width, width, bias=False)
        with torch.no_grad():
            for std in (0.02, width ** -0.5):
                self.text_projection.weight.normal_(std=std)

    def forward(self, ids, eos_id):
        hidden = self.text_model(ids)
        pooled = hidden[torch.arange(len(ids), device=ids.device), (ids == eos_id).int().argmax(-1)]
        return hidden, self.text_projection(pooled)


@torch.no_grad()
def init_text_model(text_model, width, layers):
    """transformers' initialisation, draw for draw (its generic pass, then CLIP's own, each module's children
    before it): the same random numbers end in the same weights."""
    embeddings = text_model.embeddings
    for embedding in (embeddings.token_embedding, embeddings.position_embedding) * 2:
        embedding.weight.normal_(std=0.02)
    attention_std, in_std, fc_std = width ** -0.5, width ** -0.5 * (2 * layers) ** -0.5, (2 * width) ** -0.5
    for layer in text_model.encoder.layers:
        a, m = layer.self_attn, layer.mlp
        draws = [(a.k_proj, 0.02), (a.v_proj, 0.02), (a.q_proj, 0.02), (a.out_proj, 0.02), (a.q_proj, in_std),
                 (a.k_proj, in_std), (a.v_proj, in_std), (a.out_proj, attention_std), (m.fc1, 0.02), (m.fc2, 0.02),
                 (m.fc1, fc_std), (m.fc2, in_std)]
        for linear, std in draws:
            linear.weight.normal_(std=std)
            linear.bias.zero_()
