"""Kimi Delta Attention (chapter 11; Kimi Linear, arXiv 2510.26692): Gated DeltaNet with one
forget gate per key channel, i.e. per row of the state.

    S_t = (I − β_t k_tᵀ k_t) Diag(α_t) S_{t−1} + β_t k_tᵀ v_t,   α_t = exp(g_t) ∈ (0, 1]^Dk
    o_t = q_t S_t

``g [B, H, T, Dk]`` is the log decay, channel by channel. With ``g`` equal across channels this is
:mod:`tinyk3.ops.gated_delta_rule`; with ``g = 0``, :mod:`tinyk3.ops.delta_rule`.

The public signatures (the course's ops contract; chapters, exercises and readers call them)::

    recurrent(q, k, v, beta, g, *, initial_state=None) -> (o, S_T)
    chunked(q, k, v, beta, g, *, chunk_size=64, initial_state=None) -> (o, S_T)

``chunked`` is finite and accurate in float32 for every ``g_t ≥ −5`` per step and channel (the
lower-bound gate of Kimi K3) at every chunk size, and for any ``g ≤ 0`` through a slower path
(:func:`pair_scores`); chapter 11 measures both.
"""

from __future__ import annotations

import torch

from .._validate import check_beta, check_gate, check_qkv
from .chunks import check_backward_mode, from_chunks, needs_grad, to_chunks, with_derived_backward
from .chunks import chunk_size as check_chunk_size
from .chunks import initial_state as initial_state_
from .delta_rule import adjoint_state_pass, state_pass, ut_parts, ut_transform, ut_transform_backward
from .gated_delta_rule import Grads, check_backward_inputs, grads, token_loop_backward

__all__ = ["recurrent", "chunked", "pair_scores", "sub_chunk_size", "SUB_CHUNK", "EXP_LIMIT",
           "Grads", "recurrent_backward", "chunked_backward", "pair_scores_backward"]

