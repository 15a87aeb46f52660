"""Training at scale (chapter 16): the Muon optimiser and QK-Clip, the two halves of Kimi K2's
MuonClip.

**Muon** (Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024,
https://kellerjordan.github.io/posts/muon/; Liu et al., "Muon is Scalable for LLM Training",
arXiv 2502.16982) updates a weight matrix by the orthogonalised momentum of its gradient: for
``M = U Σ Vᵀ`` the update is (approximately) ``U Vᵀ``, every singular direction moved by the
same amount. :func:`newton_schulz` computes it with five steps of a quintic polynomial
iteration, coefficients ``(3.4445, −4.7750, 2.0315)``; :class:`Muon` adds the momentum (an
exponential moving average, as ``torch.optim.Muon``), decoupled weight decay and the
shape-dependent scale: Moonshot's ``0.2·√max(A, B)``, which gives the update the RMS of a typical
AdamW update, or the original ``√max(1, A/B)``.

**QK-Clip** (Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534, §2.1; the
reference implementation is Megatron-LM's ``clip_qk`` in
``megatron/core/transformer/multi_latent_attention.py``) bounds the attention logits: after an
optimiser step, for every head ``h`` whose largest logit ``S_max^h = max_{i≥j} q_i·k_j / √d``
seen in the step exceeds ``τ`` (100 for Kimi K2), the head's query and key weights are scaled
so that the logit would have been ``τ``: ``η_h = min(1, τ / S_max^h)``.

* Multi-head attention (:class:`~tinyk3.layers.SoftmaxAttention`): head ``h``'s rows of
  ``q_proj`` and ``k_proj`` (weights and biases) by ``η^α`` and ``η^(1−α)`` (``α = ½``: ``√η``
  each), so the head's every logit is multiplied by ``η``.
* MLA (:class:`~tinyk3.layers.MultiHeadLatentAttention`): the query rows of head ``h``
  (``q_b_proj`` or ``q_proj``, ``[H·(dn + dr), ·]``) split into ``q_nope`` rows, scaled by
  ``η^α``, and ``q_rope`` rows, scaled by ``η``; the ``W_UK`` rows of ``kv_b_proj``
  (``[H·(dn + dv), r]``, the first ``dn`` of each head) by ``η^(1−α)``; ``W_UV`` (the values) is
  not touched. The rope key ``k^R`` is shared by all heads, so scaling it would change the
  heads that did not exceed ``τ``: it stays, and its part of the logit is scaled through
  ``q_rope`` alone (by ``η``). Both parts of the logit are then multiplied by ``η`` exactly,
  as in Megatron-LM's code.

**Per-Head Muon** (Kimi K3's report, §2.5, as torchtitan's ``models/kimi_k3/muon.py`` quotes
it): the momentum of the Q, K and V projections is split along the head dimension and each
head's block orthogonalised on its own (:func:`per_head_newton_schulz`); ``o_proj``, whose head
axis is on its input side, is not. :func:`muon_param_groups` gives :class:`Muon` those
parameters in groups that carry their head count (``"heads"``).

Heads at or below ``τ`` are not touched: their rows are multiplied by exactly 1.0 (or, when no
head exceeds ``τ``, nothing is written at all), so they stay bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ._validate import nonnegative_int, positive_int
from .ops.attention import causal_mask

__all__ = [
    "NS_COEFFICIENTS", "newton_schulz", "per_head_newton_schulz", "muon_lr_scale", "Muon",
    "split_params_for_muon", "per_head_projections", "muon_param_groups",
    "max_logits_per_head", "attention_max_logits", "qk_clip_factors", "qk_clip_", "QKClip",
]

#: Keller Jordan's quintic Newton–Schulz coefficients (a, b, c): the polynomial
#: ``p(σ) = aσ + bσ³ + cσ⁵`` with a steep slope at 0 (a = 3.4445), whose five-fold iterate maps
#: every σ in (0, 1] into a band around 1 (about 0.7 to 1.2) rather than to 1 exactly.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

_NS_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
ADJUST_LR = ("match_rms_adamw", "original")


# -- Muon ---------------------------------------------------------------------------------------


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS,
                  eps: float = 1e-7, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The quintic Newton–Schulz orthogonalisation of ``G [m, n]`` (or a batch ``[..., m, n]``).

    ``X₀ = G / max(‖G‖_F, eps)`` (so every singular value is at most 1; a tall ``G`` is
    transposed first, so that ``A`` below is the smaller Gram matrix), then ``steps`` times
    ``A = X Xᵀ``, ``X ← aX + (bA + cA²)X``. Each step maps every singular value ``σ`` of ``X``
    to ``p(σ) = aσ + bσ³ + cσ⁵`` and keeps the singular vectors: the result is
    ``U p⁽ˢᵗᵉᵖˢ⁾(Σ/‖G‖_F) Vᵀ`` for ``G = U Σ Vᵀ``, close to the polar factor ``U Vᵀ`` (with the
    default coefficients, singular values in about 0.7 to 1.2; Keller Jordan's Muon post).

    Computed in ``dtype`` (default: ``G``'s, which must then be float32 or float64; bfloat16
    is what ``torch.optim.Muon`` uses) and returned in ``G``'s dtype. ``eps`` guards a zero
    ``G`` (the result is then zero).
    """
    if not isinstance(G, torch.Tensor):
        raise TypeError(f"newton_schulz: G must be a tensor, got {type(G).__name__}")
    if G.dim() < 2:
        raise ValueError(f"newton_schulz: G must be a matrix [m, n] (or a batch of them), got "
                         f"shape {tuple(G.shape)}")
    if dtype is None:
        if G.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"newton_schulz: G is {G.dtype}; pass dtype= (float32, float64, "
                            "bfloat16 or float16) to say which precision to compute in")
        dtype = G.dtype
    elif dtype not in _NS_DTYPES:
        raise TypeError(f"newton_schulz: dtype must be one of {_NS_DTYPES}, got {dtype}")
    if not G.is_floating_point():
        raise TypeError(f"newton_schulz: G must be a floating-point tensor, got {G.dtype}")
    steps = nonnegative_int(steps, "steps", "newton_schulz")
    a, b, c = _coefficients(coefficients, "newton_schulz")
    if not eps > 0:
        raise ValueError(f"newton_schulz: eps must be positive, got {eps!r}")
    tall = G.shape[-2] > G.shape[-1]
    X = G.to(dtype)
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    for _ in range(steps):
        A = X @ X.mT  # the Gram matrix [m, m] (m ≤ n)
        if X.dim() == 2:  # fused multiply-adds, the operations torch.optim.Muon uses
            X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
        else:
            X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def per_head_newton_schulz(G: torch.Tensor, heads: int, **kwargs) -> torch.Tensor:
    """Per-Head Muon's orthogonalisation (Kimi K3): ``G [heads·d, n]`` split along its rows
    into ``heads`` blocks of ``d`` rows (one attention head's rows of a Q, K or V projection
    each), every block orthogonalised by :func:`newton_schulz` on its own (one batched call,
    ``[heads, d, n]``), stacked back to ``G``'s shape. ``kwargs`` go to :func:`newton_schulz`.

    Each block then has its own singular values near 1, whatever the sizes of the other heads'
    gradients: a head whose gradient is small gets as large an update as the others, which the
    full-matrix form (one polar factor for all heads together) does not give it."""
    if not isinstance(G, torch.Tensor) or G.dim() != 2:
        raise ValueError(f"per_head_newton_schulz: G must be a matrix [heads·d, n], got "
                         f"{getattr(G, 'shape', type(G).__name__)}")
    heads = positive_int(heads, "heads", "per_head_newton_schulz")
    if G.shape[0] % heads:
        raise ValueError(f"per_head_newton_schulz: {G.shape[0]} rows do not split into "
                         f"{heads} heads")
    blocks = G.reshape(heads, G.shape[0] // heads, G.shape[1])
    return newton_schulz(blocks, **kwargs).reshape(G.shape)


def _coefficients(coefficients, where: str):
    try:
        a, b, c = (float(x) for x in coefficients)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: coefficients must be three numbers (a, b, c), got "
                         f"{coefficients!r}") from None
    if not all(math.isfinite(x) for x in (a, b, c)):
        raise ValueError(f"{where}: coefficients must be finite, got {coefficients!r}")
    return a, b, c


