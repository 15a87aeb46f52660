"""Kimi Delta Attention as a token mixer (chapter 12): the layer of Kimi Linear, and Kimi K3's
variant of it.

The layer around :mod:`tinyk3.ops.kda`, as Kimi Linear builds it (``transformers``'
``KimiLinearDeltaAttention`` in ``models/kimi_linear/modeling_kimi_linear.py``; fla's
``KimiDeltaAttention`` in ``fla/layers/kda.py``). For a token ``x_t`` (``d`` wide), with ``H``
key heads of ``Dk`` and ``HV`` value heads of ``Dv``:

1. ``q, k, v = W_q x, W_k x, W_v x`` (no biases; ``H·Dk``, ``H·Dk`` and ``HV·Dv`` wide), each
   through a depthwise causal convolution of ``K`` taps and SiLU (:class:`ShortConvolution`,
   no bias); the last ``K − 1`` projected tokens are the convolution state.
2. Per head, ``q ← l2(q) · Dk^-½`` and ``k ← l2(k)``, with fla's ``l2(x) = x / √(‖x‖² + 10⁻⁶)``
   (:func:`l2_normalize`); the scale is the layer's, since the ops do not scale.
3. ``β_t = sigmoid(W_β x_t)``, one per value head; the per-channel log decay ``g_t ∈ R^Dk`` per
   value head from a low-rank projection ``f = W_fb W_fa x`` (rank ``r``), in one of two forms
   (:mod:`tinyk3.gates`): ``"softplus"``, Kimi Linear's ``g = −exp(A_log) · softplus(f + dt_bias)``,
   or ``"lower_bound"``, Kimi K3's ``g = −5 · sigmoid(exp(A_log) · (f + dt_bias))``.
4. The recurrence ``S_t = (I − β_t k_tᵀ k_t) Diag(exp(g_t)) S_{t−1} + β_t k_tᵀ v_t``,
   ``o_t = q_t S_t``: :func:`tinyk3.ops.kda.chunked` for a prompt, one step of
   :func:`tinyk3.ops.kda.recurrent` for a single token.
5. Per value head, ``RMSNorm(o_t) ⊙ sigmoid(u_t)`` (:class:`GatedRMSNorm`) with the output gate
   ``u = W_gb W_ga x`` (low rank, Kimi Linear) or ``u = W_g x`` (full rank, Kimi K3), then
   ``W_o`` back to ``d``.

Grouped value attention (GVA, fla's ``num_v_heads``): with ``HV = G·H`` value heads, key head
``i`` serves value heads ``G·i … G·i + G − 1`` (q and k are repeated, ``repeat_interleave``),
and gates, ``β`` and the state are per value head. ``transformers``' Kimi Linear layer has no
GVA (its value heads are its key heads), nor the K3 options: those are checked against a
token loop in the tests.

State: :class:`KDAState` ``(S, conv)``, ``S: [B, HV, Dk, Dv]`` (float32, or float64 for float64
inputs) and the three convolution states: fixed size, whatever the length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn as nn

from .._validate import check_mixer_input, positive_int
from ..gates import LOWER_BOUND, init_A_log, init_dt_bias, lower_bound_gate, softplus_gate
from .base import ConvState, check_recurrent_state
from .conv import ShortConvolution, init_jointly_, short_convolutions
from .forms import run_rule
from .parts import GatedRMSNorm, l2_normalize
from .registry import HeadsSpec, register_mixer

__all__ = ["KimiDeltaAttention", "KDAConfig", "KDAState", "GatedRMSNorm", "l2_normalize"]

GATES = ("softplus", "lower_bound")
OUTPUT_GATES = ("low_rank", "full")


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (Kimi Linear, arXiv 2510.26692; Kimi K3's variant by option): see the
    module docstring for the computation.

    ``y, new_state = layer(x, state=None)``, ``x, y: [B, T, d_model]``, the interface of every
    mixer (:class:`~tinyk3.layers.Mixer`). It is an ``nn.Module`` of its own rather than a
    :class:`~tinyk3.layers.Mixer`: that base builds ``d → d`` projections with biases, while this
    layer's projections have no biases, are ``H·Dk`` and ``HV·Dv`` wide, and come with gates.

    Arguments (:class:`KDAConfig` holds the same): ``n_head`` key heads of ``head_dim``;
    ``n_v_head`` value heads (0: ``n_head``; a multiple of it for GVA) of ``v_head_dim``
    (0: ``head_dim``); ``conv_size`` taps (Kimi Linear: 4); ``gate`` ``"softplus"`` (Kimi Linear)
    or ``"lower_bound"`` (Kimi K3, bound :data:`tinyk3.gates.LOWER_BOUND`); ``output_gate``
    ``"low_rank"`` (Kimi Linear) or ``"full"`` (Kimi K3); ``gate_rank`` the rank of the low-rank
    projections (0: ``head_dim``, Kimi Linear's); ``norm_eps`` of the output norm (Kimi Linear's
    ``rms_norm_eps``, 1e-5); ``chunk_size`` of the prefill.

    Parameter names are the published Kimi Linear checkpoint's (``q_conv1d``, ``f_a_proj``,
    ``A_log``, ...; K3's full-rank gate is ``g_proj``); :meth:`from_hf` and
    :meth:`load_hf_state_dict` also take ``transformers``' runtime names. Shapes: ``A_log [HV]``,
    ``dt_bias [HV·Dk]``.

    Initialisation (fla's): ``nn.Linear``'s default for the projections; ``A = exp(A_log)``
    uniform in ``(1, 16)`` for the softplus gate, ``A_log = 0`` for the lower-bound one (fla's
    ``safe_gate``); ``dt_bias = softplus⁻¹(dt)``, ``dt`` log-uniform in ``[1e-3, 1e-1]``;
    the output norm's weight 1.
    """

    State: ClassVar[type]  # KDAState, set below

    def __init__(self, d_model: int, n_head: int, head_dim: int, n_v_head: int = 0,
                 v_head_dim: int = 0, conv_size: int = 4, gate: str = "softplus",
                 output_gate: str = "low_rank", gate_rank: int = 0, norm_eps: float = 1e-5,
                 chunk_size: int = 64, form: str = "chunked"):
        super().__init__()
        cfg = KDAConfig(n_head=n_head, head_dim=head_dim, n_v_head=n_v_head,
                        v_head_dim=v_head_dim, conv_size=conv_size, gate=gate,
                        output_gate=output_gate, gate_rank=gate_rank, norm_eps=norm_eps,
                        chunk_size=chunk_size, form=form)  # validates every argument
        self.form = form
        self.config = cfg
        d = self.d_model = positive_int(d_model, "d_model", "KimiDeltaAttention")
        H, HV, Dk, Dv, r = cfg.n_head, cfg.value_heads, cfg.head_dim, cfg.value_dim, cfg.rank
        self.n_head, self.n_v_head, self.head_dim, self.v_head_dim = H, HV, Dk, Dv
        self.conv_size, self.gate, self.output_gate = conv_size, gate, output_gate
        self.gate_rank, self.norm_eps, self.chunk_size = r, float(norm_eps), chunk_size

        self.q_proj = nn.Linear(d, H * Dk, bias=False)
        self.k_proj = nn.Linear(d, H * Dk, bias=False)
        self.v_proj = nn.Linear(d, HV * Dv, bias=False)
        self.q_conv1d = ShortConvolution(H * Dk, conv_size, bias=False, init=False)
        self.k_conv1d = ShortConvolution(H * Dk, conv_size, bias=False, init=False)
        self.v_conv1d = ShortConvolution(HV * Dv, conv_size, bias=False, init=False)
        init_jointly_([self.q_conv1d, self.k_conv1d, self.v_conv1d])  # one [C, 1, K] filter
        # forget gate: low rank d → r → HV·Dk, then the gate form with A_log [HV], dt_bias [HV·Dk]
        self.f_a_proj = nn.Linear(d, r, bias=False)
        self.f_b_proj = nn.Linear(r, HV * Dk, bias=False)
        A_log = init_A_log(HV, low=1.0) if gate == "softplus" else torch.zeros(HV)
        self.A_log = nn.Parameter(A_log)
        self.dt_bias = nn.Parameter(init_dt_bias(HV * Dk))
        self.b_proj = nn.Linear(d, HV, bias=False)  # β, one per value head
        if output_gate == "low_rank":
            self.g_a_proj = nn.Linear(d, r, bias=False)
            self.g_b_proj = nn.Linear(r, HV * Dv, bias=False)
        else:
            self.g_proj = nn.Linear(d, HV * Dv, bias=False)
        self.o_norm = GatedRMSNorm(Dv, eps=norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(HV * Dv, d, bias=False)

    # -- the pieces, public so that a chapter can look inside ------------------------------------

    def qkv(self, x: torch.Tensor, conv_state: ConvState | None = None):
        """``x [B, T, d]`` → ``q, k [B, H, T, Dk]`` (normalised, q scaled), ``v [B, HV, T, Dv]``
        and the new :class:`ConvState`. The three convolutions run as one call."""
        B, T, _ = x.shape
        H, HV, Dk, Dv = self.n_head, self.n_v_head, self.head_dim, self.v_head_dim
        # three products side by side, [B, T, 2·H·Dk + HV·Dv] (concatenating the weights into one
        # matrix instead copies them on every call: a third of a one-token decoding step)
        p = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        p, states = short_convolutions(convs, p, conv_state)  # causal conv + SiLU on each block
        q, k, v = p.split([H * Dk, H * Dk, HV * Dv], dim=2)
        q = q.reshape(B, T, H, Dk).transpose(1, 2)  # [B, H, T, Dk]
        k = k.reshape(B, T, H, Dk).transpose(1, 2)  # [B, H, T, Dk]
        v = v.reshape(B, T, HV, Dv).transpose(1, 2)  # [B, HV, T, Dv]
        q = l2_normalize(q) * Dk ** -0.5  # the layer scales: the ops do not
        k = l2_normalize(k)
        return q, k, v, ConvState(*states)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """The forget gate ``g [B, HV, T, Dk]`` (``≤ 0``) from ``x [B, T, d]``."""
        B, T, _ = x.shape
        HV, Dk = self.n_v_head, self.head_dim
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, HV, Dk).transpose(1, 2)  # [B, HV, T, Dk]
        dt_bias = self.dt_bias.view(HV, Dk)
        if self.gate == "softplus":  # −exp(A_log) · softplus(f + dt_bias): unbounded below
            return softplus_gate(f, self.A_log, dt_bias)
        return lower_bound_gate(f, self.A_log, dt_bias, lower_bound=LOWER_BOUND)  # in (−5, 0)

    def write_strength(self, x: torch.Tensor) -> torch.Tensor:
        """``β = sigmoid(W_β x)``, ``[B, HV, T]``."""
        return torch.sigmoid(self.b_proj(x)).transpose(1, 2)

    def output_gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output gate before its sigmoid, ``[B, T, HV, Dv]``."""
        B, T, _ = x.shape
        u = self.g_b_proj(self.g_a_proj(x)) if self.output_gate == "low_rank" else self.g_proj(x)
        return u.view(B, T, self.n_v_head, self.v_head_dim)

    def qkv_heads(self) -> dict[str, int]:
        """The projections split by head (Per-Head Muon): q and k by key head, v by value head."""
        return {"q_proj": self.n_head, "k_proj": self.n_head, "v_proj": self.n_v_head}

    def forward(self, x: torch.Tensor, state: KDAState | None = None):
        """``x [B, T, d]`` and the state returned by the previous call (``None`` to start) →
        ``(y [B, T, d], new_state)``. The state passed in is not modified."""
        name = type(self).__name__
        check_mixer_input(x, self.d_model, name)
        B, T, _ = x.shape
        H, HV, Dk, Dv = self.n_head, self.n_v_head, self.head_dim, self.v_head_dim
        S0, conv_state = check_recurrent_state(state, KDAState, (B, HV, Dk, Dv), x, name)
        q, k, v, new_conv = self.qkv(x, conv_state)
        if HV != H:  # GVA: key head i serves value heads G·i … G·i + G − 1
            q, k = (t.repeat_interleave(HV // H, dim=1) for t in (q, k))  # [B, HV, T, Dk]
        g, beta = self.log_decay(x), self.write_strength(x)
        # decoding (T == 1): one step of the recurrence; a prompt: the form (chunkwise by default)
        o, S = run_rule("kda", self.form, q, k, v, beta, g, chunk_size=self.chunk_size,
                        initial_state=S0)
        o = self.o_norm(o.transpose(1, 2), self.output_gate_logits(x))  # [B, T, HV, Dv]
        return self.o_proj(o.reshape(B, T, HV * Dv)), KDAState(S, new_conv)

    def state_numel(self, batch_size: int, length: int = 0) -> int:
        """Numbers in the state, for any ``length``: ``S``, ``B·HV·Dk·Dv``, and the convolutions'
        last ``K − 1`` inputs, ``B·(2·H·Dk + HV·Dv)·(K − 1)``."""
        return self.config.state_numel(batch_size)

    # -- loading ----------------------------------------------------------------------------------

    @staticmethod
    def convert_hf_state_dict(state_dict) -> dict:
        """A Kimi Linear KDA layer's tensors under this module's names and shapes.

        Takes ``transformers``' runtime names (one ``conv1d.weight`` over q, k, v, split here by
        the widths of ``q_proj``, ``k_proj``, ``v_proj``; ``forget_gate.*``) or the published
        checkpoint's (``q_conv1d.weight``, ``f_a_proj.weight``, ...), keys relative to the layer
        (a model loader strips its ``model.layers.N.self_attn.`` prefix first). ``A_log`` of any
        shape with ``HV`` elements (``[1, 1, HV, 1]`` in both) becomes ``[HV]``, and ``dt_bias``
        ``[HV·Dk]``. Kimi K3's checkpoint stores ``A_log`` with more entries than heads (128 for
        96; mlx-lm's ``sanitize`` and Megatron-Bridge slice it too): the first ``HV`` are kept,
        ``HV`` read from ``b_proj.weight`` (one row per value head).
        """
        out = {}
        for key, t in state_dict.items():
            key = key.removeprefix("forget_gate.")
            if key == "conv1d.weight":
                sizes = [state_dict[f"{p}_proj.weight"].shape[0] for p in "qkv"]
                for p, w in zip("qkv", t.split(sizes, dim=0)):
                    out[f"{p}_conv1d.weight"] = w
                continue
            out[key] = t.reshape(-1) if key in ("A_log", "dt_bias") else t
        b = state_dict.get("b_proj.weight", state_dict.get("forget_gate.b_proj.weight"))
        if "A_log" in out and b is not None and out["A_log"].numel() > b.shape[0]:
            out["A_log"] = out["A_log"][: b.shape[0]]  # padded in the released checkpoint
        return out

    def load_hf_state_dict(self, state_dict, strict: bool = True):
        """Copy a Kimi Linear layer's tensors (see :meth:`convert_hf_state_dict`) into this one."""
        return self.load_state_dict(self.convert_hf_state_dict(state_dict), strict=strict)

    @classmethod
    def from_hf(cls, layer, *, chunk_size: int = 64) -> KimiDeltaAttention:
        """This layer with the sizes and weights of a ``transformers`` ``KimiLinearDeltaAttention``
        (its dtype and device too). Kimi Linear's form: softplus gate, low-rank output gate."""
        if getattr(layer, "activation", "silu") != "silu":
            raise ValueError(f"KimiDeltaAttention.from_hf: the convolution's activation must be "
                             f"SiLU, got {layer.activation!r}")
        fg = layer.forget_gate
        rank = fg.f_a_proj.out_features
        if layer.g_a_proj.out_features != rank:
            raise ValueError("KimiDeltaAttention.from_hf: the forget gate and the output gate "
                             f"have different ranks ({rank}, {layer.g_a_proj.out_features})")
        if layer.conv1d.bias is not None:
            raise ValueError("KimiDeltaAttention.from_hf: the layer's convolution has a bias; "
                             "Kimi Linear's has none")
        w = layer.q_proj.weight
        ours = cls(layer.hidden_size, layer.num_heads, layer.head_dim,
                   conv_size=layer.conv_kernel_size, gate="softplus", output_gate="low_rank",
                   gate_rank=rank, norm_eps=layer.o_norm.variance_epsilon, chunk_size=chunk_size)
        ours.to(device=w.device, dtype=w.dtype)
        ours.load_hf_state_dict(layer.state_dict())
        return ours

    def extra_repr(self) -> str:
        gva = f", n_v_head={self.n_v_head}" if self.n_v_head != self.n_head else ""
        return (f"d_model={self.d_model}, n_head={self.n_head}, head_dim={self.head_dim}{gva}, "
                f"v_head_dim={self.v_head_dim}, conv_size={self.conv_size}, gate={self.gate!r}, "
                f"output_gate={self.output_gate!r}, gate_rank={self.gate_rank}")