SUB_CHUNK = 16  # tokens per sub-chunk (fla's chunk_intra, FlashKDA's CHUNK = 16)
# The factorised diagonal blocks hold exp(−Σ g) over at most one sub-chunk; float32's exp
# overflows past 88.72. Past this bound the diagonal blocks switch to the exact pairwise form.
EXP_LIMIT = 80.0


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference token loop. Returns ``(o [B, H, T, Dv], S_T [B, H, Dk, Dv])``; the state is
    accumulated in float32 (float64 for float64 inputs). Differentiable.

    The gate scales row ``d`` of the state by ``exp(g_t[d])`` before the read and the write
    (``Diag(α_t) S_{t−1}``); with ``g`` equal across channels this is Gated DeltaNet's loop.
    """
    op = "kda.recurrent"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    check_gate(g, B, H, T, Dk, q, op)
    S = initial_state_(initial_state, (B, H, Dk, Dv), q, op)
    acc = S.dtype
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t].to(acc), k[:, :, t].to(acc), v[:, :, t].to(acc)  # [B, H, D]
        b_t = beta[:, :, t].to(acc).unsqueeze(-1)  # [B, H, 1]
        S = torch.exp(g[:, :, t].to(acc)).unsqueeze(-1) * S  # forget, channel by channel
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S)  # what the decayed state holds at k_t
        u_t = b_t * (v_t - v_old)  # the delta, scaled by the write strength  [B, H, Dv]
        S = S + k_t.unsqueeze(-1) * u_t.unsqueeze(-2)  # S_t = Diag(α_t) S_{t−1} + k_tᵀ u_t
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))  # o_t = q_t S_t
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, Dv, dtype=acc)
    return o.to(v.dtype), S


def sub_chunk_size(C: int) -> int:
    """Tokens per sub-chunk for chunk size ``C``: 16 when 16 divides ``C``, else the largest power
    of two below 16 that divides ``C`` (``C`` itself when ``C < 16`` is a power of two)."""
    s = SUB_CHUNK
    while C % s:
        s //= 2
    return s


def pair_scores(X: torch.Tensor, Y: torch.Tensor, L: torch.Tensor, r: torch.Tensor, *,
                strict: bool, exact_diagonal: bool = False) -> torch.Tensor:
    """``P_ij = Σ_d X_id Y_jd exp(G_id − G_jd)`` for ``j ≤ i`` (``j < i`` if ``strict``), 0 above,
    for every chunk: ``K Kᵀ`` and ``Q Kᵀ`` with the per-channel decay between tokens ``j`` and ``i``.

    The chunk's ``C`` tokens are cut into ``n`` sub-chunks of ``s`` tokens. Inputs are per
    sub-chunk, ``[Z, n, s, D]``: rows ``X``, columns ``Y``, the cumulative gate *inside* each
    sub-chunk ``L`` (``L_i = Σ g`` from the sub-chunk's first token to ``i``), and ``r [Z, n, 1, D]``,
    the cumulative gate before each sub-chunk (its reference point; ``G_i = r_a + L_i``).

    For row ``i`` in sub-chunk ``a`` and column ``j`` in sub-chunk ``b ≤ a``:
    ``exp(G_i − G_j) = exp(L_i) · exp(r_a − r_b − L_j)``. The row factor ``exp(L_i)`` lies in
    ``[e^{−5s}, 1]`` for gates ``≥ −5``; the column factor is ``≤ 1`` when ``b < a`` (``j`` comes
    before the reference point), and ``exp(−L_j) ≤ e^{5s}`` (``5.5e34`` at ``s = 16``) inside the
    diagonal block ``b = a``. So every block is one matrix product of bounded factors; pairs with
    ``b > a`` are never formed. ``exact_diagonal``: the diagonal blocks use ``exp(L_i − L_j)``
    pair by pair instead (``[Z, n, s, s, D]`` elementwise work, finite for any ``g ≤ 0``).
    Returns ``[Z, C, C]`` with ``C = n s``.
    """
    strict_ = (strict,)
    return _pair_scores([X], Y, L, r, strict=strict_, exact_diagonal=exact_diagonal)[0]


def _gate_sums(sub: torch.Tensor):
    """``sub [Z, n, s, D]``: a chunk's gates cut into sub-chunks. Returns ``L`` (summed inside each
    sub-chunk up to token ``i``), ``r [Z, n, 1, D]`` (summed over the earlier sub-chunks),
    ``G = r + L`` and ``G_rest = Σ_{s > i} g_s`` to the chunk's end, as the rest of ``i``'s own
    sub-chunk plus the later sub-chunks' sums: never the difference of two sums over the whole
    chunk, so its rounding stays that of a sum over at most one sub-chunk."""
    L = sub.cumsum(2)  # Σ_{s' ≤ i} inside the sub-chunk
    s = sub.shape[2]  # Σ_{s' > i} inside the sub-chunk: a product with a strictly upper [s, s]
    after = torch.ones(s, s, dtype=sub.dtype, device=sub.device).triu(1) @ sub  # matrix of ones
    tot = L[:, :, -1:]  # each sub-chunk's sum                                          [Z, n, 1, D]
    zero = torch.zeros_like(tot[:, :1])
    r = torch.cat([zero, tot[:, :-1]], dim=1).cumsum(1)  # Σ over the earlier sub-chunks (n ≤ 4)
    later = torch.cat([tot[:, 1:], zero], dim=1).flip(1).cumsum(1).flip(1)  # over the later ones
    return L, r, r + L, after + later


def _pair_scores(Xs, Y, L, r, *, strict, exact_diagonal=False, rows=None):
    """:func:`pair_scores` for several row matrices against one ``Y`` (``K Kᵀ`` and ``Q Kᵀ`` share
    the column factors): ``Xs`` a list of ``[Z, n, s, D]``, ``strict`` a tuple of bools (one per X).

    Row block ``a`` needs the columns of blocks ``0..a`` only, so block row ``a`` is one product
    ``(X_a ⊙ e^{L_a}) (Y_{≤a} ⊙ e^{r_a − r_b − L_{≤a}})ᵀ``: the ``(b > a)`` blocks are never formed,
    and no exponent is masked. The exponent is taken as ``(r_a − r_b) − L_j``, not ``r_a − G_j``:
    ``G_j`` is a sum over up to a whole chunk, and its rounding would enter every factor.
    """
    Z, n, s, D = Y.shape
    C = n * s
    Yf = Y.reshape(Z, C, D)
    rows = torch.exp(L) if rows is None else rows  # e^{L_i}, shared by every X      [Z, n, s, D]
    out = [Y.new_zeros(Z, C, C) for _ in Xs]
    keep = [torch.ones(s, s, dtype=torch.bool, device=Y.device).tril(-1 if st else 0)
            for st in strict]  # the causal mask inside a diagonal block
    for a in range(n):
        lo, hi = a * s, (a + 1) * s
        end = lo if exact_diagonal else hi  # the columns this block row needs
        if end == 0:
            continue
        nb = end // s  # column blocks b < a (and b = a unless exact_diagonal)
        E = ((r[:, a:a + 1] - r[:, :nb]) - L[:, :nb]).reshape(Z, end, D)  # r_a − r_b − L_j
        cols = (Yf[:, :end] * torch.exp(E)).transpose(-1, -2)  # y_j e^{r_a − G_j}
        for P, X, m in zip(out, Xs, keep):
            blk = (X[:, a] * rows[:, a]) @ cols  # [Z, s, end]
            if not exact_diagonal:
                blk[:, :, lo:] *= m  # mask inside the diagonal block only
            P[:, lo:hi, :end] = blk
    if exact_diagonal:  # exp(L_i − L_j) elementwise inside each sub-chunk (L_i ≤ L_j for j ≤ i)
        i = torch.arange(s, device=Y.device)
        lower = (i[:, None] >= i[None, :])[None, None, :, :, None]
        Ed = L.unsqueeze(3) - L.unsqueeze(2)  # L_i − L_j                               [Z, n, s, s, D]
        Ed = torch.exp(torch.where(lower, Ed, torch.full_like(Ed, -torch.inf)))
        for P, X, m in zip(out, Xs, keep):
            diag = torch.einsum("znid,znjd,znijd->znij", X, Y, Ed) * m  # [Z, n, s, s]
            for a in range(n):
                P[:, a * s:(a + 1) * s, a * s:(a + 1) * s] = diag[:, a]
    return out


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    backward: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise KDA. Same contract as :func:`recurrent`.

    Inside a chunk, ``G_i = Σ_{s ≤ i} g_s`` per channel (``γ_i = exp(G_i)``, a row vector) and the
    decayed key scores ``Ω^kk_ij = Σ_d k_id k_jd exp(G_id − G_jd)`` for ``j < i``
    (:func:`pair_scores`)::

        𝒯       = (I + tril(diag(β) Ω^kk, −1))⁻¹ diag(β)
        W       = 𝒯 (K ⊙ Γ),    U = 𝒯 V          (rows of K ⊙ Γ: k_i ⊙ γ_i)
        U'      = U − W S_[c]
        O_[c]   = (Q ⊙ Γ) S_[c] + Ω U',   Ω_ij = Σ_d q_id k_jd exp(G_id − G_jd)  (j ≤ i)
        S_[c+1] = Diag(γ_C) S_[c] + (K ⊙ γ_C / Γ)ᵀ U'

    Unlike Gated DeltaNet's, ``Ω^kk`` is no rescaling of ``K Kᵀ``: it is ``(K ⊙ Γ)(K ⊘ Γ)ᵀ``, and
    ``K ⊘ Γ`` holds ``exp(−G)``, which overflows float32 within a chunk of strong gates
    (``e^{320}`` over 64 tokens at ``g = −5``). :func:`pair_scores` works in 16-token sub-chunks
    with a reference point each, so every factor stays bounded; if some sub-chunk's gates sum
    below ``−EXP_LIMIT`` (possible only for gates below ``−5``) its diagonal blocks are computed
    pair by pair. Every other factor (``exp(G_i)``, ``exp(G_C − G_i)``, ``exp(G_C)``) is ``≤ 1``.
    Any ``chunk_size ≥ 1`` (sub-chunks: :func:`sub_chunk_size`).

    Differentiable: by :func:`chunked_backward` (``backward="derived"``, the default, chapter
    20; autograd keeps the inputs and the chunk-boundary states only) or by autograd through the
    operations above (``backward="autograd"``; :func:`tinyk3.ops.chunks.backward_mode`).
    """
    op = "kda.chunked"
    B, H, T, Dk, Dv = check_qkv(q, k, v, op)
    check_beta(beta, B, H, T, q, op)
    check_gate(g, B, H, T, Dk, q, op)
    C = check_chunk_size(chunk_size, op)
    S0 = initial_state_(initial_state, (B, H, Dk, Dv), q, op)
    if check_backward_mode(backward, op) == "derived" and needs_grad(q, k, v, beta, g,
                                                                     initial_state):
        return with_derived_backward(_chunked_forward, chunked_backward, (q, k, v, beta, g),
                                     None if initial_state is None else S0, C)
    return _chunked_forward(q, k, v, beta, g, C, S0)[:2]