def muon_lr_scale(shape, adjust_lr: str = "match_rms_adamw") -> float:
    """The factor Muon multiplies the learning rate by for a ``[A, B]`` weight.

    ``"match_rms_adamw"`` (Moonshot, arXiv 2502.16982): ``0.2·√max(A, B)``. An ``[A, B]``
    matrix with all singular values 1 has RMS ``√(min(A, B) / (A·B)) = 1/√max(A, B)``; times
    this factor its RMS is 0.2, about that of an AdamW update, so Muon can reuse AdamW's
    learning rate and weight decay. ``"original"`` (Keller Jordan): ``√max(1, A/B)``. Both as
    ``torch.optim.Muon``'s ``adjust_lr_fn``.
    """
    if len(shape) != 2:
        raise ValueError(f"muon_lr_scale: Muon updates matrices, got shape {tuple(shape)}")
    A, B = int(shape[0]), int(shape[1])
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    if adjust_lr == "original":
        return math.sqrt(max(1.0, A / B))
    raise ValueError(f"muon_lr_scale: adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters (weight matrices of hidden layers; use AdamW for the rest:
    embeddings, the output head, norms and biases, see :func:`split_params_for_muon`).

    Per step, for a parameter ``W`` with gradient ``g`` (the conventions of
    ``torch.optim.Muon``, torch ≥ 2.9):

    * momentum, an exponential moving average: ``M ← μ M + (1 − μ) g``;
    * the direction: ``u = (1 − μ) g + μ M`` with ``nesterov`` (default), else ``u = M``;
    * ``O = newton_schulz(u, ns_steps)``, in ``ns_dtype`` (default the parameter's dtype;
      ``torch.bfloat16`` is what ``torch.optim.Muon`` does);
    * ``W ← (1 − lr·λ) W − lr · muon_lr_scale(W.shape, adjust_lr) · O`` (decoupled weight
      decay ``λ``, not scaled by the shape factor).

    **Per-Head Muon**: a parameter group with ``"heads": H`` (an int; :func:`muon_param_groups`
    builds them) orthogonalises with :func:`per_head_newton_schulz` instead, and scales by
    ``muon_lr_scale`` of one head's block ``[A/H, B]``, the scale a matrix of that shape would
    get: each block's update then has the RMS a whole matrix's has under the plain form (0.2
    with ``"match_rms_adamw"`` for an exact polar factor); the scale K3 itself uses for the
    blocks is not among what its readers quote.

    Keller Jordan's original writes the momentum as a sum, ``M ← μM + g`` and ``u = g + μM``:
    that is ``1/(1 − μ)`` times the moving average, and since Newton–Schulz first divides by
    the Frobenius norm, both give the same update (up to ``eps``).
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5,
                 adjust_lr: str = "match_rms_adamw", *, ns_coefficients=NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_dtype: torch.dtype | None = None):
        if isinstance(lr, torch.Tensor) or not isinstance(lr, (int, float)) or not lr >= 0:
            raise ValueError(f"Muon: lr must be a number >= 0, got {lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay!r}")
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"Muon: adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")
        ns_steps = positive_int(ns_steps, "ns_steps", "Muon")
        _coefficients(ns_coefficients, "Muon")
        if ns_dtype is not None and ns_dtype not in _NS_DTYPES:
            raise TypeError(f"Muon: ns_dtype must be None or one of {_NS_DTYPES}, got {ns_dtype}")
        defaults = dict(lr=float(lr), momentum=float(momentum), nesterov=bool(nesterov),
                        weight_decay=float(weight_decay), ns_steps=ns_steps, adjust_lr=adjust_lr,
                        ns_coefficients=tuple(ns_coefficients), eps=float(eps),
                        ns_dtype=ns_dtype, heads=None)
        super().__init__(params, defaults)
        for group in self.param_groups:
            heads = group["heads"]
            if heads is not None:
                positive_int(heads, "a group's heads", "Muon")
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"Muon: only 2-D parameters (weight matrices), got one of shape "
                        f"{tuple(p.shape)}; optimise embeddings' companions, norms and biases "
                        "with AdamW (tinyk3.optim.split_params_for_muon)")
                if p.is_complex():
                    raise TypeError("Muon: complex parameters are not supported")
                if heads is not None and p.shape[0] % heads:
                    raise ValueError(f"Muon: a parameter of shape {tuple(p.shape)} is in a group "
                                     f"with heads={heads}, which does not divide its rows")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError("Muon: sparse gradients are not supported")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - mu)  # M ← μM + (1 − μ)g
                u = g.lerp(buf, mu) if group["nesterov"] else buf  # (1 − μ)g + μM
                ns_dtype = group["ns_dtype"]
                if ns_dtype is None and u.dtype not in (torch.float32, torch.float64):
                    ns_dtype = torch.float32
                heads = group["heads"]
                ns = dict(steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                          eps=group["eps"], dtype=ns_dtype)
                if heads is None:
                    O = newton_schulz(u, **ns)
                    shape = p.shape
                else:
                    O = per_head_newton_schulz(u, heads, **ns)
                    shape = (p.shape[0] // heads, p.shape[1])  # one head's block
                p.mul_(1 - lr * wd)
                p.add_(O, alpha=-lr * muon_lr_scale(shape, group["adjust_lr"]))
        return loss


def split_params_for_muon(model: nn.Module):
    """``(muon_params, other_params)`` of ``model``: the 2-D weights of its hidden layers for
    :class:`Muon`, and everything else (embeddings, the output head, norms, biases, 1-D and
    3-D tensors) for AdamW, as Keller Jordan's and Moonshot's recipes do. Embedding and head
    matrices are recognised as the weights of ``nn.Embedding`` modules and of a module named
    ``lm_head``; a tied head (the embedding's own tensor) is listed once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"split_params_for_muon: expected an nn.Module, got {type(model).__name__}")
    excluded = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name.split(".")[-1] == "lm_head":
            excluded.update(id(p) for p in module.parameters(recurse=False))
    muon, other = [], []
    for p in model.parameters():  # each tensor once, tied ones included
        if not p.requires_grad:
            continue
        (muon if p.dim() == 2 and id(p) not in excluded else other).append(p)
    return muon, other


def per_head_projections(model: nn.Module) -> dict[str, int]:
    """``{parameter name: heads}`` for the Q, K and V projections of every attention layer in
    ``model``, the parameters Per-Head Muon orthogonalises head by head (Kimi K3 report §2.5):

    * :class:`~tinyk3.layers.MultiHeadLatentAttention`: ``q_proj`` or ``q_b_proj`` (each head's
      ``dn + dr`` query rows) and ``kv_b_proj`` (each head's ``dn`` key and ``dv`` value rows
      together, as they are stored); the latent down-projections ``q_a_proj`` and
      ``kv_a_proj_with_mqa`` have no head axis and stay whole;
    * :class:`~tinyk3.layers.KimiDeltaAttention`: ``q_proj``, ``k_proj`` (key heads), ``v_proj``
      (value heads);
    * the course's :class:`~tinyk3.layers.Mixer` layers (softmax, linear attention, DeltaNet):
      ``q_proj``, ``k_proj``, ``v_proj``;
    * :class:`~tinyk3.layers.GatedAttention`: ``q_proj`` (each head's query and gate rows),
      ``k_proj``, ``v_proj`` (key/value heads).

    ``o_proj`` is never listed: its head axis is on the input side. Layers with one fused
    projection for everything (Qwen3-Next's Gated DeltaNet) are not listed either. Each layer
    says which of its projections are split by head (its ``qkv_heads()``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"per_head_projections: expected an nn.Module, got {type(model).__name__}")
    out: dict[str, int] = {}
    for name, m in model.named_modules():
        qkv_heads = getattr(m, "qkv_heads", None)
        if qkv_heads is None:
            continue
        prefix = f"{name}." if name else ""
        for part, heads in qkv_heads().items():
            out[f"{prefix}{part}.weight"] = heads
    return out


def muon_param_groups(model: nn.Module, *, per_head: bool = True):
    """``(muon_groups, other_params)``: :func:`split_params_for_muon`'s two sets, the Muon set
    as parameter groups for :class:`Muon`. With ``per_head`` (Kimi K3's Per-Head Muon) the Q, K
    and V projections of :func:`per_head_projections` go into groups with ``"heads"`` set, one
    group per head count; every other matrix into one group without. Without ``per_head``,
    one group of all (plain Muon, as Kimi K2 trained).

    >>> groups, rest = muon_param_groups(model)              # doctest: +SKIP
    >>> opts = [Muon(groups, lr=0.02), torch.optim.AdamW(rest, lr=0.02)]
    """
    muon, other = split_params_for_muon(model)
    if not per_head:
        return [{"params": muon}], other
    names = per_head_projections(model)
    heads_of = {id(p): names.get(n) for n, p in model.named_parameters()}
    by_heads: dict[int | None, list] = {}
    for p in muon:
        by_heads.setdefault(heads_of.get(id(p)), []).append(p)
    groups = [{"params": ps, "heads": h} for h, ps in by_heads.items()]
    return groups, other


# -- QK-Clip ------------------------------------------------------------------------------------


def max_logits_per_head(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, *,
                        causal: bool = True) -> torch.Tensor:
    """``S_max [H]``: each head's largest attention logit ``scale · q_i · k_j`` over the batch
    and the positions a causal softmax attends (``j ≤ i``, the queries being the last ``T``
    of the ``S`` keys), in float32 at least.

    ``q [B, H, T, D]``, ``k [B, H, S, D]`` or ``[B, 1, S, D]`` (one key for all heads),
    ``scale`` default ``D^-½``. It is the signed maximum (not of ``|logit|``), the quantity
    Kimi K2's QK-Clip bounds."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"max_logits_per_head: {name} must be a float tensor [B, H, T, D], "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    B, H, T, D = q.shape
    if k.shape[0] != B or k.shape[-1] != D or k.shape[1] not in (1, H):
        raise ValueError(f"max_logits_per_head: k must be [B={B}, H={H} or 1, S, D={D}], got "
                         f"{tuple(k.shape)}")
    S = k.shape[2]
    if causal and S < T:
        raise ValueError(f"max_logits_per_head: causal attention needs at least as many keys as "
                         f"queries, got T={T} queries and S={S} keys")
    if T == 0 or S == 0:
        raise ValueError("max_logits_per_head: no logits (an empty sequence)")
    scale = D ** -0.5 if scale is None else float(scale)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    logits = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * scale  # [B, H, T, S]
    if causal:
        logits = logits.masked_fill(~causal_mask(T, S, device=q.device), float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def _clippable(layer) -> None:
    """``TypeError`` unless ``layer`` owns a QK-Clip rule (``qk_logits`` and ``qk_clip_rows_``:
    :class:`~tinyk3.layers.SoftmaxAttention`, :class:`~tinyk3.layers.MultiHeadLatentAttention`);
    the layer's own ``check_qk_clip`` raises ``ValueError`` where its logits are not linear in
    the weights it would scale."""
    if not (hasattr(layer, "qk_clip_rows_") and hasattr(layer, "qk_logits")):
        raise TypeError(f"QK-Clip: supported layers are SoftmaxAttention (q_proj, k_proj) and "
                        f"MultiHeadLatentAttention (q_proj or q_b_proj, kv_b_proj), got "
                        f"{type(layer).__name__} (a layer with RMS-normalised q and k, such as "
                        "GatedAttention, bounds its logits by the norms' weights instead)")
    layer.check_qk_clip()


@torch.no_grad()
def attention_max_logits(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``S_max [H]`` of an attention layer on its input ``x [B, T, d]`` (causal, from
    position 0): the logits the layer's softmax sees, recomputed from its own projections.

    :class:`~tinyk3.layers.SoftmaxAttention`: ``q · k / √D`` per head.
    :class:`~tinyk3.layers.MultiHeadLatentAttention`: ``(q_nope · k_nope + q_rope · k_rope) ·
    (dn + dr)^-½`` with the shared ``k_rope`` (rotated, unless NoPE)."""
    _clippable(layer)
    q, k, scale = layer.qk_logits(x)
    return max_logits_per_head(q, k, scale)


def qk_clip_factors(max_logits: torch.Tensor, tau: float = 100.0) -> torch.Tensor:
    """``η = min(1, τ / S_max)`` per head, and exactly 1 for every head with ``S_max ≤ τ``
    (a negative or zero ``S_max`` included). Kimi K2 uses ``τ = 100``; ``τ = inf`` never
    clips (a :class:`QKClip` that only records)."""
    if not isinstance(max_logits, torch.Tensor) or not max_logits.is_floating_point():
        raise TypeError("qk_clip_factors: max_logits must be a float tensor [H], got "
                        f"{getattr(max_logits, 'dtype', type(max_logits).__name__)}")
    if torch.isnan(max_logits).any():
        raise ValueError("qk_clip_factors: max_logits holds NaN")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"qk_clip_factors: tau must be a positive number, got {tau!r}")
    over = max_logits > tau
    return torch.where(over, tau / torch.where(over, max_logits, tau), 1.0).to(max_logits.dtype)


@torch.no_grad()
def qk_clip_(layer: nn.Module, max_logits: torch.Tensor, tau: float = 100.0,
             alpha: float = 0.5) -> torch.Tensor:
    """Rescale ``layer``'s query and key weights in place so that every head whose
    ``max_logits`` exceeded ``tau`` would have had ``tau`` as its largest logit; returns ``η``.

    The split (module docstring): multi-head attention, head ``h``'s rows of ``q_proj`` by
    ``η^α`` and of ``k_proj`` by ``η^(1−α)`` (biases too); MLA, ``q_nope`` rows by ``η^α``,
    ``q_rope`` rows by ``η``, the ``W_UK`` rows of ``kv_b_proj`` by ``η^(1−α)``, ``W_UV`` and
    the shared rope key untouched (Megatron-LM's ``clip_qk``). Heads at or below ``tau`` are
    multiplied by exactly 1 (unchanged bit for bit); if no head exceeds it, nothing is written.
    The optimiser's state is not touched."""
    _clippable(layer)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"qk_clip_: alpha must be in [0, 1], got {alpha!r}")
    H = layer.n_head
    if not isinstance(max_logits, torch.Tensor) or tuple(max_logits.shape) != (H,):
        raise ValueError(f"qk_clip_: max_logits must be a tensor [H={H}], got "
                         f"{tuple(getattr(max_logits, 'shape', ()))}")
    eta = qk_clip_factors(max_logits.detach().float(), tau)
    if bool((eta < 1).any()):
        layer.qk_clip_rows_(eta, alpha)  # the layer's rule: which rows take which power of η
    return eta


class QKClip:
    """MuonClip's bookkeeping for a whole model: the per-head maximum logit of every supported
    attention layer (:func:`attention_max_logits`), recorded during each training forward
    pass by a forward pre-hook (in ``train()`` mode, without a cache), and
    :meth:`clip_` to apply :func:`qk_clip_` after the optimiser step.

    >>> clip = QKClip(model, tau=100.0)                      # doctest: +SKIP
    >>> loss = loss_fn(model(x), y); loss.backward(); opt.step()
    >>> eta = clip.clip_()        # rescales the heads above τ, then starts a new record

    The hook recomputes each layer's queries and keys (no gradient), which costs one more
    pass of the attention scores: fine at the course's sizes (fused kernels produce the
    maximum inside the attention kernel instead).
    """

    def __init__(self, model: nn.Module, tau: float = 100.0, alpha: float = 0.5):
        qk_clip_factors(torch.zeros(1), tau)  # validates tau
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"QKClip: alpha must be in [0, 1], got {alpha!r}")
        self.tau, self.alpha = float(tau), float(alpha)
        self.layers: dict[str, nn.Module] = {}
        for name, module in model.named_modules():
            try:
                _clippable(module)
            except TypeError:
                continue
            self.layers[name] = module
        if not self.layers:
            raise ValueError("QKClip: the model has no SoftmaxAttention or "
                             "MultiHeadLatentAttention layer to clip")
        self.max_logits: dict[str, torch.Tensor] = {}
        self._handles = [m.register_forward_pre_hook(self._hook(n))
                         for n, m in self.layers.items()]

    def _hook(self, name: str):
        def hook(module, args):
            if not module.training or any(a is not None for a in args[1:]):
                return  # eval mode, or decoding with a state
            m = attention_max_logits(module, args[0])
            old = self.max_logits.get(name)
            self.max_logits[name] = m if old is None else torch.maximum(old, m)

        return hook

    def reset(self) -> None:
        """Forget the maxima recorded so far."""
        self.max_logits = {}

    def largest(self) -> float:
        """The largest logit recorded over all layers and heads (``-inf`` if none)."""
        return max((float(m.max()) for m in self.max_logits.values()), default=-math.inf)

    def clip_(self) -> dict[str, torch.Tensor]:
        """Apply :func:`qk_clip_` to each layer with its recorded maxima; return ``η`` per
        layer, then reset the record."""
        etas = {name: qk_clip_(self.layers[name], m, self.tau, self.alpha)
                for name, m in self.max_logits.items()}
        self.reset()
        return etas

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> QKClip:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
