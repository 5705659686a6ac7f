"""The built-in GPT: a small decoder-only transformer in the Llama style.

Pre-norm blocks with RMSNorm, rotary position embeddings (RoPE), causal self-attention through
``F.scaled_dot_product_attention`` (flash/memory-efficient kernels where available), a SwiGLU MLP, no biases,
and an output projection tied to the token embedding. Initialization follows nanoGPT: N(0, 0.02), with the
two projections that write into the residual stream scaled down by ``1/sqrt(2 * n_layer)``.

The model is described completely by ``GPTConfig``, which round-trips through plain JSON: a worker receives
the config, never code, and builds the same module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(kw_only=True)
class GPTConfig:
    """Shape of a built-in GPT.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        n_layer: transformer blocks.
        n_head: attention heads; ``d_model / n_head`` must be an even integer (RoPE rotates pairs).
        d_model: width of the residual stream.
        d_ff: hidden width of the SwiGLU MLP (its three matrices are d_model x d_ff).
        max_seq_len: longest sequence the RoPE tables are built for.
        rope_theta: RoPE base; larger stretches the lowest frequency over longer contexts.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 8192
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 512
    d_ff: int = 2048
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            # bool is an int subclass; a JSON `true` here is a mistake, not a 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if (self.d_model // self.n_head) % 2 != 0:
            raise ValueError(f"head dim d_model/n_head = {self.d_model // self.n_head} must be even for RoPE")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1.0):
            raise ValueError(f"rope_theta must be a finite number > 1, got {self.rope_theta}")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0.0):
            raise ValueError(f"norm_eps must be a positive finite number, got {self.norm_eps}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict[str, Any]:
        """Plain ints and floats only: ``json.dumps`` works on the result."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        # An unknown key is most likely a typo or a config from a newer version: refuse it rather than
        # silently building a different model than the sender meant.
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**d)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angle ``t * theta**(-2i/head_dim)``, each (max_seq_len, head_dim/2); on the
    meta device (a model built for its shapes) only their shapes."""
    if torch.get_default_device().type == "meta":
        return torch.empty(max_seq_len, head_dim // 2), torch.empty(max_seq_len, head_dim // 2)
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (T, hd/2)
    # Built in float64 so long positions keep their precision, stored in float32.
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + hd/2]) of x (B, nh, T, hd) by the angles in cos/sin (T, hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hd/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.proj(y)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: a gated MLP, better per parameter than a plain GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, d_ff) inside, (B, T, C) out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Weight tying: one (vocab, d_model) matrix both embeds tokens and scores them. It saves
        # vocab * d_model parameters, and named_parameters() lists it once (as tok_emb.weight).
        self.lm_head.weight = self.tok_emb.weight

        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Not persistent: derived from the config, so they stay out of state_dict and checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hd/2)

        self.apply(self._init_weights)
        # The attention output and MLP down projections each add to the residual stream once per layer;
        # scaling them keeps the stream's variance from growing with depth (GPT-2 paper, nanoGPT).
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.down.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Distinct parameters: the tied embedding counts once."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) for token ids idx (B, T); with targets (B, T), also the mean cross-entropy.

        Target positions equal to -100 are ignored, as in ``F.cross_entropy`` and HF models.
        """
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd/2)
        x = self.tok_emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        # float32 for the softmax even under autocast: bf16 log-sum-exp over 8k+ classes loses digits.
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss
