"""Gated DeltaNet as Qwen3-Next builds it (chapter 12, beside Kimi's KDA layer).

The layer around :mod:`tinyk3.ops.gated_delta_rule` of ``transformers``' ``Qwen3NextGatedDeltaNet``
(``models/qwen3_next/modeling_qwen3_next.py``). With ``Hk`` key heads of ``Dk``, ``Hv = G·Hk`` value
heads of ``Dv``, for a token ``x_t``:

1. Two fused projections without biases. ``in_proj_qkvz`` gives q, k, v and the output gate z,
   **grouped by key head**: for key head ``i`` its block is ``[q_i (Dk) | k_i (Dk) | v (G·Dv) |
   z (G·Dv)]``, the v and z of the ``G`` value heads it serves (``G·i … G·i + G − 1``).
   ``in_proj_ba`` likewise gives per key head ``[b (G) | a (G)]``. :meth:`GatedDeltaNet.split`
   undoes the grouping (``transformers``' ``fix_query_key_value_ordering``).
2. One depthwise causal convolution (no bias, ``K`` taps) and SiLU over q, k, v side by side
   (``conv1d``: ``2·Hk·Dk + Hv·Dv`` channels; z, a, b skip it).
3. ``q ← l2(q) · Dk^-½``, ``k ← l2(k)`` per head (fla's ``l2norm``); q and k repeated to the
   ``Hv`` value heads.
4. ``β = sigmoid(b)``, ``g = −exp(A_log) · softplus(a + dt_bias)`` (one per value head and token,
   :func:`tinyk3.gates.softplus_gate`), then the gated delta rule
   ``S_t = exp(g_t) (I − β_t k_tᵀ k_t) S_{t−1} + β_t k_tᵀ v_t``, ``o_t = q_t S_t``:
   :func:`tinyk3.ops.gated_delta_rule.chunked` for a prompt, one recurrent step for one token.
5. Per value head, ``w ⊙ RMSNorm(o_t) ⊙ SiLU(z_t)`` (``Qwen3NextRMSNormGated``: a plain weight
   starting at 1, not the zero-centred ``1 + w`` of Qwen3-Next's other norms), then ``out_proj``.

Against Kimi's layer (:class:`~tinyk3.layers.KimiDeltaAttention`): one gate per head and token
instead of per channel, from a 1-wide slice of a fused projection instead of a low-rank one;
a SiLU output gate from the same projection as q, k, v instead of a separate sigmoid one;
fused, grouped projections instead of separate ones; more value heads than key heads.

State: :class:`GatedDeltaState` ``(S, conv)``, ``S: [B, Hv, Dk, Dv]`` and the convolution's last
``K − 1`` inputs, split into q, k, v (:class:`ConvState`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn as nn

from .._validate import check_mixer_input, positive_int
from ..gates import init_A_log, init_dt_bias, softplus_gate
from .base import ConvState, check_recurrent_state
from .conv import ShortConvolution
from .forms import run_rule
from .parts import GatedRMSNorm, l2_normalize
from .registry import HeadsSpec, register_mixer

__all__ = ["GatedDeltaNet", "GatedDeltaNetConfig", "GatedDeltaState"]


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's Gated DeltaNet layer: see the module docstring for the computation.

    ``y, new_state = layer(x, state=None)``, ``x, y: [B, T, d_model]``, the interface of every
    mixer; an ``nn.Module`` of its own (not a :class:`~tinyk3.layers.Mixer`: no ``d → d``
    projections with biases here). Arguments (:class:`GatedDeltaNetConfig` holds the same):
    ``n_head`` key heads of ``head_dim``; ``n_v_head`` value heads (0: ``n_head``; a multiple
    of it) of ``v_head_dim`` (0: ``head_dim``); ``conv_size`` taps; ``norm_eps`` of the output
    norm (Qwen3-Next's ``rms_norm_eps``, 1e-6); ``form`` and ``chunk_size`` of the prefill
    (:mod:`tinyk3.layers.forms`: ``"chunked"``, ``"recurrent"`` or ``"triton"``).

    Parameter names and shapes are ``transformers``' and the checkpoint's (``in_proj_qkvz``,
    ``in_proj_ba``, ``conv1d``, ``dt_bias [Hv]``, ``A_log [Hv]``, ``norm``, ``out_proj``), so a
    layer's state dict loads as is (:meth:`from_hf`). Initialisation: ``nn.Linear``'s default,
    ``A`` uniform in ``(0, 16)`` and ``dt_bias = softplus⁻¹(dt)`` (fla's), norm weight 1.
    """

    State: ClassVar[type]  # GatedDeltaState, set below

    def __init__(self, d_model: int, n_head: int, head_dim: int, n_v_head: int = 0,
                 v_head_dim: int = 0, conv_size: int = 4, norm_eps: float = 1e-6,
                 chunk_size: int = 64, form: str = "chunked"):
        super().__init__()
        cfg = GatedDeltaNetConfig(n_head=n_head, head_dim=head_dim, n_v_head=n_v_head,
                                  v_head_dim=v_head_dim, conv_size=conv_size, norm_eps=norm_eps,
                                  chunk_size=chunk_size, form=form)  # validates every argument
        self.form = form
        self.config = cfg
        d = self.d_model = positive_int(d_model, "d_model", "GatedDeltaNet")
        Hk, Hv, Dk, Dv = cfg.n_head, cfg.value_heads, cfg.head_dim, cfg.value_dim
        self.n_head, self.n_v_head, self.head_dim, self.v_head_dim = Hk, Hv, Dk, Dv
        self.conv_size, self.norm_eps, self.chunk_size = conv_size, float(norm_eps), chunk_size
        self.in_proj_qkvz = nn.Linear(d, 2 * Hk * Dk + 2 * Hv * Dv, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * Hv, bias=False)
        self.conv1d = ShortConvolution(2 * Hk * Dk + Hv * Dv, conv_size, bias=False)
        self.dt_bias = nn.Parameter(init_dt_bias(Hv))
        self.A_log = nn.Parameter(init_A_log(Hv))
        self.norm = GatedRMSNorm(Dv, eps=norm_eps, activation="silu")
        self.out_proj = nn.Linear(Hv * Dv, d, bias=False)

    def split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """Undo the grouping by key head of ``in_proj_qkvz`` ``[B, T, 2·Hk·Dk + 2·Hv·Dv]`` and
        ``in_proj_ba`` ``[B, T, 2·Hv]``: ``q, k [B, T, Hk·Dk]``, ``v, z [B, T, Hv·Dv]`` (value
        heads in order), ``b, a [B, T, Hv]``."""
        B, T, _ = qkvz.shape
        Hk, Dk, Dv = self.n_head, self.head_dim, self.v_head_dim
        G = self.n_v_head // Hk  # value heads per key head
        q, k, v, z = qkvz.view(B, T, Hk, 2 * Dk + 2 * G * Dv).split([Dk, Dk, G * Dv, G * Dv], 3)
        b, a = ba.view(B, T, Hk, 2 * G).split([G, G], dim=3)
        return tuple(t.reshape(B, T, -1) for t in (q, k, v, z, b, a))

    def forward(self, x: torch.Tensor, state: GatedDeltaState | None = None):
        """``x [B, T, d]`` and the state returned by the previous call (``None`` to start) →
        ``(y [B, T, d], new_state)``. The state passed in is not modified."""
        name = type(self).__name__
        check_mixer_input(x, self.d_model, name)
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv = self.n_head, self.n_v_head, self.head_dim, self.v_head_dim
        S0, conv_state = check_recurrent_state(state, GatedDeltaState, (B, Hv, Dk, Dv), x, name)
        q, k, v, z, b, a = self.split(self.in_proj_qkvz(x), self.in_proj_ba(x))
        # one convolution over q, k, v side by side; its state is kept split into q, k, v
        widths = [Hk * Dk, Hk * Dk, Hv * Dv]
        past = None if conv_state is None else torch.cat(list(conv_state), dim=1)
        p, new_past = self.conv1d(torch.cat([q, k, v], dim=2), past)
        q, k, v = p.split(widths, dim=2)
        new_conv = ConvState(*new_past.split(widths, dim=1))
        q = l2_normalize(q.reshape(B, T, Hk, Dk).transpose(1, 2)) * Dk ** -0.5  # [B, Hk, T, Dk]
        k = l2_normalize(k.reshape(B, T, Hk, Dk).transpose(1, 2))  # [B, Hk, T, Dk]
        v = v.reshape(B, T, Hv, Dv).transpose(1, 2)  # [B, Hv, T, Dv]
        if Hv != Hk:  # key head i serves value heads G·i … G·i + G − 1
            q, k = (t.repeat_interleave(Hv // Hk, dim=1) for t in (q, k))  # [B, Hv, T, Dk]
        beta = torch.sigmoid(b).transpose(1, 2)  # [B, Hv, T]
        g = softplus_gate(a.transpose(1, 2), self.A_log, self.dt_bias)  # [B, Hv, T], ≤ 0
        # one token: a recurrent step; a prompt: the form (chunkwise by default)
        o, S = run_rule("gated_delta_rule", self.form, q, k, v, beta, g,
                        chunk_size=self.chunk_size, initial_state=S0)
        o = self.norm(o.transpose(1, 2), z.view(B, T, Hv, Dv))  # [B, T, Hv, Dv]
        return self.out_proj(o.reshape(B, T, Hv * Dv)), GatedDeltaState(S, new_conv)

    def state_numel(self, batch_size: int, length: int = 0) -> int:
        """Numbers in the state, for any ``length``: ``B·Hv·Dk·Dv + B·(2·Hk·Dk + Hv·Dv)·(K − 1)``."""
        return self.config.state_numel(batch_size)

    # -- loading ----------------------------------------------------------------------------------

    def load_hf_state_dict(self, state_dict, strict: bool = True):
        """Copy a Qwen3-Next linear-attention layer's tensors (``transformers``' names, which are
        the checkpoint's, relative to the layer: a model loader strips
        ``model.layers.N.linear_attn.``) into this one."""
        return self.load_state_dict(dict(state_dict), strict=strict)

    @classmethod
    def from_hf(cls, layer, *, chunk_size: int = 64) -> GatedDeltaNet:
        """This layer with the sizes and weights of a ``transformers`` ``Qwen3NextGatedDeltaNet``
        (its dtype and device too)."""
        if getattr(layer, "activation", "silu") != "silu":
            raise ValueError(f"GatedDeltaNet.from_hf: the convolution's activation must be "
                             f"SiLU, got {layer.activation!r}")
        if layer.conv1d.bias is not None:
            raise ValueError("GatedDeltaNet.from_hf: the layer's convolution has a bias; "
                             "Qwen3-Next's has none")
        w = layer.in_proj_qkvz.weight
        ours = cls(layer.hidden_size, layer.num_k_heads, layer.head_k_dim,
                   n_v_head=layer.num_v_heads, v_head_dim=layer.head_v_dim,
                   conv_size=layer.conv_kernel_size, norm_eps=layer.norm.variance_epsilon,
                   chunk_size=chunk_size)
        ours.to(device=w.device, dtype=w.dtype)
        ours.load_hf_state_dict(layer.state_dict())
        return ours

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_head={self.n_head}, head_dim={self.head_dim}, "
                f"n_v_head={self.n_v_head}, v_head_dim={self.v_head_dim}, "
                f"conv_size={self.conv_size}")


class GatedDeltaState(NamedTuple):
    """A Gated DeltaNet layer's state: ``S: [B, Hv, Dk, Dv]`` and the convolution's last
    ``K − 1`` inputs (:class:`ConvState`: q, k ``[B, Hk·Dk, K − 1]``, v ``[B, Hv·Dv, K − 1]``)."""

    S: torch.Tensor
    conv: ConvState


GatedDeltaNet.State = GatedDeltaState


@register_mixer
@dataclass(frozen=True)
class GatedDeltaNetConfig(HeadsSpec):
    """A :class:`GatedDeltaNet` layer (arguments as there). Qwen3-Next-80B-A3B's:
    ``GatedDeltaNetConfig(n_head=16, head_dim=128, n_v_head=32)`` at ``d_model = 2048``
    (``transformers``' ``Qwen3NextConfig`` defaults)."""

    n_head: int
    head_dim: int
    n_v_head: int = 0
    v_head_dim: int = 0
    conv_size: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    form: str = "chunked"

    kind: ClassVar[str] = "gated_deltanet"
    rule: ClassVar[str] = "gated_delta_rule"  # the op module of its forms
    module: ClassVar[type] = GatedDeltaNet

    def num_parameters(self, d_model: int) -> int:
        """Exact count: ``in_proj_qkvz`` ``d·(2·Hk·Dk + 2·Hv·Dv)``, ``in_proj_ba`` ``d·2·Hv``,
        ``conv1d`` ``K·(2·Hk·Dk + Hv·Dv)``, ``dt_bias`` and ``A_log`` ``2·Hv``, the norm ``Dv``,
        ``out_proj`` ``Hv·Dv·d``. No biases."""
        d, Hk, Hv, Dk, Dv, K = (d_model, self.n_head, self.value_heads, self.head_dim,
                                self.value_dim, self.conv_size)
        return (d * (2 * Hk * Dk + 2 * Hv * Dv) + d * 2 * Hv + K * (2 * Hk * Dk + Hv * Dv)
                + 2 * Hv + Dv + Hv * Dv * d)

    def state_numel(self, batch_size: int, length: int = 0) -> int:
        """Numbers in the state (any ``length``): ``B·Hv·Dk·Dv + B·(2·Hk·Dk + Hv·Dv)·(K − 1)``."""
        B = positive_int(batch_size, "batch_size", type(self).__name__)
        Hk, Hv, Dk, Dv, K = (self.n_head, self.value_heads, self.head_dim, self.value_dim,
                             self.conv_size)
        return B * Hv * Dk * Dv + B * (2 * Hk * Dk + Hv * Dv) * (K - 1)
