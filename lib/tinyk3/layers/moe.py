"""Mixture of experts (chapter 14): the SwiGLU expert, the router, the experts run one at a
time or batched, shared experts, and DeepSeek-V3's auxiliary-loss-free balancing.

A token ``x`` (``d`` wide) is scored against ``E`` experts, ``s = σ(W_r x)`` (sigmoid: DeepSeek-V3,
Kimi K2) or ``softmax(W_r x)`` (Qwen3-Next, Mixtral). The ``k`` experts it is sent to are the top
``k`` of ``s + b``, where the bias ``b`` (``e_score_correction_bias``, a buffer: it gets no
gradient) only selects. Group-limited routing (DeepSeek-V3: 8 groups, 4 kept) first keeps the
``topk_group`` groups whose two best biased scores sum highest. The chosen experts' weights are
the *unbiased* scores, renormalised to sum to one (``norm_topk_prob``) and multiplied by
``routed_scaling_factor``. Then ``y = Σ_i w_i E_i(x) + Σ shared experts(x)``, each expert a
SwiGLU ``W_down (SiLU(W_gate x) ⊙ W_up x)``; Qwen3-Next scales its shared expert by
``σ(w_g · x)``. Kimi K3 runs its routed experts in a narrower latent with SiTU-GLU
(:func:`situ`; ``MoE(latent_dim=..., activation="situ")``).

Balancing the load while training (:class:`Balancer`): DeepSeek-V3's sign rule
(:func:`update_bias`), Kimi K3's Quantile Balancing (:func:`quantile_bias`) or an auxiliary
loss (:func:`balance_loss`).

Names and layouts are ``transformers``' (``DeepseekV3MoE``, ``Qwen3NextSparseMoeBlock``): the
routed experts' weights are stacked, ``gate_up_proj [E, 2h, d]`` and ``down_proj [E, d, h]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._validate import nonnegative_int, positive_int
from .parts import RMSNorm
from .registry import MLPSpec, register_mlp

__all__ = ["SwiGLU", "SwiGLUConfig", "Router", "Experts", "MoE", "MoEConfig", "route",
           "experts_loop", "experts_batched", "expert_load", "update_bias", "quantile_bias",
           "balance_loss", "Balancer", "BALANCE_RULES", "SCORINGS", "situ", "glu", "ACTIVATIONS"]

SCORINGS = ("sigmoid", "softmax")
ACTIVATIONS = ("silu", "situ")
SITU_CAPS = (4.0, 25.0)  # Kimi K3's SiTU-GLU: the gate's cap and the value's


def situ(gate: torch.Tensor, up: torch.Tensor, caps: tuple[float, float] = SITU_CAPS) -> torch.Tensor:
    """Kimi K3's SiTU-GLU, ``β·tanh(g/β)·σ(g) · γ·tanh(u/γ)`` with ``(β, γ) = caps`` (4 and 25 in
    the released config): SiLU's gate ``g·σ(g)`` with ``g`` soft-capped at ``±β``, times the value
    soft-capped at ``±γ``, so no product can exceed ``β·γ`` (computed in float32 at least; read
    from mlx-lm's ``models/kimi_k3.py``, ``_situ``)."""
    beta, gamma = caps
    dt = gate.dtype if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(dt), up.to(dt)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * gamma * torch.tanh(u / gamma)).to(gate.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The gated unit of an expert: ``SiLU(g) ⊙ u`` (SwiGLU) or :func:`situ`."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "situ":
        return situ(gate, up)
    raise ValueError(f"glu: activation must be one of {ACTIVATIONS}, got {activation!r}")


class SwiGLU(nn.Module):
    """``down_proj(SiLU(gate_proj x) ⊙ up_proj x)``, hidden width ``hidden``, no biases
    (Shazeer 2020; every model of Parts IV-V); ``activation="situ"``: Kimi K3's SiTU-GLU."""

    def __init__(self, d_model: int, hidden: int, activation: str = "silu"):
        super().__init__()
        d, h = positive_int(d_model, "d_model", "SwiGLU"), positive_int(hidden, "hidden", "SwiGLU")
        if activation not in ACTIVATIONS:
            raise ValueError(f"SwiGLU: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.activation))


@register_mlp
@dataclass(frozen=True)
class SwiGLUConfig(MLPSpec):
    """A dense :class:`SwiGLU` feed-forward of hidden width ``hidden``."""

    hidden: int
    activation: str = "silu"

    kind: ClassVar[str] = "swiglu"
    module: ClassVar[type] = SwiGLU

    def num_parameters(self, d_model: int) -> int:
        """Three matrices: ``3·d·h``."""
        return 3 * d_model * self.hidden


def route(scores: torch.Tensor, *, top_k: int, bias: torch.Tensor | None = None,
          n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          routed_scaling_factor: float = 1.0):
    """Choose ``top_k`` experts per token from ``scores [N, E]`` (already σ- or softmax-ed):
    ``(weights [N, k], indices [N, k])``.

    Selection ranks ``scores + bias``; with ``n_group > 1`` only the ``topk_group`` groups of
    ``E / n_group`` consecutive experts whose two best biased scores sum highest stay in the
    running. The weights are gathered from the unbiased ``scores``, divided by their sum if
    ``norm_topk_prob`` (plus 1e-20, as DeepSeek-V3's code), times ``routed_scaling_factor``.
    """
    if scores.dim() != 2:
        raise ValueError(f"route: scores must be [N, E], got {tuple(scores.shape)}")
    N, E = scores.shape
    top_k = positive_int(top_k, "top_k", "route")
    n_group = positive_int(n_group, "n_group", "route")
    topk_group = positive_int(topk_group, "topk_group", "route")
    if E % n_group or topk_group > n_group:
        raise ValueError(f"route: {E} experts must split into n_group={n_group} groups, and "
                         f"topk_group ({topk_group}) must be <= n_group")
    if top_k > E // n_group * topk_group:
        raise ValueError(f"route: top_k={top_k} is more than the {E // n_group * topk_group} "
                         "experts of the groups kept")
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        per = E // n_group
        if per < 2:
            raise ValueError("route: group-limited routing scores groups by their top 2, so each "
                             f"group needs >= 2 experts (got {per})")
        group_scores = choice.view(N, n_group, per).topk(2, dim=-1).values.sum(-1)  # [N, G]
        kept = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros(N, n_group, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    indices = choice.topk(top_k, dim=-1).indices  # [N, k]
    weights = scores.gather(1, indices)  # the unbiased scores of the chosen experts
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, indices


class Router(nn.Module):
    """Scores, selects and weighs: ``forward(x [N, d]) -> (weights [N, k], indices [N, k],
    scores [N, E])``, in float32 (float64 for float64 inputs), as DeepSeek-V3's router.

    ``weight [E, d]`` is a parameter; ``e_score_correction_bias [E]`` a buffer (zero at start;
    :func:`update_bias` moves it)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, scoring: str = "sigmoid",
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0):
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"Router: scoring must be one of {SCORINGS}, got {scoring!r}")
        self.n_experts = positive_int(n_experts, "n_experts", "Router")
        self.top_k, self.scoring = positive_int(top_k, "top_k", "Router"), scoring
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = bool(norm_topk_prob), float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        logits = F.linear(x.to(dt), self.weight.to(dt))
        return logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(-1)

    def forward(self, x: torch.Tensor):
        s = self.scores(x)
        weights, indices = route(s, top_k=self.top_k, bias=self.e_score_correction_bias.to(s.dtype),
                                 n_group=self.n_group, topk_group=self.topk_group,
                                 norm_topk_prob=self.norm_topk_prob,
                                 routed_scaling_factor=self.routed_scaling_factor)
        return weights, indices, s


def _expert(x, gate_up, down, activation="silu"):
    """One SwiGLU expert on rows ``x [n, d]`` from its stacked weights ``[2h, d]``, ``[d, h]``."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(glu(gate, up, activation), down)


def experts_loop(x, weights, indices, gate_up, down, activation: str = "silu") -> torch.Tensor:
    """The reference: for each expert, the rows sent to it, ``Σ w · E_e(x)`` added back in place.
    ``x [N, d]``, ``weights, indices [N, k]``, ``gate_up [E, 2h, d]``, ``down [E, d, h]``."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(indices == e)
        if token.numel():
            y = _expert(x[token], gate_up[e], down[e], activation)
            y = y * weights[token, slot, None].to(x.dtype)
            out = out.index_add(0, token, y)
    return out


def experts_batched(x, weights, indices, gate_up, down, activation: str = "silu") -> torch.Tensor:
    """The same in one batched pass: the ``N·k`` (token, expert) pairs sorted by expert and
    padded to the busiest expert's count, ``[E, capacity, d]``, then two batched matmuls over all
    experts at once and one scatter back. The padding is the compute a batched form wastes when
    the load is uneven."""
    N, k = indices.shape
    E = gate_up.shape[0]
    flat = indices.reshape(-1)  # [N·k]
    order = flat.argsort(stable=True)
    expert = flat[order]
    counts = torch.bincount(flat, minlength=E)  # [E]
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(N * k, device=x.device) - starts[expert]  # place within its expert
    capacity = int(counts.max())
    token = order // k
    xs = x.new_zeros(E, capacity, x.shape[1])
    xs[expert, rank] = x[token]
    h = torch.bmm(xs, gate_up.transpose(1, 2))  # [E, capacity, 2h]
    gate, up = h.chunk(2, dim=-1)
    ys = torch.bmm(glu(gate, up, activation), down.transpose(1, 2))  # [E, capacity, d]
    y = ys[expert, rank] * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add(0, token, y)


FORMS = {"batched": experts_batched, "loop": experts_loop}  # the first is the default


class Experts(nn.Module):
    """``E`` SwiGLU experts of hidden width ``h``, stacked: ``gate_up_proj [E, 2h, d]``,
    ``down_proj [E, d, h]`` (``transformers``' runtime layout)."""

    def __init__(self, d_model: int, n_experts: int, hidden: int, form: str = "batched",
                 activation: str = "silu"):
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"Experts: form must be one of {tuple(FORMS)}, got {form!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"Experts: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.form, self.activation = form, activation
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x, weights, indices) -> torch.Tensor:
        return FORMS[self.form](x, weights, indices, self.gate_up_proj, self.down_proj,
                                self.activation)


class MoE(nn.Module):
    """Routed experts plus shared experts (see the module docstring): ``forward(x [B, T, d])``.

    After each forward pass ``last_indices [B·T, k]`` holds the experts chosen (for the load
    statistics of :func:`expert_load`).

    Kimi K3's latent MoE (``latent_dim > 0``): the routed experts run in a narrower space,
    ``routed_expert_up_proj(norm(Σ w_i E_i(routed_expert_down_proj x)))`` with the RMSNorm after
    the weighted sum (``latent_norm``), while the router and the shared experts see ``x`` at full
    width; ``activation="situ"`` gives every expert SiTU-GLU (read from mlx-lm's
    ``models/kimi_k3.py``, ``KimiK3SparseMoE``)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, expert_hidden: int,
                 n_shared: int = 0, shared_hidden: int = 0, scoring: str = "sigmoid",
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, shared_gate: bool = False,
                 form: str = "batched", activation: str = "silu", latent_dim: int = 0,
                 latent_norm: bool = False, norm_eps: float = 1e-5):
        super().__init__()
        self.d_model = positive_int(d_model, "d_model", "MoE")
        self.router = Router(d_model, n_experts, top_k, scoring, n_group, topk_group,
                             norm_topk_prob, routed_scaling_factor)
        self.latent_dim = nonnegative_int(latent_dim, "latent_dim", "MoE")
        expert_width = latent_dim or d_model
        self.experts = Experts(expert_width, n_experts, expert_hidden, form, activation)
        if latent_dim:
            self.routed_expert_down_proj = nn.Linear(d_model, latent_dim, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent_dim, d_model, bias=False)
            self.routed_expert_norm = RMSNorm(latent_dim, norm_eps) if latent_norm else None
        width = shared_hidden or n_shared * expert_hidden
        self.shared_experts = SwiGLU(d_model, width, activation) if width else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_gate else None
        self.last_indices: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: expected [..., {self.d_model}], got {tuple(x.shape)}")
        flat = x.reshape(-1, self.d_model)
        weights, indices, _ = self.router(flat)
        self.last_indices = indices.detach()
        if self.latent_dim:
            y = self.experts(self.routed_expert_down_proj(flat), weights, indices)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.experts(flat, weights, indices)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            y = y + shared
        return y.view(x.shape)


def expert_load(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens sent to each expert: ``[E]`` counts from ``indices [N, k]``."""
    return torch.bincount(indices.reshape(-1), minlength=n_experts)


def update_bias(bias: torch.Tensor, load: torch.Tensor, speed: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing step: ``b_i + u · sign(mean load − load_i)``
    (an overloaded expert's bias goes down by ``u``, an underloaded one's up). Returns a new tensor."""
    if bias.shape != load.shape:
        raise ValueError(f"update_bias: bias {tuple(bias.shape)} and load {tuple(load.shape)} differ")
    load = load.to(bias.dtype)
    return bias + speed * torch.sign(load.mean() - load)


def _required_biases(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """``r [T, E]``: for each token its cutoff, the ``(top_k + 1)``-th largest biased score,
    minus each expert's unbiased score: the bias at which that expert's biased score would
    equal the token's cutoff."""
    cutoff = (scores + bias).topk(top_k + 1, dim=-1).values[:, -1:]  # [T, 1]
    return cutoff - scores


def quantile_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int, *,
                  num_bins: int | None = None) -> torch.Tensor:
    """Kimi K3's Quantile Balancing (Kimi K3 report §2.3.3, as torchtitan's
    ``models/kimi_k3/quantile_balance.py`` quotes and implements it): the next router bias.

    ``scores [T, E]`` are the router's sigmoid scores before the bias, ``bias [E]`` the current
    bias. Each token's cutoff ``c_t`` is its ``(top_k + 1)``-th largest biased score; expert
    ``e``'s *required bias* for token ``t`` is ``r_{t,e} = c_t − scores[t, e]``. The result is,
    per expert, the ``top_k / E`` quantile of its ``T`` required biases, minus the mean over
    experts (only differences of biases change a selection).

    ``num_bins=None``: the exact quantile, linearly interpolated (``torch.quantile``). An int:
    the report's histogram estimate, as a training run computes it from counts it can pool
    across devices: ``num_bins`` bins of width ``w = (max(bias) − min(bias) + 2) / num_bins``
    from ``lo = min(bias) − 1`` (sigmoid scores lie in (0, 1), so every required bias lies in
    that range); ``r`` falls in bin ``floor((r − lo) / w)``, clamped; with the target count
    ``T·top_k / E``, the estimate is ``lo + w·(j + (target − count before j) / count in j)``
    for the first bin ``j`` whose cumulative count reaches the target.

    Why the ``top_k / E`` quantile: an expert is chosen for token ``t`` when its biased score
    clears the cutoff, ``scores[t, e] + b_e > c_t``, that is when ``b_e > r_{t,e}``. With every
    other bias held where it is, the bias ``b_e`` at which exactly a fraction ``top_k / E`` of
    the tokens choose ``e`` (the balanced load) is the ``top_k / E`` quantile of
    ``r_{·,e}``. Returned in ``scores``' dtype.
    """
    name = "quantile_bias"
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"{name}: scores must be a float tensor [T, E], got "
                         f"{getattr(scores, 'shape', type(scores).__name__)}")
    T, E = scores.shape
    if T < 1:
        raise ValueError(f"{name}: scores holds no tokens (T = 0)")
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,) or not bias.is_floating_point():
        raise ValueError(f"{name}: bias must be a float tensor [E={E}], got "
                         f"{tuple(getattr(bias, 'shape', ())) or type(bias).__name__}")
    if bias.device != scores.device:
        raise ValueError(f"{name}: scores on {scores.device} and bias on {bias.device}")
    top_k = positive_int(top_k, "top_k", name)
    if top_k >= E:
        raise ValueError(f"{name}: top_k must be in 1 … E−1 = {E - 1} (a token's cutoff is its "
                         f"(top_k+1)-th score), got {top_k}")
    if num_bins is not None:
        num_bins = positive_int(num_bins, "num_bins", name)
    bias = bias.to(scores.dtype)
    required = _required_biases(scores, bias, top_k)  # [T, E]
    if num_bins is None:
        estimate = torch.quantile(required, top_k / E, dim=0)  # [E]
    else:
        lo = bias.min() - 1.0
        width = (bias.max() - bias.min() + 2.0) / num_bins
        j = torch.floor((required - lo) / width).long().clamp_(0, num_bins - 1)  # [T, E]
        hist = torch.zeros(E, num_bins, dtype=torch.long, device=scores.device)
        hist.scatter_add_(1, j.T, torch.ones_like(j.T))
        cum = hist.cumsum(dim=1)
        target = T * top_k / E
        first = (cum < target).sum(dim=1, keepdim=True)  # the first bin reaching the target
        in_bin = hist.gather(1, first).squeeze(1)
        before = cum.gather(1, first).squeeze(1) - in_bin
        position = first.squeeze(1).to(scores.dtype) + (target - before.to(scores.dtype)) / in_bin
        estimate = lo + width * position
    return estimate - estimate.mean()


def balance_loss(scores: torch.Tensor, indices: torch.Tensor, top_k: int) -> torch.Tensor:
    """The auxiliary balance loss (DeepSeek-V3's complementary balance loss, eqs. 17-20 of its
    report, here over a batch of tokens rather than one sequence), without its factor α:
    ``Σ_i f_i P_i`` with ``f_i = E / (k T) · #(tokens sent to i)`` (1 for every expert at
    the balanced load) and ``P_i`` the mean over tokens of ``s_{t,i} / Σ_j s_{t,j}``, the
    normalised scores. Only ``P`` carries a gradient: it pushes scores down where the load is
    high. ``scores [T, E]``, ``indices [T, k]``; 1 at perfect balance with equal scores."""
    if scores.dim() != 2 or indices.dim() != 2 or indices.shape[0] != scores.shape[0]:
        raise ValueError(f"balance_loss: scores [T, E] and indices [T, k] expected, got "
                         f"{tuple(scores.shape)} and {tuple(indices.shape)}")
    T, E = scores.shape
    f = expert_load(indices, E).to(scores.dtype) * (E / (top_k * T))
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    return (f * p).sum()


BALANCE_RULES = ("sign", "quantile", "aux")


class Balancer:
    """Load balancing of every :class:`MoE` in a model while it trains, by one of three rules:

    * ``"sign"``: DeepSeek-V3's auxiliary-loss-free update, ``b ← b + u·sign(mean load − load)``
      (:func:`update_bias`, ``speed`` = u) from the loads of the forward passes since the
      last :meth:`step`;
    * ``"quantile"``: Kimi K3's Quantile Balancing, ``b ← quantile_bias(scores, b, k)`` from
      the router scores of those passes (``num_bins`` as :func:`quantile_bias`: None exact,
      1,000 in the report);
    * ``"aux"``: no bias at all; :meth:`loss` is ``alpha`` times the sum over layers of
      :func:`balance_loss` of the last forward pass, to be added to the training loss.

    Forward hooks on the routers record in ``train()`` mode only. Call :meth:`step` after
    each optimiser step; it returns each layer's load (tokens per expert) since the last call.

    >>> bal = Balancer(model, "quantile")                     # doctest: +SKIP
    >>> loss = task_loss + bal.loss(); loss.backward(); opt.step(); loads = bal.step()
    """

    def __init__(self, model: nn.Module, rule: str, *, speed: float = 1e-3,
                 num_bins: int | None = None, alpha: float = 1e-2):
        if rule not in BALANCE_RULES:
            raise ValueError(f"Balancer: rule must be one of {BALANCE_RULES}, got {rule!r}")
        if not speed > 0 or not alpha >= 0:
            raise ValueError(f"Balancer: speed must be > 0 and alpha >= 0, got {speed!r}, {alpha!r}")
        if num_bins is not None:
            num_bins = positive_int(num_bins, "num_bins", "Balancer")
        self.rule, self.speed, self.num_bins, self.alpha = rule, float(speed), num_bins, float(alpha)
        self.routers = {name: m.router for name, m in model.named_modules() if isinstance(m, MoE)}
        if not self.routers:
            raise ValueError("Balancer: the model has no MoE layer")
        for name, r in self.routers.items():
            if rule == "quantile" and (r.scoring != "sigmoid" or r.n_group > 1):
                raise ValueError(f"Balancer: Quantile Balancing needs sigmoid scores and one "
                                 f"group (layer {name!r}: {r.scoring}, n_group={r.n_group})")
        self._scores: dict[str, list] = {n: [] for n in self.routers}
        self._indices: dict[str, list] = {n: [] for n in self.routers}
        self._handles = [r.register_forward_hook(self._hook(n)) for n, r in self.routers.items()]

    def _hook(self, name):
        def hook(router, args, out):
            if not router.training:
                return
            _, indices, scores = out
            if self.rule == "aux":  # the last pass only, with its graph
                self._scores[name], self._indices[name] = [scores], [indices]
            else:
                self._scores[name].append(scores.detach())
                self._indices[name].append(indices.detach())
        return hook

    def loss(self) -> torch.Tensor:
        """``alpha · Σ_layers balance_loss`` of the last training forward pass (rule ``"aux"``);
        zero for the other rules."""
        if self.rule != "aux":
            return torch.zeros(())
        parts = [balance_loss(self._scores[n][-1], self._indices[n][-1], router.top_k)
                 for n, router in self.routers.items() if self._scores[n]]
        return self.alpha * sum(parts) if parts else torch.zeros(())

    @torch.no_grad()
    def step(self) -> dict[str, torch.Tensor]:
        """Update every router's bias by the rule from what was recorded since the last call,
        forget the record, and return each layer's load ``[E]`` over that period."""
        loads = {}
        for name, router in self.routers.items():
            if not self._indices[name]:
                continue
            E = router.n_experts
            load = expert_load(torch.cat(self._indices[name]), E)
            loads[name] = load
            bias = router.e_score_correction_bias
            if self.rule == "sign":
                bias.copy_(update_bias(bias, load, self.speed))
            elif self.rule == "quantile":
                new = quantile_bias(torch.cat(self._scores[name]), bias, router.top_k,
                                    num_bins=self.num_bins)
                bias.copy_(new.to(bias.dtype))
            self._scores[name], self._indices[name] = [], []
        return loads

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


@register_mlp
@dataclass(frozen=True)
class MoEConfig(MLPSpec):
    """A :class:`MoE` feed-forward (arguments as there). DeepSeek-V3: ``MoEConfig(256, 8, 2048,
    n_shared=1, n_group=8, topk_group=4, routed_scaling_factor=2.5)``; Kimi K2: ``MoEConfig(384,
    8, 2048, n_shared=1, routed_scaling_factor=2.827)``; Kimi K3's latent MoE (the released config
    as third parties read it): ``MoEConfig(896, 16, 3072, n_shared=2, activation="situ",
    latent_dim=3584, latent_norm=True)``."""

    n_experts: int
    top_k: int
    expert_hidden: int
    n_shared: int = 0
    shared_hidden: int = 0
    scoring: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    shared_gate: bool = False
    form: str = "batched"
    activation: str = "silu"
    latent_dim: int = 0
    latent_norm: bool = False
    norm_eps: float = 1e-5

    kind: ClassVar[str] = "moe"
    module: ClassVar[type] = MoE

    def __post_init__(self) -> None:
        name = "MoEConfig"
        for f in ("n_experts", "top_k", "expert_hidden", "n_group", "topk_group"):
            positive_int(getattr(self, f), f, name)
        for f in ("n_shared", "shared_hidden", "latent_dim"):
            nonnegative_int(getattr(self, f), f, name)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{name}: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"{name}: scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.form not in FORMS:
            raise ValueError(f"{name}: form must be one of {tuple(FORMS)}, got {self.form!r}")
        if self.n_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"{name}: n_experts ({self.n_experts}) must split into n_group "
                             f"({self.n_group}) groups and topk_group ({self.topk_group}) <= n_group")
        if self.top_k > self.n_experts // self.n_group * self.topk_group:
            raise ValueError(f"{name}: top_k ({self.top_k}) is more than the experts of the "
                             "groups kept")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"{name}: routed_scaling_factor must be positive")

    @property
    def shared_width(self) -> int:
        return self.shared_hidden or self.n_shared * self.expert_hidden

    def num_parameters(self, d_model: int) -> int:
        """Router ``E·d``; routed experts ``E·3·h·d_e`` (``d_e`` = ``latent_dim`` or ``d``);
        K3's latent projections ``2·d·d_e`` and norm ``d_e``; shared experts ``3·d·h_s``;
        Qwen3-Next's shared gate ``d``. The router's bias is a buffer, not counted."""
        d, de = d_model, self.latent_dim or d_model
        latent = 2 * d * de + (de if self.latent_norm else 0) if self.latent_dim else 0
        return (self.n_experts * d + self.n_experts * 3 * self.expert_hidden * de + latent
                + 3 * d * self.shared_width + (d if self.shared_gate else 0))

    def num_active_parameters(self, d_model: int) -> int:
        """What one token uses: all but the ``E − k`` routed experts it is not sent to."""
        unused = (self.n_experts - self.top_k) * 3 * self.expert_hidden * (self.latent_dim or d_model)
        return self.num_parameters(d_model) - unused