def _chunked_forward(q, k, v, beta, g, C: int, S0: torch.Tensor):
    """:func:`chunked`'s stages, inputs checked; returns ``o``, ``S_T`` and every ``S_[c]``."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    S = S0.reshape(B * H, Dk, Dv)
    acc, out_dtype = S.dtype, v.dtype
    if T == 0:
        return v.new_zeros(B, H, 0, Dv), S.view(B, H, Dk, Dv).clone(), S.new_zeros(B * H, 0, Dk, Dv)
    Q, K, V, gc = (to_chunks(t.to(acc), C).flatten(0, 1) for t in (q, k, v, g))  # [BH, N, C, D]
    b = to_chunks(beta.to(acc).unsqueeze(-1), C).flatten(0, 1)  # [BH, N, C, 1]
    BH, N = Q.shape[:2]
    s = sub_chunk_size(C)
    n = C // s

    # the gates: inside each sub-chunk (L), before each sub-chunk (r), from the chunk's start (G),
    # and to the chunk's end (G_rest); e^{L} and γ = e^{r} e^{L} are shared by several terms below
    L, r, G, G_rest = _gate_sums(gc.reshape(BH * N, n, s, Dk))
    exact = bool((L.detach().amin() < -EXP_LIMIT).item()) if L.numel() else False
    rows = torch.exp(L)  # e^{L_i} ∈ (0, 1]                                      [BH·N, n, s, Dk]
    gamma = (rows if n == 1 else rows * torch.exp(r)).reshape(BH, N, C, Dk)  # γ_i = e^{r_a} e^{L_i}

    # the decayed scores of keys with keys (Ω^kk, j < i) and queries with keys (Ω, j ≤ i), sharing
    # the keys' factors
    A, Om = (P.reshape(BH, N, C, C) for P in _pair_scores(
        [K.reshape(BH * N, n, s, Dk), Q.reshape(BH * N, n, s, Dk)], K.reshape(BH * N, n, s, Dk), L, r,
        strict=(True, False), exact_diagonal=exact, rows=rows))
    G, G_rest = G.reshape(BH, N, C, Dk), G_rest.reshape(BH, N, C, Dk)

    # (1) the decayed UT transform and WY factors; Ω^kk_ij = Σ_d k_id k_jd exp(G_id − G_jd), j < i
    Tk = ut_transform(A, b)
    W, U = Tk @ (K * gamma), Tk @ V
    # (2) Ω_ij = Σ_d q_id k_jd exp(G_id − G_jd), j ≤ i: computed above with A
    # (3) the state pass: S_[c+1] = Diag(γ_C) S_[c] + (K ⊙ γ_C / Γ)ᵀ U'
    Kt = (K * torch.exp(G_rest)).transpose(-1, -2)  # [BH, N, Dk, C]
    decay = torch.exp(G[:, :, -1]).unsqueeze(-1)  # γ_C, one factor per row of S      [BH, N, Dk, 1]
    S_all, U_new, S = state_pass(W, U, Kt, S, decay)
    # (4) O_[c] = (Q ⊙ Γ) S_[c] + Ω U'
    o = (Q * gamma) @ S_all + Om @ U_new
    o = from_chunks(o.view(B, H, *o.shape[1:]), T)
    return o.to(out_dtype), S.view(B, H, Dk, Dv), S_all


# -- the backward pass (chapter 20) ------------------------------------------------------------

def recurrent_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    d_o: torch.Tensor,
    d_state: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
) -> Grads:
    """The reference backward of :func:`recurrent`: the adjoint state run backward in time, the
    gate's gradient row by row of the state
    (:func:`tinyk3.ops.gated_delta_rule.token_loop_backward`). Returns :class:`Grads`."""
    op = "kda.recurrent_backward"
    *_, S0 = check_backward_inputs(q, k, v, beta, g, d_o, d_state, initial_state, True, op)
    dq, dk, dv, db, dg, dS = token_loop_backward(q, k, v, beta, g, S0, d_o, d_state)
    return grads(dq, dk, dv, db, dg, dS, q, v, beta, g, initial_state)


def pair_scores_backward(pairs, Y: torch.Tensor, L: torch.Tensor, r: torch.Tensor, *,
                         exact_diagonal: bool = False):
    """The backward of :func:`pair_scores`. For each ``(M, X)`` in ``pairs`` (``M = ∂L/∂P``
    ``[Z, C, C]``, zero where ``P`` is, ``X [Z, n, s, D]``) and the shared columns ``Y``::

        dX_id = Σ_j M_ij Y_jd e^{G_id − G_jd}      dY_jd = Σ_i M_ij X_id e^{G_id − G_jd}
        dG_id = X_id dX_id − Y_id dY_id            (the exponent is + G_i and − G_j)

    by the forward's blocks. Below the diagonal, ``e^{G_i − G_j} = e^{L_i} · e^{r_a − r_b − L_j}``,
    both factors ``≤ 1``. A diagonal block is split at a reference point taken from its first
    token, ``m = L_0 − EXP_LIMIT / 2``: ``e^{L_i − m} · e^{m − L_j}``, each factor within
    ``e^{±40}`` whenever the block's gates sum to ``≥ −EXP_LIMIT`` (else ``exact_diagonal``, pair by
    pair), so a product with a gradient cannot overflow float32, and no factor depends on a
    later token's gate (a reference at the block's middle token would: fla issue 1240).

    The pairs ``i = j`` are left out of the gate's gradient: their decay ``e^{G_i − G_i} = 1``
    does not depend on the gate, so their two shares (``+ X_i dX_i`` and ``− Y_i dY_i``) cancel
    exactly, and computed through the factors they would leave only rounding, which can exceed the
    true gradient at strong gates (attention-gym PR 461). Their share of ``dX`` and ``dY``,
    ``M_ii Y_i`` and ``M_ii X_i``, is added directly. Returns the list of ``dX`` (one per pair),
    ``dY`` (summed over the pairs) and ``dG`` (summed), each ``[Z, n, s, D]``.
    """
    Z, n, s, D = Y.shape
    C = n * s
    Yf = Y.reshape(Z, C, D)
    dXs = [torch.zeros_like(X) for _, X in pairs]
    dY = torch.zeros_like(Yf)
    rows = torch.exp(L)  # e^{L_i} ≤ 1
    strict = torch.ones(s, s, dtype=torch.bool, device=Y.device).tril(-1)
    for a in range(n):
        lo, hi = a * s, (a + 1) * s
        if lo:  # the column blocks b < a
            cols = torch.exp(((r[:, a:a + 1] - r[:, :a]) - L[:, :a]).reshape(Z, lo, D))
            Yc = Yf[:, :lo] * cols
            for (M, X), dX in zip(pairs, dXs):
                Mab = M[:, lo:hi, :lo]  # [Z, s, lo]
                dX[:, a] += rows[:, a] * (Mab @ Yc)
                dY[:, :lo] += cols * (Mab.transpose(-1, -2) @ (X[:, a] * rows[:, a]))
        if exact_diagonal:
            continue
        m = L[:, a, :1] - EXP_LIMIT / 2  # the reference, from the block's first token [Z, 1, D]
        before, after = torch.exp(L[:, a] - m), torch.exp(m - L[:, a])  # e^{L_i − m}, e^{m − L_j}
        for (M, X), dX in zip(pairs, dXs):
            Md = M[:, lo:hi, lo:hi] * strict  # j < i: the pairs whose decay has a gradient
            dX[:, a] += before * (Md @ (Y[:, a] * after))
            dY[:, lo:hi] += after * (Md.transpose(-1, -2) @ (X[:, a] * before))
    dY = dY.view(Z, n, s, D)
    if exact_diagonal:  # e^{L_i − L_j} pair by pair inside each sub-chunk, j < i
        E = L.unsqueeze(3) - L.unsqueeze(2)  # L_i − L_j                            [Z, n, s, s, D]
        E = torch.exp(torch.where(strict[None, None, :, :, None], E, torch.full_like(E, -torch.inf)))
        for (M, X), dX in zip(pairs, dXs):
            Md = torch.stack([M[:, a * s:(a + 1) * s, a * s:(a + 1) * s] for a in range(n)], 1)
            dX += torch.einsum("znij,znjd,znijd->znid", Md, Y, E)
            dY += torch.einsum("znij,znid,znijd->znjd", Md, X, E)
    dG = sum(X * dX for (_, X), dX in zip(pairs, dXs)) - Y * dY
    for (M, X), dX in zip(pairs, dXs):  # the pairs i = j: decay 1, no share in dG
        Mii = M.diagonal(dim1=-2, dim2=-1).reshape(Z, n, s, 1)
        dX += Mii * Y
        dY += Mii * X
    return dXs, dY, dG


def chunked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    d_o: torch.Tensor,
    d_state: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    boundary_states: torch.Tensor | None = None,
) -> Grads:
    """The backward of :func:`chunked` from the derived formulas (chapter 20), no autograd.

    Gated DeltaNet's backward (:func:`tinyk3.ops.gated_delta_rule.chunked_backward`) with the
    gate's factors per channel: ``γ_i``, ``ρ_i = e^{G_C − G_i}`` and ``γ_C`` are row vectors, and
    the decayed scores ``Ω^kk`` and ``Ω`` are not a matrix times a mask, so their gradients go
    through :func:`pair_scores_backward`, sub-chunk by sub-chunk, with every factor bounded as in
    the forward. The log decay's gradient is again a reverse cumulative sum over the chunk,
    channel by channel. Finite and accurate in float32 for gates ``≥ −5`` per step and channel
    (and any ``g ≤ 0`` through the exact diagonal path). Returns :class:`Grads`.
    """
    op = "kda.chunked_backward"
    B, H, T, Dk, Dv, S0 = check_backward_inputs(q, k, v, beta, g, d_o, d_state, initial_state,
                                                True, op)
    C = check_chunk_size(chunk_size, op)
    acc = S0.dtype
    dS = (S0.new_zeros(B * H, Dk, Dv) if d_state is None
          else d_state.to(acc).reshape(B * H, Dk, Dv))
    if T == 0:
        z = q.new_zeros(B, H, 0, Dk, dtype=acc)
        return grads(z, z, z.new_zeros(B, H, 0, Dv), z.new_zeros(B, H, 0), z,
                     dS.view(B, H, Dk, Dv), q, v, beta, g, initial_state)
    Q, K, V, gc, dO = (to_chunks(t.to(acc), C).flatten(0, 1) for t in (q, k, v, g, d_o))
    b = to_chunks(beta.to(acc).unsqueeze(-1), C).flatten(0, 1)  # [BH, N, C, 1]
    BH, N = Q.shape[:2]
    s = sub_chunk_size(C)
    n = C // s
    L, r, G, G_rest = _gate_sums(gc.reshape(BH * N, n, s, Dk))
    exact = bool((L.amin() < -EXP_LIMIT).item())
    rows = torch.exp(L)
    gamma = (rows if n == 1 else rows * torch.exp(r)).reshape(BH, N, C, Dk)  # γ_i
    rho = torch.exp(G_rest).reshape(BH, N, C, Dk)  # ρ_i = e^{G_C − G_i}
    decay = torch.exp(G.reshape(BH, N, C, Dk)[:, :, -1]).unsqueeze(-1)  # γ_C     [BH, N, Dk, 1]
    Ks, Qs = K.reshape(BH * N, n, s, Dk), Q.reshape(BH * N, n, s, Dk)

    # (1) and (2): the decayed scores, the UT transform and the WY factors, recomputed
    A, Om = (P.reshape(BH, N, C, C) for P in _pair_scores(
        [Ks, Qs], Ks, L, r, strict=(True, False), exact_diagonal=exact, rows=rows))
    X, Tk = ut_parts(A, b)
    Kg, Qg, Kr = K * gamma, Q * gamma, K * rho
    W, U = Tk @ Kg, Tk @ V
    # (3) U'_[c] from the boundary states
    S_all = (state_pass(W, U, Kr.transpose(-1, -2), S0.reshape(BH, Dk, Dv), decay)[0]
             if boundary_states is None else boundary_states.to(acc))
    U_new = U - W @ S_all
    # (4) the adjoint state pass, decaying row by row by γ_C
    dU_new, dS_next, dS0 = adjoint_state_pass(Om.transpose(-1, -2) @ dO,
                                              Qg.transpose(-1, -2) @ dO, W, Kr, dS, decay)
    # (5) every chunk's gradients at once
    dQg = dO @ S_all.transpose(-1, -2)  # through (Q ⊙ Γ) S_[c]
    dOm = (dO @ U_new.transpose(-1, -2)).tril()  # through Ω U' (Ω lives on j ≤ i)
    dKr = U_new @ dS_next.transpose(-1, -2)  # through (K ⊙ ρ)ᵀ U'
    dW = -(dU_new @ S_all.transpose(-1, -2))
    dKg = Tk.transpose(-1, -2) @ dW  # through W = 𝒯 (K ⊙ Γ)
    dT = dW @ Kg.transpose(-1, -2) + dU_new @ V.transpose(-1, -2)
    dA, db = ut_transform_backward(A, b, X, Tk, dT)  # dA: strictly lower, as Ω^kk
    (dK_rows, dQ_rows), dK_cols, dG_pairs = pair_scores_backward(
        [(dA.reshape(BH * N, C, C), Ks), (dOm.reshape(BH * N, C, C), Qs)], Ks, L, r,
        exact_diagonal=exact)
    dQ = gamma * dQg + dQ_rows.reshape(BH, N, C, Dk)
    dK = (gamma * dKg + rho * dKr
          + (dK_rows + dK_cols).reshape(BH, N, C, Dk))
    dV = Tk.transpose(-1, -2) @ dU_new
    # the log decay, channel by channel: every factor of the gate, then the reverse cumsum
    dG = gamma * (dQg * Q + dKg * K) + dG_pairs.reshape(BH, N, C, Dk)
    dG[:, :, -1] += decay.squeeze(-1) * (dS_next * S_all).sum(-1)  # through Diag(γ_C) S_[c]
    d_rest = rho * dKr * K  # through ρ_i = e^{Σ_{s>i} g_s}
    dg = dG.flip(2).cumsum(2).flip(2)  # dg_s = Σ_{i ≥ s} dG_i
    dg = dg + torch.cat([torch.zeros_like(d_rest[:, :, :1]), d_rest[:, :, :-1].cumsum(2)], 2)

    def back(x):  # [BH, N, C, ...] -> [B, H, T, ...]
        return from_chunks(x.view(B, H, *x.shape[1:]), T)

    return grads(back(dQ), back(dK), back(dV), back(db).squeeze(-1), back(dg),
                 dS0.view(B, H, Dk, Dv), q, v, beta, g, initial_state)
