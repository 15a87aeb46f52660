"""Qwen3-Next's full-attention layer: grouped-query softmax attention with RMS-normed queries
and keys, partial RoPE and a sigmoid output gate (Qwen Team, *Qwen3-Next*, 2025; ``transformers``'
``Qwen3NextAttention`` in ``models/qwen3_next/modeling_qwen3_next.py``).

For ``H`` query heads and ``Hkv`` key/value heads of ``D`` (grouped-query attention: query head
``h`` reads key/value head ``h // (H / Hkv)``):

1. ``q_proj`` gives each head ``2D`` numbers: its query and its output gate;
2. ``q ← RMSNorm(q)``, ``k ← RMSNorm(k)`` per head (zero-centred weights, ``1 + w``);
3. RoPE (rotate-half) on the first ``partial_rotary_factor · D`` channels of q and k only;
4. ``o = softmax(q kᵀ / √D + causal mask) v``; heads concatenated; ``o ⊙ σ(gate)``; ``o_proj``.

State: :class:`~tinyk3.layers.KVState` ``(k, v, None)``, ``[B, Hkv, T_seen, D]`` after norm and
RoPE: a grouped-query KV cache, ``H / Hkv`` times smaller than one per query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from .._validate import check_mixer_input, positive_int
from ..ops.attention import causal_softmax
from .base import KVState
from .forms import check_form
from .parts import RMSNorm, rope
from .registry import MixerSpec, register_mixer

__all__ = ["GatedAttention", "GatedAttentionConfig"]


class GatedAttention(nn.Module):
    """Qwen3-Next's gated grouped-query attention (see the module docstring)."""

    State = KVState

    def __init__(self, d_model: int, n_head: int, n_kv_head: int, head_dim: int,
                 partial_rotary_factor: float = 0.25, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-6, form: str = "masked"):
        super().__init__()
        name = "GatedAttention"
        self.form = check_form(form, "gated_attention", name)  # one form: the masked softmax
        d = self.d_model = positive_int(d_model, "d_model", name)
        H = self.n_head = positive_int(n_head, "n_head", name)
        Hkv = self.n_kv_head = positive_int(n_kv_head, "n_kv_head", name)
        D = self.head_dim = positive_int(head_dim, "head_dim", name)
        if H % Hkv:
            raise ValueError(f"{name}: n_head ({H}) must be a multiple of n_kv_head ({Hkv})")
        self.rotary_dim = int(D * partial_rotary_factor)
        if not 0 <= self.rotary_dim <= D or self.rotary_dim % 2:
            raise ValueError(f"{name}: partial_rotary_factor·head_dim must be an even number of "
                             f"channels in [0, {D}], got {self.rotary_dim}")
        self.partial_rotary_factor, self.rope_theta = float(partial_rotary_factor), float(rope_theta)
        self.q_proj = nn.Linear(d, H * D * 2, bias=False)  # query and output gate, per head
        self.k_proj = nn.Linear(d, Hkv * D, bias=False)
        self.v_proj = nn.Linear(d, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, d, bias=False)
        self.q_norm = RMSNorm(D, norm_eps, centred=True)
        self.k_norm = RMSNorm(D, norm_eps, centred=True)

    def _rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        if not self.rotary_dim:
            return x
        pos = torch.arange(start, start + x.shape[2], device=x.device)
        rot = rope(x[..., : self.rotary_dim], pos, theta=self.rope_theta)
        return torch.cat([rot, x[..., self.rotary_dim:]], dim=-1)

    def qkv_heads(self) -> dict[str, int]:
        """The projections split by head (Per-Head Muon); ``q_proj``'s blocks hold each head's
        query and gate rows."""
        return {"q_proj": self.n_head, "k_proj": self.n_kv_head, "v_proj": self.n_kv_head}

    def forward(self, x: torch.Tensor, state: KVState | None = None):
        check_mixer_input(x, self.d_model, "GatedAttention")
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        start = 0
        if state is not None:
            if not isinstance(state, KVState):
                raise TypeError(f"GatedAttention: the state must be the KVState this layer "
                                f"returned, got {type(state).__name__}")
            if state.k.shape[:2] != (B, Hkv) or state.k.shape[3] != D:
                raise ValueError(f"GatedAttention: cached k must be [B={B}, {Hkv}, T, {D}], got "
                                 f"{tuple(state.k.shape)}")
            start = state.k.shape[2]
        q, gate = self.q_proj(x).view(B, T, H, 2 * D).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q).transpose(1, 2), start)  # [B, H, T, D]
        k = self._rope(self.k_norm(self.k_proj(x).view(B, T, Hkv, D)).transpose(1, 2), start)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
        if state is not None:
            k, v = torch.cat([state.k, k], dim=2), torch.cat([state.v, v], dim=2)
        group = H // Hkv
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = causal_softmax(q @ kk.transpose(-1, -2) * D ** -0.5) @ vv  # [B, H, T, D]
        o = o.transpose(1, 2).reshape(B, T, H * D) * torch.sigmoid(gate.reshape(B, T, H * D))
        return self.o_proj(o), KVState(k, v, None)

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers cached after ``length`` tokens: ``2 · B · Hkv · T · D``."""
        return 2 * batch_size * self.n_kv_head * length * self.head_dim

    @classmethod
    def from_hf(cls, layer) -> GatedAttention:
        """This layer with the weights of ``transformers``' ``Qwen3NextAttention``."""
        cfg = layer.config
        rp = getattr(cfg, "rope_parameters", None) or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(f"GatedAttention.from_hf: rope_type {rp.get('rope_type')!r}"
                                      " is not built (default only)")
        if getattr(cfg, "attention_bias", False):
            raise NotImplementedError("GatedAttention.from_hf: attention_bias=True is not built")
        w = layer.q_proj.weight
        ours = cls(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   layer.head_dim, rp.get("partial_rotary_factor", 1.0),
                   rp.get("rope_theta", 10000.0), layer.q_norm.eps)
        ours.to(device=w.device, dtype=w.dtype)
        ours.load_state_dict(layer.state_dict())
        return ours

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, "
                f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}")


@register_mixer
@dataclass(frozen=True)
class GatedAttentionConfig(MixerSpec):
    """A :class:`GatedAttention` layer. Qwen3-Next-80B-A3B: ``GatedAttentionConfig(n_head=16,
    n_kv_head=2, head_dim=256)`` at ``d_model = 2048``."""

    n_head: int
    n_kv_head: int
    head_dim: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    form: str = "masked"

    kind: ClassVar[str] = "gated_attention"
    module: ClassVar[type] = GatedAttention

    def __post_init__(self) -> None:
        super().__post_init__()
        check_form(self.form, "gated_attention", "GatedAttentionConfig")

    def check(self, d_model: int) -> None:
        positive_int(d_model, "d_model", "GatedAttentionConfig")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GatedAttentionConfig: n_head ({self.n_head}) must be a multiple of "
                             f"n_kv_head ({self.n_kv_head})")

    def num_parameters(self, d_model: int) -> int:
        """``q_proj`` ``d·2HD``, ``k_proj`` and ``v_proj`` ``2·d·Hkv·D``, ``o_proj`` ``HD·d``,
        the two norms ``2D``. No biases."""
        d, H, Hkv, D = d_model, self.n_head, self.n_kv_head, self.head_dim
        return d * 2 * H * D + 2 * d * Hkv * D + H * D * d + 2 * D

    def state_numel(self, batch_size: int, length: int) -> int:
        return 2 * batch_size * self.n_kv_head * length * self.head_dim