class KDAState(NamedTuple):
    """A KDA layer's state: ``S: [B, HV, Dk, Dv]`` and the convolutions' last ``K − 1`` inputs
    (:class:`ConvState`: q and k ``[B, H·Dk, K − 1]``, v ``[B, HV·Dv, K − 1]``)."""

    S: torch.Tensor
    conv: ConvState


KimiDeltaAttention.State = KDAState


@register_mixer
@dataclass(frozen=True)
class KDAConfig(HeadsSpec):
    """A :class:`KimiDeltaAttention` layer (arguments as there). Kimi Linear 48B:
    ``KDAConfig(n_head=32, head_dim=128)`` at ``d_model = 2304``; Kimi K3 (its released config,
    as mlx-lm's port reads it: 96 heads of 128, the lower-bound gate, a full-rank output gate):
    ``KDAConfig(n_head=96, head_dim=128, gate="lower_bound", output_gate="full")`` at 7168. The
    rank of K3's low-rank forget-gate projection is ``head_dim``, as in Kimi Linear: read from
    the released tensors' shapes (mlx-lm's ``KimiK3DeltaAttention`` builds ``f_a_proj`` as
    ``hidden → head_dim``, and the released ``f_a_proj.weight`` loads into it)."""

    n_head: int
    head_dim: int
    n_v_head: int = 0
    v_head_dim: int = 0
    conv_size: int = 4
    gate: str = "softplus"
    output_gate: str = "low_rank"
    gate_rank: int = 0
    norm_eps: float = 1e-5
    chunk_size: int = 64
    form: str = "chunked"

    kind: ClassVar[str] = "kda"
    rule: ClassVar[str] = "kda"  # the op module of its forms
    module: ClassVar[type] = KimiDeltaAttention

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.gate not in GATES:
            raise ValueError(f"{name}: gate must be one of {GATES}, got {self.gate!r}")
        if self.output_gate not in OUTPUT_GATES:
            raise ValueError(f"{name}: output_gate must be one of {OUTPUT_GATES}, "
                             f"got {self.output_gate!r}")

    @property
    def rank(self) -> int:
        return self.gate_rank or self.head_dim

    def num_parameters(self, d_model: int) -> int:
        """Exact count: q, k ``2·d·H·Dk``; v ``d·HV·Dv``; convolutions ``K·(2·H·Dk + HV·Dv)``;
        forget gate ``d·r + r·HV·Dk + HV + HV·Dk`` (projections, ``A_log``, ``dt_bias``); β
        ``d·HV``; output gate ``d·r + r·HV·Dv`` (low rank) or ``d·HV·Dv`` (full); output norm
        ``Dv``; ``W_o`` ``HV·Dv·d``. No biases."""
        d, H, HV, Dk, Dv, r, K = (d_model, self.n_head, self.value_heads, self.head_dim,
                                  self.value_dim, self.rank, self.conv_size)
        qkv = 2 * d * H * Dk + d * HV * Dv
        conv = K * (2 * H * Dk + HV * Dv)
        forget = d * r + r * HV * Dk + HV + HV * Dk
        out_gate = d * r + r * HV * Dv if self.output_gate == "low_rank" else d * HV * Dv
        return qkv + conv + forget + d * HV + out_gate + Dv + HV * Dv * d

    def state_numel(self, batch_size: int, length: int = 0) -> int:
        """Numbers in the state (any ``length``): ``B·HV·Dk·Dv + B·(2·H·Dk + HV·Dv)·(K − 1)``."""
        B = positive_int(batch_size, "batch_size", type(self).__name__)
        H, HV, Dk, Dv, K = (self.n_head, self.value_heads, self.head_dim, self.value_dim,
                            self.conv_size)
        return B * HV * Dk * Dv + B * (2 * H * Dk + HV * Dv) * (K - 1)
