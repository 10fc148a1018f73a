"""LoKr: a low-rank Kronecker update of a frozen nn.Linear, written by hand (LyCORIS's formulation, our code).

    W x  ->  W x + scale * kron(w1, w2) x,   w1: [out_l, in_m],  w2: [out_k, in_n] or w2_a [out_k, r] @ w2_b [r, in_n]

`factorization` splits each dimension in two as LyCORIS does (out = out_l * out_k, in = in_m * in_n); w2 is
low-rank where the rank is below half its larger side, else full. The scale is alpha / rank only where a low-rank
factor exists, 1 otherwise: ComfyUI's rule when it reads the file (`comfy/weight_adapter/lokr.py`). w2 (or w2_b)
starts at zero, so training starts at W. The parameters carry the names of the file's keys (`lokr_w1`, `lokr_w2`
or `lokr_w2_a`/`lokr_w2_b`) beside the layer's `weight` and `bias` (../shared/REFERENCE.md section 18).
"""
import math

import torch
import torch.nn as nn

from model.adapter_merge import DeltaMerge


def factorization(dimension, factor=-1):
    """dimension -> (m, n), m <= n, m * n = dimension: with `factor` > 0 dividing it, (factor, dimension / factor)
    ordered; else the pair closest to a square whose smaller side is at most `factor` (any, for -1). LyCORIS's
    `factorization`, so our shapes are the ones other LoKr tools make."""
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (n, m) if m > n else (m, n)
    if factor < 0:
        factor = dimension
    m, n = 1, dimension
    length = m + n
    while m < n:
        new_m = m + 1
        while dimension % new_m != 0:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > length or new_m > factor:
            break
        m, n, length = new_m, new_n, new_m + new_n
    return (n, m) if m > n else (m, n)


class LoKrLinear(DeltaMerge, nn.Linear):
    """An nn.Linear (the same weight and bias parameters, so the same state-dict names) plus a LoKr update, its
    factors trained in fp32 on `device` (None: where the weight is)."""

    kind = "lokr"

    def __init__(self, base, rank, alpha, factor=-1, dropout=0.0, device=None):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate and initialise a weight we do not want
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        device = device or base.weight.device
        (out_l, out_k), (in_m, in_n) = factorization(self.out_features, factor), factorization(self.in_features, factor)
        self.shape = (out_l, out_k, in_m, in_n)
        self.lokr_w1 = nn.Parameter(torch.empty(out_l, in_m, device=device))
        nn.init.kaiming_uniform_(self.lokr_w1, a=math.sqrt(5))
        self.low_rank = rank < max(out_k, in_n) / 2
        if self.low_rank:
            self.lokr_w2_a = nn.Parameter(torch.empty(out_k, rank, device=device))
            nn.init.kaiming_uniform_(self.lokr_w2_a, a=math.sqrt(5))
            self.lokr_w2_b = nn.Parameter(torch.zeros(rank, in_n, device=device))
        else:
            self.lokr_w2 = nn.Parameter(torch.zeros(out_k, in_n, device=device))
        self.rank, self.alpha, self.factor = rank, alpha, factor
        self.scale = alpha / rank if self.low_rank else 1.0
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def adapter_tensors(self):
        """{the file key's suffix: parameter}, in the order the optimizer holds them."""
        if self.low_rank:
            return {"lokr_w1": self.lokr_w1, "lokr_w2_a": self.lokr_w2_a, "lokr_w2_b": self.lokr_w2_b}
        return {"lokr_w1": self.lokr_w1, "lokr_w2": self.lokr_w2}

    def w2(self, dtype):
        return (self.lokr_w2_a.to(dtype) @ self.lokr_w2_b.to(dtype)) if self.low_rank else self.lokr_w2.to(dtype)

    def delta_weight(self):
        """scale * kron(w1, w2) in fp32: the change this adapter makes to the base weight."""
        return self.scale * torch.kron(self.lokr_w1.float(), self.w2(torch.float32))

    def forward(self, x):
        base = super().forward(x)
        if self.merged:
            return base
        dtype = base.dtype
        out_l, out_k, in_m, in_n = self.shape
        # kron(w1, w2) x without the [out, in] product: x as [tokens, in_m, in_n], w2 along in_n, w1 along in_m
        z = self.dropout(x).to(dtype).reshape(-1, in_m, in_n) @ self.w2(dtype).t()  # [tokens, in_m, out_k]
        update = torch.matmul(self.lokr_w1.to(dtype), z)  # [tokens, out_l, out_k]
        return base + (self.scale * update).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"{super().extra_repr()}, lokr rank={self.rank}, alpha={self.alpha}, factors={self.shape}"

