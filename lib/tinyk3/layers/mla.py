"""Multi-head latent attention (MLA; DeepSeek-AI, *DeepSeek-V2*, arXiv 2405.04434, §2.1), the
attention of DeepSeek-V3, Kimi K2, Kimi Linear and Kimi K3 (chapter 13).

For a token ``x_t`` (``d`` wide) and ``H`` heads:

1. The keys and values of all heads come from one latent, ``c_t = RMSNorm(W_DKV x_t)``
   (``r = kv_lora_rank`` wide, 512), and one key shared by all heads carries the position,
   ``k^R_t = RoPE(W_KR x_t)`` (``dr = qk_rope_head_dim`` wide, 64). A decoder caches only
   ``(c_t, k^R_t)``: ``r + dr`` numbers per token per layer (576). NoPE (Kimi Linear, Kimi K3:
   ``use_rope=False``) keeps the shared ``dr`` channels of query and key and rotates nothing;
   ``qk_rope_head_dim=0`` drops them.
2. Per head ``h``: ``k^C_{t,h} = W_UK,h c_t`` (``dn = qk_nope_head_dim``), ``v_{t,h} = W_UV,h c_t``
   (``dv``), the two halves of ``kv_b_proj``; the query ``[q^C_{t,h}, RoPE(q^R_{t,h})]`` comes from
   ``x_t`` through a low-rank path (``q_lora_rank``, with an RMSNorm in between) or one matrix.
3. ``score_{s,t,h} = (q^C_{s,h} · k^C_{t,h} + q^R_{s,h} · k^R_t) / √(dn + dr)``, causal softmax over
   ``t``, ``o_{s,h} = Σ_t p_{s,t,h} v_{t,h}``, heads concatenated, ``W_O`` back to ``d``.
   Kimi K3's gated MLA multiplies the concatenated heads by ``sigmoid(W_G x_s)`` before ``W_O``.

Weight absorption (:meth:`MultiHeadLatentAttention.attend` with ``absorb=True``):
``q^C · W_UK c = (q^C W_UK) · c``, so the query moves into the latent space and the keys are
never expanded; and ``Σ_t p_t W_UV c_t = W_UV Σ_t p_t c_t``, so ``W_UV`` is applied once after
the softmax. RoPE sits between ``W_UK`` and ``c`` only if the rotation were put on ``k^C``, and a
position-dependent rotation cannot be folded into one fixed matrix: hence the separate,
decoupled ``k^R``.

Parameter names are ``transformers``' (``models/deepseek_v3/modeling_deepseek_v3.py``,
``DeepseekV3Attention``), so :meth:`~MultiHeadLatentAttention.from_hf` copies them one to one.
State: :class:`LatentState` ``(c, k_rope)``, growing with the sequence.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn as nn

from .._validate import check_mixer_input, nonnegative_int, positive_int
from ..ops.attention import causal_softmax
from .forms import check_form
from .parts import RMSNorm, rope
from .registry import MixerSpec, register_mixer

__all__ = ["MultiHeadLatentAttention", "MLAConfig", "LatentState", "causal_softmax",
           "attention_window"]

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm take the default eps


class LatentState(NamedTuple):
    """An MLA layer's cache: the normalised latents ``c [B, T_seen, r]`` and the rotated shared
    keys ``k_rope [B, T_seen, dr]`` (``dr = 0`` without RoPE: an empty last dimension)."""

    c: torch.Tensor
    k_rope: torch.Tensor


class MultiHeadLatentAttention(nn.Module):
    """MLA as DeepSeek-V3 builds it (see the module docstring); ``y, state = layer(x, state)``.

    ``use_rope=False``: NoPE (the shared key channels stay, unrotated; order comes from the
    causal mask alone).
    ``form``: the path :meth:`forward` uses (:mod:`tinyk3.layers.forms`): ``"expanded"``, keys
    and values expanded from the latents, or ``"absorbed"``, weights absorbed; the two give the
    same numbers to rounding. ``absorb`` reads and sets the same switch as a bool. Positions
    continue from the state's length (RoPE, ``interleaved`` as ``rope_interleave`` says).
    ``window`` (``None``: the whole context): each query attends to its last ``window`` tokens
    only, an ablation no released model uses (chapter 15 cuts a trained hybrid's attention with
    it, :func:`attention_window`); the cache still holds every token.
    """

    State = LatentState
    window: int | None = None

    def __init__(self, d_model: int, n_head: int, kv_lora_rank: int = 512,
                 qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, v_head_dim: int = 128,
                 q_lora_rank: int = 0, rope_theta: float = 10000.0, rope_interleave: bool = True,
                 output_gate: bool = False, norm_eps: float = LATENT_NORM_EPS,
                 use_rope: bool = True, form: str = "expanded"):
        super().__init__()
        name = "MultiHeadLatentAttention"
        d = self.d_model = positive_int(d_model, "d_model", name)
        H = self.n_head = positive_int(n_head, "n_head", name)
        r = self.kv_lora_rank = positive_int(kv_lora_rank, "kv_lora_rank", name)
        dn = self.qk_nope_head_dim = positive_int(qk_nope_head_dim, "qk_nope_head_dim", name)
        dr = self.qk_rope_head_dim = nonnegative_int(qk_rope_head_dim, "qk_rope_head_dim", name)
        dv = self.v_head_dim = positive_int(v_head_dim, "v_head_dim", name)
        rq = self.q_lora_rank = nonnegative_int(q_lora_rank, "q_lora_rank", name)
        if dr % 2:
            raise ValueError(f"{name}: qk_rope_head_dim must be even (RoPE rotates pairs), got {dr}")
        self.rope_theta, self.rope_interleave = float(rope_theta), bool(rope_interleave)
        self.output_gate = bool(output_gate)
        self.form = check_form(form, "mla", name)
        self.use_rope = bool(use_rope) and dr > 0
        self.scale = (dn + dr) ** -0.5
        if rq:
            self.q_a_proj = nn.Linear(d, rq, bias=False)
            self.q_a_layernorm = RMSNorm(rq, norm_eps)
            self.q_b_proj = nn.Linear(rq, H * (dn + dr), bias=False)
        else:
            self.q_proj = nn.Linear(d, H * (dn + dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, r + dr, bias=False)  # W_DKV and W_KR side by side
        self.kv_a_layernorm = RMSNorm(r, norm_eps)
        self.kv_b_proj = nn.Linear(r, H * (dn + dv), bias=False)  # W_UK and W_UV, per head
        if output_gate:
            self.g_proj = nn.Linear(d, H * dv, bias=False)
        self.o_proj = nn.Linear(H * dv, d, bias=False)

    # -- the pieces ---------------------------------------------------------------------------
    def _positions(self, start: int, T: int, device) -> torch.Tensor:
        return torch.arange(start, start + T, device=device)

    @property
    def absorb(self) -> bool:
        """Whether :meth:`forward` absorbs the weights (``form == "absorbed"``)."""
        return self.form == "absorbed"

    @absorb.setter
    def absorb(self, value: bool) -> None:
        self.form = "absorbed" if value else "expanded"

    def queries(self, x: torch.Tensor, start: int = 0):
        """``x [B, T, d]`` → ``q_nope [B, H, T, dn]`` and the rotated ``q_rope [B, H, T, dr]``."""
        B, T, _ = x.shape
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, self.n_head, -1).transpose(1, 2)  # [B, H, T, dn + dr]
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if self.use_rope:
            q_rope = rope(q_rope, self._positions(start, T, x.device), theta=self.rope_theta,
                          interleaved=self.rope_interleave)
        return q_nope, q_rope

    def latents(self, x: torch.Tensor, start: int = 0):
        """``x [B, T, d]`` → the cached pair: ``c [B, T, r]`` (normalised) and ``k_rope [B, T, dr]``."""
        kv = self.kv_a_proj_with_mqa(x)
        c, k_rope = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        if self.use_rope:
            k_rope = rope(k_rope, self._positions(start, x.shape[1], x.device),
                          theta=self.rope_theta, interleaved=self.rope_interleave)
        return c, k_rope

    def _kv_b(self) -> torch.Tensor:
        """``kv_b_proj``'s weight per head: ``[H, dn + dv, r]``."""
        return self.kv_b_proj.weight.view(self.n_head, self.qk_nope_head_dim + self.v_head_dim,
                                          self.kv_lora_rank)

    def w_uk(self) -> torch.Tensor:
        """``W_UK`` per head, ``[H, dn, r]``: ``k^C_h = W_UK,h c``."""
        return self._kv_b()[:, : self.qk_nope_head_dim]

    def w_uv(self) -> torch.Tensor:
        """``W_UV`` per head, transposed for row vectors: ``[H, r, dv]``, ``v_h = c W_UV,h``."""
        return self._kv_b()[:, self.qk_nope_head_dim:].transpose(1, 2)

    def expand(self, c: torch.Tensor):
        """The naive path's keys and values from the latents: ``k_nope [B, H, S, dn]``,
        ``v [B, H, S, dv]``."""
        B, S, _ = c.shape
        kv = self.kv_b_proj(c).view(B, S, self.n_head, -1).transpose(1, 2)
        return kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    def attend(self, q_nope, q_rope, c, k_rope, *, absorb: bool = False) -> torch.Tensor:
        """Causal attention of ``T`` queries over ``S ≥ T`` cached tokens (the queries are the
        last ``T``): ``o [B, H, T, dv]``, before the output gate and ``o_proj``.

        ``absorb=False`` expands every cached latent into per-head keys and values;
        ``absorb=True`` scores ``(q_nope W_UK) · c`` and applies ``W_UV`` after the softmax."""
        B, H, T, _ = q_nope.shape
        S = c.shape[1]
        rope_scores = q_rope @ k_rope.unsqueeze(1).transpose(-1, -2)  # [B, H, T, S]
        if absorb:
            # every head's queries against the one latent cache: [B, H·T, r] @ [B, r, S], one
            # matrix product that reads the cache once (broadcasting c over H would copy it)
            q_latent = (q_nope @ self.w_uk()).reshape(B, H * T, -1)  # [B, H·T, r]
            scores = (q_latent @ c.transpose(1, 2)).view(B, H, T, S) + rope_scores
            p = causal_softmax(scores * self.scale, window=self.window)  # [B, H, T, S]
            o_latent = (p.reshape(B, H * T, S) @ c).view(B, H, T, -1)  # [B, H, T, r]
            return o_latent @ self.w_uv()  # [B, H, T, r] @ [H, r, dv]
        k_nope, v = self.expand(c)
        scores = q_nope @ k_nope.transpose(-1, -2) + rope_scores
        return causal_softmax(scores * self.scale, window=self.window) @ v

    # -- the layer ----------------------------------------------------------------------------
    def qkv_heads(self) -> dict[str, int]:
        """The projections split by head (Per-Head Muon): the query rows and ``kv_b_proj`` (each
        head's key and value rows together); the latent down-projections have no head axis."""
        return {"q_b_proj" if self.q_lora_rank else "q_proj": self.n_head, "kv_b_proj": self.n_head}

    def forward(self, x: torch.Tensor, state: LatentState | None = None):
        """``x [B, T, d]`` and the previous state → ``(y [B, T, d], LatentState)``."""
        check_mixer_input(x, self.d_model, "MultiHeadLatentAttention")
        start = 0
        if state is not None:
            self._check_state(state, x)
            start = state.c.shape[1]
        q_nope, q_rope = self.queries(x, start)
        c, k_rope = self.latents(x, start)
        if state is not None:
            c = torch.cat([state.c, c], dim=1)
            k_rope = torch.cat([state.k_rope, k_rope], dim=1)
        o = self.attend(q_nope, q_rope, c, k_rope, absorb=self.absorb)  # [B, H, T, dv]
        B, H, T, dv = o.shape
        o = o.transpose(1, 2).reshape(B, T, H * dv)
        if self.output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o), LatentState(c, k_rope)

    def _check_state(self, state, x: torch.Tensor) -> None:
        name = "MultiHeadLatentAttention"
        if not isinstance(state, LatentState):
            raise TypeError(f"{name}: the state must be the LatentState this layer returned, "
                            f"got {type(state).__name__}")
        B = x.shape[0]
        for field, t, width in (("c", state.c, self.kv_lora_rank),
                                ("k_rope", state.k_rope, self.qk_rope_head_dim)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != B or t.shape[2] != width:
                raise ValueError(f"{name}: state.{field} must be [B={B}, T, {width}], got "
                                 f"{tuple(getattr(t, 'shape', ()))}")
            if t.dtype != x.dtype or t.device != x.device:
                raise TypeError(f"{name}: state.{field} is {t.dtype} on {t.device}, the input "
                                f"{x.dtype} on {x.device}")
        if state.c.shape[1] != state.k_rope.shape[1]:
            raise ValueError(f"{name}: state.c and state.k_rope differ in length")

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers cached after ``length`` tokens: ``B · T · (r + dr)``."""
        return batch_size * length * (self.kv_lora_rank + self.qk_rope_head_dim)

    # -- transformers -------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, layer) -> MultiHeadLatentAttention:
        """This layer with the weights of ``transformers``' ``DeepseekV3Attention`` (default RoPE
        only: the released DeepSeek-V3's YaRN scaling of frequencies and scores is not built)."""
        cfg = layer.config
        rope_params = getattr(cfg, "rope_parameters", None) or {}
        if rope_params.get("rope_type", "default") != "default":
            raise NotImplementedError(f"MultiHeadLatentAttention.from_hf: rope_type "
                                      f"{rope_params.get('rope_type')!r} is not built (default only)")
        if getattr(cfg, "attention_bias", False):
            raise NotImplementedError("MultiHeadLatentAttention.from_hf: attention_bias=True is not built")
        w = layer.kv_b_proj.weight
        ours = cls(cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank,
                   cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                   cfg.q_lora_rank or 0, rope_params.get("rope_theta", 10000.0),
                   bool(getattr(cfg, "rope_interleave", True)),
                   norm_eps=layer.kv_a_layernorm.variance_epsilon,
                   use_rope=type(layer).__name__ != "KimiLinearAttention")
        ours.to(device=w.device, dtype=w.dtype)
        sd = {k: v for k, v in layer.state_dict().items() if not k.endswith("inv_freq")}
        ours.load_state_dict(sd)
        return ours

    # -- QK-Clip (chapter 16, tinyk3.optim): this layer's rule ----------------------------------

    def check_qk_clip(self) -> None:
        """MLA's logits are linear in its query and key up-projections: always clippable."""

    def qk_logits(self, x: torch.Tensor):
        """``(q, k, scale)``: per-head queries and keys ``[q_nope, q_rope]``, ``[k_nope, k_rope]``
        (the shared ``k_rope`` repeated over heads; rotated unless NoPE) and ``(dn + dr)^-½``."""
        q_nope, q_rope = self.queries(x)
        c, k_rope = self.latents(x)
        k_nope, _ = self.expand(c)
        k_rope = k_rope.unsqueeze(1).expand(-1, self.n_head, -1, -1)
        return torch.cat([q_nope, q_rope], dim=-1), torch.cat([k_nope, k_rope], dim=-1), self.scale

    def qk_clip_rows_(self, eta: torch.Tensor, alpha: float) -> None:
        """Head ``h``'s ``q_nope`` rows times ``η_h^α``, its ``q_rope`` rows times ``η_h`` (the
        rope key is shared by all heads, so its part of the logit is scaled through the query
        alone), its ``W_UK`` rows of ``kv_b_proj`` times ``η_h^(1−α)``; ``W_UV`` untouched
        (Megatron-LM's ``clip_qk``)."""
        H, dn, dr, dv = self.n_head, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q_proj = self.q_b_proj if self.q_lora_rank else self.q_proj
        s_q = torch.cat([eta.pow(alpha)[:, None].expand(H, dn), eta[:, None].expand(H, dr)], 1)
        q_proj.weight.mul_(s_q.reshape(-1, 1).to(q_proj.weight))
        s_kv = torch.cat([eta.pow(1 - alpha)[:, None].expand(H, dn), torch.ones(H, dv)], 1)
        self.kv_b_proj.weight.mul_(s_kv.reshape(-1, 1).to(self.kv_b_proj.weight))

    def extra_repr(self) -> str:
        q = f"q_lora_rank={self.q_lora_rank}, " if self.q_lora_rank else ""
        return (f"d_model={self.d_model}, n_head={self.n_head}, {q}kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}, use_rope={self.use_rope}, "
                f"output_gate={self.output_gate}, form={self.form!r}")


@register_mixer
@dataclass(frozen=True)
class MLAConfig(MixerSpec):
    """A :class:`MultiHeadLatentAttention` layer (arguments as there). DeepSeek-V3:
    ``MLAConfig(n_head=128, q_lora_rank=1536)`` at ``d_model = 7168``, with the defaults
    ``kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128``. Kimi Linear:
    ``MLAConfig(n_head=32, use_rope=False)`` at 2304 (NoPE, the 64 shared channels kept)."""

    n_head: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: int = 0
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    output_gate: bool = False
    norm_eps: float = LATENT_NORM_EPS
    use_rope: bool = True
    form: str = "expanded"

    kind: ClassVar[str] = "mla"
    module: ClassVar[type] = MultiHeadLatentAttention

    def __post_init__(self) -> None:
        for f in ("qk_rope_head_dim", "q_lora_rank"):  # 0 allowed: NoPE, full-rank queries
            nonnegative_int(getattr(self, f), f, "MLAConfig")
        for f in ("n_head", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            positive_int(getattr(self, f), f, "MLAConfig")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("MLAConfig: norm_eps and rope_theta must be positive")
        check_form(self.form, "mla", "MLAConfig")

    def check(self, d_model: int) -> None:
        """Any ``d_model`` works: the heads' widths are set by their own fields."""
        positive_int(d_model, "d_model", "MLAConfig")

    def num_parameters(self, d_model: int) -> int:
        """Exact count: queries ``d·rq + rq + rq·H·(dn + dr)`` (low rank, with its norm) or
        ``d·H·(dn + dr)``; ``W_DKV, W_KR`` ``d·(r + dr)``; the latent norm ``r``; ``W_UK, W_UV``
        ``r·H·(dn + dv)``; the output gate ``d·H·dv`` (if any); ``W_O`` ``H·dv·d``. No biases."""
        d, H, r, dn, dr, dv, rq = (d_model, self.n_head, self.kv_lora_rank, self.qk_nope_head_dim,
                                   self.qk_rope_head_dim, self.v_head_dim, self.q_lora_rank)
        q = d * rq + rq + rq * H * (dn + dr) if rq else d * H * (dn + dr)
        gate = d * H * dv if self.output_gate else 0
        return q + d * (r + dr) + r + r * H * (dn + dv) + gate + H * dv * d

    def state_numel(self, batch_size: int, length: int) -> int:
        """Numbers cached after ``length`` tokens: ``B · T · (r + dr)`` (576 per token at
        DeepSeek-V3's sizes, and at Kimi Linear's, whose NoPE keeps the 64 shared channels)."""
        return batch_size * length * (self.kv_lora_rank + self.qk_rope_head_dim)


@contextmanager
def attention_window(model: nn.Module, window: int | None):
    """Inside the ``with`` block, every :class:`MultiHeadLatentAttention` in ``model`` attends
    to its last ``window`` tokens only (``None``: all of them); the weights are untouched, and
    each layer's own window comes back on exit. An ablation: what a trained model loses when
    its attention cannot reach further back (chapter 15)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"attention_window: window must be a positive int or None, got "
                         f"{window!r}")
    layers = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    if not layers:
        raise ValueError("attention_window: the model has no MultiHeadLatentAttention layer")
    before = [m.window for m in layers]
    try:
        for m in layers:
            m.window = window
        yield model
    finally:
        for m, w in zip(layers, before):
            m.window = w
