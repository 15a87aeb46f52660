"""Causal multi-head softmax attention (GPT-2's, chapter 1) with its KV cache (chapter 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ops.attention import causal_attention, causal_attention_loop, causal_attention_sdpa
from .base import KVState, Mixer
from .forms import check_form
from .parts import rope as apply_rope
from .registry import MixerSpec, register_mixer

__all__ = ["SoftmaxAttention", "SoftmaxAttentionConfig", "KVState"]


class SoftmaxAttention(Mixer):
    """Causal multi-head softmax attention (GPT-2's, chapter 1) with a KV cache (chapter 2).

    ``o = softmax(q kᵀ/√D + mask) v`` through :func:`tinyk3.ops.attention.causal_attention_sdpa`.
    ``rope=True`` rotates each head's queries and keys by their tokens' positions (RoPE, Su et
    al. 2021, half-split pairs as in Llama; chapter 13), after the convolution and before the
    cache, so the cache holds rotated keys and a new token's position is the cache's length.
    GPT-2 itself has learned absolute positions instead (``LMConfig.pos_emb``).
    State: :class:`KVState` ``(k, v, conv)``, the keys and values of every token so far.
    New tokens' keys and values are appended (a new tensor; the old state is untouched) and the
    new queries see the whole cache through a bottom-right causal mask.
    Size: ``2·B·H·T·D = 2·B·T·d`` numbers, growing with T (:meth:`state_numel`).
    """

    State = KVState
    FORMS = {"sdpa": causal_attention_sdpa, "masked": causal_attention, "loop": causal_attention_loop}

    def __init__(self, d_model: int, n_head: int, conv_size: int = 0, form: str = "sdpa",
                 rope: bool = False, rope_theta: float = 10000.0):
        super().__init__(d_model, n_head, conv_size)
        self.form = check_form(form, "attention", type(self).__name__)
        if rope and self.head_dim % 2:
            raise ValueError(f"SoftmaxAttention: RoPE rotates pairs of channels, so the head "
                             f"size must be even, got {self.head_dim}")
        self.rope, self.rope_theta = bool(rope), float(rope_theta)

    def _rotate(self, q, k, start: int):
        """Queries and keys rotated by positions ``start, start + 1, ...`` (if ``rope``)."""
        if not self.rope:
            return q, k
        positions = torch.arange(start, start + q.shape[2], device=q.device)
        return (apply_rope(q, positions, theta=self.rope_theta),
                apply_rope(k, positions, theta=self.rope_theta))

    def _mix(self, q, k, v, x, state):
        past_k = past_v = None
        if state is not None:
            past_k, past_v = self._check_state(state, q)
        # RoPE (if on): the new tokens' positions follow the cached ones'
        q, k = self._rotate(q, k, 0 if past_k is None else past_k.shape[2])
        if state is not None:
            k = torch.cat([past_k, k], dim=2)  # [B, H, T_past + T, D]
            v = torch.cat([past_v, v], dim=2)  # [B, H, T_past + T, D]
        # o = softmax(q kᵀ / √D + mask) v, the new queries being the last T of T_past + T
        y = self.FORMS[self.form](q, k, v)  # [B, H, T, D]
        return y, (k, v)

    def _check_state(self, state: KVState, q: torch.Tensor):
        k, v = state.k, state.v
        B, H, _, D = q.shape
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"SoftmaxAttention: cached {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != D:
                raise ValueError(
                    f"SoftmaxAttention: cached {name} must be [B={B}, H={H}, T, D={D}], got {tuple(t.shape)}"
                )
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(
                    f"SoftmaxAttention: cached {name} is {t.dtype} on {t.device}, "
                    f"the input {q.dtype} on {q.device}"
                )
        if k.shape[2] != v.shape[2]:
            raise ValueError(
                f"SoftmaxAttention: cached k and v differ in length: {k.shape[2]} vs {v.shape[2]}"
            )
        return k, v

    # -- QK-Clip (chapter 16, tinyk3.optim): this layer's rule ----------------------------------

    def check_qk_clip(self) -> None:
        """QK-Clip scales the projections, so the logits must be linear in them."""
        if self.conv_size:
            raise ValueError("QK-Clip: this SoftmaxAttention has a short convolution (with a "
                             "SiLU) on q and k, so scaling the projections does not scale the "
                             "logits; QK-Clip needs q and k linear in their weights")

    def qk_logits(self, x: torch.Tensor):
        """``(q, k, scale)``: the queries and keys of ``x`` (rotated, with RoPE) and the
        logits' scale ``D^-½``."""
        q, k, _, _ = self.qkv(x)
        q, k = self._rotate(q, k, 0)
        return q, k, self.head_dim ** -0.5

    def qk_clip_rows_(self, eta: torch.Tensor, alpha: float) -> None:
        """Head ``h``'s rows of ``q_proj`` times ``η_h^α`` and of ``k_proj`` times
        ``η_h^(1−α)`` (weights and biases): every logit of the head times ``η_h``."""
        D = self.head_dim
        for proj, power in ((self.q_proj, alpha), (self.k_proj, 1 - alpha)):
            s = eta.pow(power).repeat_interleave(D).to(proj.weight)  # [H·D]
            proj.weight.mul_(s[:, None])
            if proj.bias is not None:
                proj.bias.mul_(s)

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers in the KV cache after ``length`` tokens: K and V, ``2·B·H·T·D``."""
        return 2 * batch_size * self.n_head * length * self.head_dim + self._conv_numel(batch_size)


@register_mixer
@dataclass(frozen=True)
class SoftmaxAttentionConfig(MixerSpec):
    """A :class:`SoftmaxAttention` layer: ``n_head`` heads of ``d_model / n_head``,
    ``conv_size`` taps of short convolution on q, k, v (0: none; GPT-2 has none), and RoPE on
    q and k if ``rope`` (base ``rope_theta``)."""

    n_head: int
    conv_size: int = 0
    form: str = "sdpa"
    rope: bool = False
    rope_theta: float = 10000.0

    kind: ClassVar[str] = "softmax"
    module: ClassVar[type] = SoftmaxAttention

    def __post_init__(self) -> None:
        super().__post_init__()
        check_form(self.form, "attention", type(self).__name__)
        if not isinstance(self.rope, bool):
            raise TypeError(f"SoftmaxAttentionConfig: rope must be True or False, got "
                            f"{self.rope!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"SoftmaxAttentionConfig: rope_theta must be positive, got "
                             f"{self.rope_theta!r}")
