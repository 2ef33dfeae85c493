"""A small transformer encoder with random weights, in plain torch (benchmark.py --model encoder).

Input: a batch of already-embedded token sequences, float (batch, SEQ, D_MODEL); output: the mean
of the last layer over the sequence, (batch, D_MODEL). Pre-norm layers (LayerNorm -> attention ->
residual, LayerNorm -> GELU MLP -> residual), attention through ``scaled_dot_product_attention``.
Every reshape names only the trailing dimensions, so a trace keeps the batch dimension dynamic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SEQ = 64        # tokens per request
D_MODEL = 256
HEADS = 4
LAYERS = 4
FFN = 4 * D_MODEL


class EncoderLayer(nn.Module):
    def __init__(self, d: int = D_MODEL, heads: int = HEADS, ffn: int = FFN):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ffn)
        self.ff2 = nn.Linear(ffn, d)

    def forward(self, x):                                    # (B, S, d)
        qkv = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1))   # (B, S, 3, H, d/H)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)       # each (B, H, S, d/H)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).flatten(-2))
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class Encoder(nn.Module):
    def __init__(self, layers: int = LAYERS, seq: int = SEQ, d: int = D_MODEL):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.layers = nn.Sequential(*[EncoderLayer(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.layers(x + self.pos)).mean(dim=1)


def build_encoder(seed: int = 0) -> nn.Module:
    """4 layers, d=256, 4 heads, MLP 1024, 64 tokens (3.2 M parameters); random weights."""
    torch.manual_seed(seed)
    return Encoder().eval()
