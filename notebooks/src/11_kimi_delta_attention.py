# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Kimi Delta Attention
#
# Chapter 10's Gated DeltaNet forgets with one number per token and head: before each write the
# whole state shrinks by $\alpha_t = e^{g_t}$, every key channel at the same rate. A head that must
# keep one fact for a thousand tokens and let another go after ten cannot do both. Kimi Delta
# Attention (KDA; Kimi Team, *Kimi Linear*, arXiv 2510.26692), the linear layer of Kimi Linear
# and of all 69 linear layers of Kimi K3, gives each key channel its own gate:
#
# $$
# S_t = (I - \beta_t k_t^\top k_t)\, \operatorname{Diag}(\alpha_t)\, S_{t-1} + \beta_t k_t^\top v_t,
# \qquad \alpha_t = e^{g_t} \in (0, 1]^{D_k}, \qquad o_t = q_t S_t .
# $$
#
# Channel $d$ of the key addresses row $d$ of the state, so $\operatorname{Diag}(\alpha_t)$ decays
# the rows of $S$, each at its own rate, before the delta rule corrects into what is left.
#
# **In this chapter** you build the token loop and check its two reductions (to Gated DeltaNet
# and to DeltaNet); write the transition as a diagonal-plus-low-rank matrix and count what tying
# both low-rank vectors to the key saves against the general form of RWKV-7 and fla's
# `generalized_delta_rule`; derive the chunk form, and see why chapter 10's rescaling trick
# stops working; measure the numerics that shape every KDA kernel (the overflow of
# $e^{-\sum g}$, 16-token sub-chunks with reference points, the lower-bound gate of Kimi K3);
# check `tinyk3.ops.kda.chunked` against the loop; and test, on a task with two time scales,
# whether per-channel gates beat one gate per head, with gates set by hand and then learned.
# An optional last section, after the summary, reads the Triton kernels of both gated rules:
# what the gate changes in chapter 9's kernel, line by line, checked under the interpreter and
# compiled for an H100 without one.
#
# **Cost.** Under a minute on one CPU core, most of it in training the gates of the experiment
# and running the kernels under the Triton interpreter (the last cell prints the time);
# `SMOKE = True` runs faster.

# %% tags=["hide-input"]
# Setup. Where the course package is missing (Colab, Kaggle, a fresh Jupyter), install
# it from the repository without changing any package already installed: each one is
# pinned to its installed version, so pip adds only what is missing (or stops and says
# why). Locally, `make book` or `pip install -e .` has installed it. Then fix threads
# and seeds.
import importlib
import importlib.util
import subprocess
import sys
import tempfile

REPO_URL = "https://github.com/tinyk3-course/gpt2-to-kimi-k3"
PACKAGE = f"git+{REPO_URL}"
if importlib.util.find_spec("tinyk3") is None:
    pip = [sys.executable, "-m", "pip"]
    installed = subprocess.run(pip + ["list", "--format=freeze"], check=True,
                               capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write(installed)
    subprocess.run(pip + ["install", "-q", "-c", pins.name, PACKAGE], check=True)
    importlib.invalidate_caches()

import time

import tinyk3

tinyk3.setup(seed=0)
NOTEBOOK_START = time.perf_counter()

# %% tags=["parameters"]
SMOKE = False  # True: tiny sizes, for CI and the impatient

# %%
import math
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from tinyk3 import checks, cost, gates
from tinyk3.memory import orthonormal_keys
from tinyk3.ops import delta_rule, gated_delta_rule, kda
from tinyk3.util import max_diff

T_LONG = 1024 if SMOKE else 8192  # sequence length of the float32 accuracy check
T_STRESS = 128 if SMOKE else 512  # sequence length of the numerics sweep
STRENGTHS = [0.5, 2, 5, 8] if SMOKE else [0.25, 0.5, 1, 2, 3, 4, 5, 6, 8]  # gate bounds
B_EXP = 4 if SMOKE else 16  # independent sequences in the experiment
T_EXP = 256 if SMOKE else 1024  # short-lived facts streamed in the experiment
TRAIN_STEPS = 10 if SMOKE else 120  # gradient steps of each trained-gate run


def kda_inputs(B, H, T, Dk, Dv, seed, *, low=-5.0, dtype=torch.float64):
    """Unit queries and keys, standard normal values, β uniform in (0, 1), and
    per-channel gates as Kimi K3's lower-bound gate makes them, g = low · sigmoid(x),
    x ~ N(0, 2²): every gate in (low, 0), many near either end."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=dtype)
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype)
    x = 2 * torch.randn(B, H, T, Dk, generator=gen, dtype=dtype)
    zero = torch.zeros(H, dtype=dtype)  # A_log = 0, dt_bias = 0
    g = gates.lower_bound_gate(x, zero, zero, lower_bound=low)
    return q, k, v, beta, g


def rel_err(a, ref):
    """max |a − ref| / max |ref|: the error relative to the size of the outputs."""
    return max_diff(a, ref) / ref.abs().max().item()


# %% [markdown]
# ## The idea: one gate per key channel
#
# The notation is chapter 10's, with the gate now a row vector: $g_t \in \mathbb{R}^{1 \times D_k}$,
# $g_t \le 0$, is the log decay of token $t$, one entry per key channel, and
# $\alpha_t = e^{g_t}$ the decay factors. $\operatorname{Diag}(\alpha_t)$ is the $D_k \times D_k$
# diagonal matrix with $\alpha_t$ on its diagonal. One step, forget before error as in chapter 10:
#
# $$
# S'_t = \operatorname{Diag}(\alpha_t)\, S_{t-1}, \qquad
# S_t = S'_t + k_t^\top \beta_t \big(v_t - k_t S'_t\big), \qquad o_t = q_t S_t .
# $$
#
# Row $d$ of $S$ holds what keys with weight in channel $d$ have written; a gate near 0 in that
# channel keeps it, a gate of $-5$ leaves $e^{-5}$ of it (under one percent) after one token.
# The token loop, written out:

# %%
def kda_loop(q, k, v, beta, g, S):
    """The KDA token loop from the state S [B, H, Dk, Dv]; returns (o, S_T)."""
    outs = []
    for t in range(q.shape[2]):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]  # rows   [B, H, D]
        S = torch.exp(g[:, :, t]).unsqueeze(-1) * S  # Diag(α_t) S: row d times α_t[d]
        v_old = torch.einsum("bhk,bhkv->bhv", k_t, S)  # k_t S'_t           [B, H, Dv]
        u_t = beta[:, :, t, None] * (v_t - v_old)  # the delta              [B, H, Dv]
        S = S + k_t.unsqueeze(-1) * u_t.unsqueeze(-2)  # S'_t + k_tᵀ u_t  [B, H, Dk, Dv]
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))  # o_t = q_t S_t
    return torch.stack(outs, dim=2), S


B, H, T, Dk, Dv = 2, 3, 50, 8, 6
q, k, v, beta, g = kda_inputs(B, H, T, Dk, Dv, seed=0)
S0 = torch.randn(B, H, Dk, Dv, dtype=torch.float64)
o_mine, S_mine = kda_loop(q, k, v, beta, g, S0)
o_lib, S_lib = kda.recurrent(q, k, v, beta, g, initial_state=S0)
print(f"my loop against kda.recurrent: max |o| diff {max_diff(o_mine, o_lib):.1e}, "
      f"max |S_T| diff {max_diff(S_mine, S_lib):.1e}")

# %% [markdown]
# **Two reductions.** With the same gate in every channel, $\operatorname{Diag}(\alpha_t) = \alpha_t I$
# commutes with everything and the step is chapter 10's Gated DeltaNet,
# $S_t = \alpha_t (I - \beta_t k_t^\top k_t) S_{t-1} + \beta_t k_t^\top v_t$; with $g = 0$ it is
# chapter 5's delta rule:

# %%
g_head = g[..., 0]  # one gate per token and head                      [B, H, T]
g_same = g_head.unsqueeze(-1).expand(-1, -1, -1, Dk)  # copied to every channel
o_kda, S_kda = kda.recurrent(q, k, v, beta, g_same, initial_state=S0)
o_gdn, S_gdn = gated_delta_rule.recurrent(q, k, v, beta, g_head, initial_state=S0)
print(f"g equal across channels vs gated_delta_rule: max |o| diff "
      f"{max_diff(o_kda, o_gdn):.1e}, max |S_T| diff {max_diff(S_kda, S_gdn):.1e}")
o_kda, S_kda = kda.recurrent(q, k, v, beta, torch.zeros_like(g), initial_state=S0)
o_dr, S_dr = delta_rule.recurrent(q, k, v, beta, initial_state=S0)
print(f"g = 0 vs delta_rule:                      max |o| diff "
      f"{max_diff(o_kda, o_dr):.1e}, max |S_T| diff {max_diff(S_kda, S_dr):.1e}")

# %% [markdown]
# The order matters once the gates differ across channels. Chapter 10 could write its
# transition as $\alpha_t (I - \beta_t k_t^\top k_t)$ or $(I - \beta_t k_t^\top k_t)\alpha_t$; here
# $\operatorname{Diag}(\alpha_t)$ and $k_t^\top k_t$ do not commute, and decaying *after* the
# projection is a different rule:

# %%
k_t, b_t, g_t = k[0, 0, 0], beta[0, 0, 0], g[0, 0, 0]  # one token of one head
F_t = torch.eye(Dk, dtype=torch.float64) - b_t * torch.outer(k_t, k_t)  # I − β kᵀk
D_t = torch.diag(torch.exp(g_t))  # Diag(α_t)
print(f"max |F Diag(α) − Diag(α) F| = {max_diff(F_t @ D_t, D_t @ F_t):.2f} "
      f"(largest entry of F Diag(α): {(F_t @ D_t).abs().max():.2f})")

# %% [markdown]
# ## The transition: diagonal plus low rank, tied to the key
#
# Multiply out KDA's transition:
#
# $$
# (I - \beta_t k_t^\top k_t)\operatorname{Diag}(\alpha_t)
# = \operatorname{Diag}(\alpha_t) - \beta_t\, k_t^\top (k_t \odot \alpha_t) .
# $$
#
# A diagonal matrix plus a rank-one matrix (DPLR). The general DPLR recurrence, as
# flash-linear-attention writes it for RWKV-7 (`fla/ops/generalized_delta_rule/dplr/naive.py`,
# in our layout), has two free vectors $a_t, b_t \in \mathbb{R}^{1 \times D_k}$ for the rank-one
# part:
#
# $$
# S_t = \big(\operatorname{Diag}(e^{g_t}) + b_t^\top a_t\big)\, S_{t-1} + k_t^\top v_t .
# $$
#
# KDA is the special case $a_t = k_t \odot \alpha_t$, $b_t = -\beta_t k_t$, with the value
# $\beta_t v_t$: both low-rank vectors are made from the key. (RWKV-7's layer builds its $a$ and $b$
# from its key too, with a learned per-channel rate; fla's DPLR kernels cannot assume any tie and
# take both as inputs.) The general loop, and KDA through it:

# %%
def dplr_loop(q, k, v, a, b, g, S):
    """General DPLR: S_t = (Diag(e^g_t) + b_tᵀ a_t) S_{t−1} + k_tᵀ v_t, o_t = q_t S_t"""
    outs = []
    for t in range(q.shape[2]):
        a_S = torch.einsum("bhk,bhkv->bhv", a[:, :, t], S)  # a_t S_{t−1}    [B, H, Dv]
        S = (torch.exp(g[:, :, t]).unsqueeze(-1) * S  # Diag(e^g) S
             + b[:, :, t].unsqueeze(-1) * a_S.unsqueeze(-2)  # + b_tᵀ (a_t S)
             + k[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2))  # + k_tᵀ v_t
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


a_kda = k * torch.exp(g)  # a_t = k_t ⊙ α_t
b_kda = -beta.unsqueeze(-1) * k  # b_t = −β_t k_t
o_dplr, S_dplr = dplr_loop(q, k, beta.unsqueeze(-1) * v, a_kda, b_kda, g, S0)
print(f"KDA as DPLR against kda.recurrent: max |o| diff {max_diff(o_dplr, o_lib):.1e}")

# %% [markdown]
# ## The chunk form
#
# Take one chunk of $C$ tokens starting from $S_{[c]}$; index its tokens $i = 1, \dots, C$ and
# write $S_0 = S_{[c]}$. The decay from the chunk's start to token $i$, channel by channel, is
#
# $$
# G_i = \sum_{s \le i} g_s \in \mathbb{R}^{1 \times D_k}, \qquad \gamma_i = e^{G_i},
# $$
#
# and $\Gamma \in \mathbb{R}^{C \times D_k}$ stacks the rows $\gamma_i$, so $K \odot \Gamma$ has rows
# $k_i \odot \gamma_i$. (Chapter 10's $\Gamma$ was a $C \times C$ mask; with a gate per channel
# there would be one such mask per channel, and this chapter keeps the $C \times D_k$ matrix of
# cumulative decays instead.)
#
# **Undo the decay.** Let $\tilde S_i = \operatorname{Diag}(\gamma_i)^{-1} S_i$. Since
# $\operatorname{Diag}(\alpha_i)\operatorname{Diag}(\gamma_{i-1}) = \operatorname{Diag}(\gamma_i)$,
#
# $$
# \tilde S_i = \big(I - \beta_i (k_i \oslash \gamma_i)^\top (k_i \odot \gamma_i)\big)\, \tilde S_{i-1}
#   + \beta_i (k_i \oslash \gamma_i)^\top v_i ,
# $$
#
# a delta rule without decay whose write key $k_i \oslash \gamma_i$ differs from its read key
# $k_i \odot \gamma_i$. Its deltas are $u_i = \beta_i\big(v_i - (k_i \odot \gamma_i)\tilde S_{i-1}\big)$,
# and $\tilde S_{i-1} = S_0 + \sum_{j<i} (k_j \oslash \gamma_j)^\top u_j$, so
#
# $$
# u_i = \beta_i\Big(v_i - (k_i \odot \gamma_i) S_0 - \sum_{j<i} \Omega^{kk}_{ij}\, u_j\Big), \qquad
# \Omega^{kk}_{ij} = (k_i \odot \gamma_i)\cdot(k_j \oslash \gamma_j) = \sum_d k_{id} k_{jd}\, e^{G_{id} - G_{jd}} .
# $$
#
# Chapter 7's argument, line by line: stacked, $(I + \operatorname{tril}(\operatorname{diag}(\beta) \Omega^{kk}, -1))\,U' = \operatorname{diag}(\beta)\big(V - (K \odot \Gamma) S_0\big)$, so with
#
# $$
# \mathcal{T} = \big(I + \operatorname{tril}(\operatorname{diag}(\beta) \Omega^{kk}, -1)\big)^{-1}\operatorname{diag}(\beta),
# \qquad W = \mathcal{T}(K \odot \Gamma), \qquad U = \mathcal{T} V :
# \qquad U' = U - W S_{[c]} .
# $$
#
# **The state and the outputs.** Going back, $S_C = \operatorname{Diag}(\gamma_C)\tilde S_C$ and
# $o_i = q_i S_i = (q_i \odot \gamma_i)\tilde S_i$:
#
# $$
# S_{[c+1]} = \operatorname{Diag}(\gamma_C)\, S_{[c]} + \big(K \odot (\gamma_C \oslash \Gamma)\big)^\top U',
# \qquad
# O_{[c]} = (Q \odot \Gamma)\, S_{[c]} + \Omega\, U', \quad
# \Omega_{ij} = \sum_d q_{id} k_{jd}\, e^{G_{id} - G_{jd}} \;(j \le i) .
# $$
#
# Every decay that crosses tokens appears as $e^{G_i - G_j}$ with $j \le i$, at most 1. The
# derivation used $k_j \oslash \gamma_j$, which holds $e^{-G_j}$; the computation must not (next
# section). One chunk, with $\Omega^{kk}$ and $\Omega$ formed pair by pair, exactly as defined:

# %%
def pairwise_scores(X, K, G, *, strict):
    """P_ij = Σ_d x_id k_jd exp(G_id − G_jd) for j ≤ i (j < i if strict), 0 above.
    X, K, G: [..., C, Dk]. The pairs above the diagonal are set to −inf before exp."""
    C = G.shape[-2]
    i = torch.arange(C)
    keep = (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # G_i − G_j          [..., C, C, Dk]
    diff = torch.where(keep[..., None], diff, torch.full_like(diff, -math.inf))
    return torch.einsum("...id,...jd,...ijd->...ij", X, K, torch.exp(diff))


def kda_chunk_step(q_c, k_c, v_c, beta_c, g_c, S):
    """One chunk: q_c, k_c, g_c [B, H, n, Dk], v_c [B, H, n, Dv], beta_c [B, H, n],
    S = S_[c]. Returns (O_[c], S_[c+1])."""
    G = g_c.cumsum(-2)  # G_i, per channel                              [B, H, n, Dk]
    Okk = pairwise_scores(k_c, k_c, G, strict=True)  # Ω^kk_ij, j < i   [B, H, n, n]
    Tc = torch.linalg.solve_triangular(  # 𝒯 = (I + tril(diag(β) Okk, −1))⁻¹ diag(β)
        torch.eye(Okk.shape[-1], dtype=Okk.dtype) + beta_c.unsqueeze(-1) * Okk,
        torch.diag_embed(beta_c), upper=False)
    W, U = Tc @ (k_c * torch.exp(G)), Tc @ v_c  # W = 𝒯 (K ⊙ Γ), U = 𝒯 V
    U_new = U - W @ S  # U' = U − W S_[c]
    Om = pairwise_scores(q_c, k_c, G, strict=False)  # Ω_ij, j ≤ i
    o = (q_c * torch.exp(G)) @ S + Om @ U_new  # O = (Q ⊙ Γ) S_[c] + Ω U'
    G_C = G[:, :, -1:]  # γ_C in log space                                 [B, H, 1, Dk]
    K_end = k_c * torch.exp(G_C - G)  # K ⊙ (γ_C ⊘ Γ), each factor ≤ 1
    S_next = torch.exp(G_C).mT * S + K_end.mT @ U_new  # Diag(γ_C) S + (…)ᵀ U'
    return o, S_next


def kda_chunked_mine(q, k, v, beta, g, C, S):
    outs = []
    for start in range(0, q.shape[2], C):  # the last chunk may be short
        sl = slice(start, start + C)
        o_c, S = kda_chunk_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl],
                                g[:, :, sl], S)
        outs.append(o_c)
    return torch.cat(outs, dim=2), S


for C in (1, 7, 16, 64):
    o_c, S_c = kda_chunked_mine(q, k, v, beta, g, C, S0)
    print(f"C = {C:2d}: max |o - kda.recurrent| = {max_diff(o_c, o_lib):.1e}, "
          f"max |S_T - kda.recurrent| = {max_diff(S_c, S_lib):.1e}")

# %% [markdown]
# **Why chapter 10's trick stops here.** With one gate per head, $\gamma_i$ is a number and
# $\Omega^{kk}_{ij} = (\gamma_i / \gamma_j)\, k_i \cdot k_j$: $\Omega^{kk} = \operatorname{diag}(\gamma)\, K K^\top
# \operatorname{diag}(\gamma)^{-1}$ (below the diagonal), so the gated UT matrix is the plain one
# rescaled and a kernel can reuse $KK^\top$. With a gate per channel the decay sits *inside* the
# sum over $d$, and no pair of diagonal matrices turns $KK^\top$ into $\Omega^{kk}$: if it did, the
# elementwise ratio $\Omega^{kk}_{ij} / (k_i \cdot k_j)$ would be a rank-one matrix $r_i c_j$. The ratio
# over all pairs (both triangles, mild gates so nothing overflows), and its singular values:

# %%
qs, ks, _, _, gs = kda_inputs(1, 1, 16, Dk, Dv, seed=3, low=-0.5)
G_s = gs[0, 0].cumsum(0)  # [16, Dk]
gram = ks[0, 0] @ ks[0, 0].T  # k_i · k_j
for name, G_ in (("one gate per head", G_s[:, :1].expand(-1, Dk)),
                 ("a gate per channel", G_s)):
    A_all = torch.einsum("id,jd,ijd->ij", ks[0, 0], ks[0, 0],
                         torch.exp(G_[:, None] - G_[None, :]))  # every pair
    sv = torch.linalg.svdvals(A_all / gram)
    print(f"{name:>18s}: singular values of Ω^kk / KKᵀ: σ2/σ1 = {sv[1] / sv[0]:.1e}, "
          f"σ3/σ1 = {sv[2] / sv[0]:.1e}")

# %% [markdown]
# With one gate the ratio is rank one to round-off; with a gate per channel it is not, and the
# kernel must form the decayed scores $\Omega^{kk}$ and $\Omega$ themselves, one sum over $d$ with a
# different decay in every term. How to do that in float32 without overflow comes after the
# count of what the tie saves.
#
# **The lib's version.** `tinyk3.ops.kda.chunked` runs these equations for all chunks at once,
# in chapter 8's four stages, with chapter 8's `state_pass` given one decay factor per row of
# the state; only the scores are formed differently, by `kda.pair_scores`:

# %%
tinyk3.notebook.show_source(kda.chunked)

# %% [markdown]
# ## What the tie saves, counted
#
# Per token and head, a DPLR layer must produce $q, k, a, b, g$
# ($D_k$ numbers each) and $v$; KDA produces $q, k, g$, $v$ and one $\beta$. In the chunk form
# (the previous section) every product of two token-indexed vectors with the decay between them becomes
# a $C \times C$ matrix per chunk. Reading the forward kernels: fla's DPLR forms four,
# `A_qk, A_qb, A_ak, A_ab` (`dplr/chunk_A_fwd.py`), then inverts $I + A_{ab}$, multiplies the
# inverse into $A_{ak}$ (a $C \times C$ by $C \times C$ product), and updates the state with two
# products (`kg`ᵀ$v$ and `bg`ᵀ$v_2$, `dplr/chunk_h_fwd.py`) and the outputs with three
# (`chunk_o_fwd.py`). fla's KDA forms two, `Aqk` and `Akk` (`kda/chunk_intra.py`): the read
# vector $a_t$ and the write vector $b_t$ of DPLR are both the key, so $A_{ab}$, $A_{ak}$ collapse
# into one matrix and $A_{qb}$, $A_{qk}$ into another. The products each forward pass issues per
# chunk of $C$ tokens, with $D_k = D_v = D$ and $2mkn$ flops for $[m, k] \times [k, n]$:

# %%
def forward_products(rule, C, D):
    """(name, m, k, n) of each product per chunk and head in fla's forward kernels."""
    if rule == "DPLR":
        return ([(f"A_{x}", C, D, C) for x in ("qk", "qb", "ak", "ab")]  # 4 scores
                + [("A_ab⁻¹ A_ak", C, C, C), ("w = A_ab⁻¹ a_g", C, C, D),
                   ("u = (A_ab⁻¹ A_ak) v", C, C, D)]
                + [("w S", C, D, D), ("k_gᵀ v", D, C, D), ("b_gᵀ v₂", D, C, D)]
                + [("q_g S", C, D, D), ("A_qk v", C, C, D), ("A_qb v₂", C, C, D)])
    return ([("A_kk", C, D, C), ("A_qk", C, D, C)]  # 2 scores
            + [("w = 𝒯 (K⊙Γ)", C, C, D), ("u = 𝒯 V", C, C, D)]
            + [("w S", C, D, D), ("k_gᵀ u'", D, C, D)]
            + [("q_g S", C, D, D), ("A_qk u'", C, C, D)])


C_, D_ = 64, 128  # Kimi Linear's and K3's head size, a GPU chunk size
print(f"per chunk of C = {C_}, D = {D_}, one head, forward:")
print(f"{'':>6s} {'inputs/token':>13s} {'C×C scores':>11s} {'products':>9s} "
      f"{'GFLOP':>8s}")
flops = {}
for rule, inputs in (("DPLR", 6 * D_), ("KDA", 4 * D_ + 1)):
    prods = forward_products(rule, C_, D_)
    n_scores = sum(m == n == C_ and kk == D_ for _, m, kk, n in prods)
    inverse = C_**3 / 3  # the triangular inverse, both rules
    flops[rule] = sum(2 * m * kk * n for _, m, kk, n in prods) + inverse
    print(f"{rule:>6s} {inputs:13d} {n_scores:11d} {len(prods):9d} "
          f"{flops[rule] / 1e9:8.4f}")
kda_model = cost.chunked_delta_rule_flops(C_, D_, C_)  # chapter 8's count, one chunk
print(f"KDA's count {flops['KDA']:,.0f}, chapter 8's DeltaNet count {kda_model:,.0f}: "
      f"|difference| {abs(flops['KDA'] - kda_model):.0f}; "
      f"DPLR / KDA flops: {flops['DPLR'] / flops['KDA']:.2f}x")
report = C_ * (6 * D_**2 + 3 * C_ * D_ + C_**2)  # the Kimi Linear report's count, T = C
print(f"the Kimi Linear report's count 6Td² + 3TCd + TC², one chunk: "
      f"{report / 1e9:.4f} GFLOP, {1 - report / kda_model:.0%} below chapter 8's")
d_model, heads = 2304, 32  # Kimi Linear 48B's KDA layers
extra = 2 * d_model * D_ * heads
print(f"two more D-wide projections per head (a and b) at Kimi Linear's width "
      f"{d_model}, {heads} heads: {extra / 1e6:.1f}M weights per layer if full rank")

# %% [markdown]
# Tying both vectors to the key makes the chunk form of KDA cost exactly what chapter 8's chunked
# DeltaNet costs in matrix products (the decay adds only elementwise exponentials), where the
# general form needs the multiple printed above and reads half again as many numbers per token.
# It also keeps the transition's eigenvalues in $[0, 1]$ for unit keys: the rank-one part of
# a DPLR transition can point anywhere, KDA's is the projection chapter 5 analysed, scaled by the
# decay.
#
# The Kimi Linear report gives its own count, $6Td^2 + 3TCd + TC^2$ (its Eq. 13), below this
# one by the share printed: the two agree on the state products, $6Td^2$, and differ in the
# $C$-wide terms, where this chapter counts each product of the forward kernels listed above at
# $2mkn$ flops. The report measures DPLR's kernel at about twice KDA's time (its Fig. 2), more
# than the flop ratio here: DPLR also reads half again as many numbers per token and forms twice
# as many score matrices.

# %% [markdown]
# ## Numerics: what shapes every KDA kernel
#
# $\Omega^{kk}_{ij} = \sum_d k_{id} k_{jd} e^{G_{id} - G_{jd}}$ as written is $C \times C \times D_k$ elementwise
# work, where a kernel wants one matrix product on tensor cores. The product form is
# $\Omega^{kk} = (K \odot \Gamma)(K \oslash \Gamma)^\top$, and $K \oslash \Gamma$ holds $e^{-G}$, which grows
# along the chunk. How far, at Kimi K3's strongest gate $g = -5$ per token:

# %%
f32 = torch.finfo(torch.float32)
print(f"float32 overflows beyond e^{math.log(f32.max):.2f} = {f32.max:.2e}; "
      f"normal numbers stop at e^{math.log(f32.tiny):.2f}")
for n in (16, 32, 64):
    up = torch.exp(torch.tensor(5.0 * n))  # exp(−Σ g) over n tokens at g = −5, float32
    down = torch.exp(torch.tensor(-5.0 * n))
    print(f"  {n:2d} tokens at g = -5: exp(-Σg) = {up.item():.2e}, "
          f"exp(Σg) = {down.item():.2e}")

# %% [markdown]
# Over 16 tokens the factor is large but representable; over 64 it is `inf`, and its partner
# $e^{G_i}$ has underflowed to 0, so $(K \odot \Gamma)(K \oslash \Gamma)^\top$ multiplies
# $0 \cdot \infty$. One chunk of $C = 64$ unit keys in float32, half the channels at $g = -5$
# (forget at once) and half at $g = -0.01$ (keep), against the exact scores, pair by pair in
# float64:

# %%
C, D_s = 64, 16
k_c = F.normalize(torch.randn(C, D_s, dtype=torch.float64), dim=-1)
g_c = torch.full((C, D_s), -5.0, dtype=torch.float64)
g_c[:, D_s // 2:] = -0.01  # the channels that keep
A_exact = pairwise_scores(k_c, k_c, g_c.cumsum(0), strict=True)  # float64
k32, G32 = k_c.float(), g_c.float().cumsum(0)
A_naive = ((k32 * torch.exp(G32)) @ (k32 * torch.exp(-G32)).T).tril(-1)
bad = ~torch.isfinite(A_naive)
print(f"naive (K ⊙ Γ)(K ⊘ Γ)ᵀ, float32: {int(torch.isnan(A_naive).sum())} NaN and "
      f"{int(torch.isinf(A_naive).sum())} inf of {C * (C - 1) // 2} entries below the "
      f"diagonal; first bad row {int(bad.any(1).nonzero()[0])}")

# %% [markdown]
# **Sub-chunks with reference points.** The way out, first used for gated linear attention's
# decay per channel (GLA: Yang et al. 2024, arXiv 2312.06635, a second level of chunking inside
# each chunk), and now in
# fla's `chunk_intra`, FlashKDA's `CHUNK = 16` and `kda.pair_scores` here, cuts the chunk into
# sub-chunks of $s = 16$ tokens
# and splits each exponent at the start of the row's sub-chunk. For row $i$ in sub-chunk $a$ and
# column $j$ in sub-chunk $b \le a$, write $G_i = r_a + L_i$, with $r_a$ the cumulative gate
# before sub-chunk $a$ (its reference point) and $L_i$ the sum inside it:
#
# $$
# e^{G_i - G_j} = \underbrace{e^{L_i}}_{\text{row factor} \,\in\, [e^{-5s}, 1]}
# \cdot \underbrace{e^{r_a - r_b - L_j}}_{\text{column factor}} .
# $$
#
# For $b < a$ the column factor is $e^{r_a - G_j} \le 1$ (token $j$ comes before the reference point);
# inside the diagonal block $b = a$ it is $e^{-L_j} \le e^{5s} = e^{80}$ at $g \ge -5$. So every
# block is one matrix product of factors float32 can hold, and the blocks above the diagonal
# are never formed. One chunk, block by block:

# %%
def sub_chunk_scores(X, K, g, s=16):
    """Ω^kk block by block, for one chunk: X, K, g [C, D], C a multiple of s; j < i."""
    C = g.shape[0]
    L = g.reshape(C // s, s, -1).cumsum(1)  # L_i: the gate sum inside each sub-chunk
    r = torch.cat([torch.zeros_like(L[:1, -1]), L[:-1, -1].cumsum(0)])  # r_a, [n, D]
    P = X.new_zeros(C, C)
    for a in range(C // s):
        ia = slice(a * s, (a + 1) * s)  # the rows of sub-chunk a
        rows = X[ia] * torch.exp(L[a])  # x_i e^{L_i}: row factors, at most |x_i|
        for b in range(a + 1):
            jb = slice(b * s, (b + 1) * s)
            cols = K[jb] * torch.exp(r[a] - r[b] - L[b])  # column factors
            P[ia, jb] = rows @ cols.T  # one matrix product per block
    return P.tril(-1)


A_sub = sub_chunk_scores(k32, k32, g_c.float())
n_sub, s_sub = C // kda.SUB_CHUNK, kda.SUB_CHUNK
L_lib = g_c.float().reshape(1, n_sub, s_sub, D_s).cumsum(2)
r_lib = torch.cat([torch.zeros_like(L_lib[:, :1, -1:]),
                   L_lib[:, :-1, -1:].cumsum(1)], dim=1)
X_lib = k32.reshape(1, n_sub, s_sub, D_s)
A_pair = kda.pair_scores(X_lib, X_lib, L_lib, r_lib, strict=True)[0]
print(f"sub-chunks, float32: finite {bool(torch.isfinite(A_sub).all())}, "
      f"max |Ω^kk - exact| = {max_diff(A_sub, A_exact):.1e} "
      f"(entries up to {A_exact.abs().max():.2f}); "
      f"against kda.pair_scores: {max_diff(A_sub, A_pair):.1e}")

# %% [markdown]
# **The gate decides what the kernel may assume.** The factorisation inside a diagonal block needs
# $e^{-L_j}$ finite, so the gates' sum over one sub-chunk must stay above about $-88$. Kimi Linear
# parametrises its gate as Gated DeltaNet does, $g = -e^{A_{\log}}\operatorname{softplus}(x +
# \Delta_{\text{bias}})$ (`tinyk3.gates.softplus_gate`): always negative, unbounded below. Kimi K3
# (its released config) uses $g = -5\,\sigma\big(e^{A_{\log}}(x + \Delta_{\text{bias}})\big)$
# (`tinyk3.gates.lower_bound_gate`): inside $(-5, 0)$ whatever $x$ is; fla's KDA kernel takes that
# bound as the licence for its tensor-core path (`safe_gate`, which "requires `lower_bound`").
# Each at its initialisation in fla and in this course's `KimiDeltaAttention`: $\Delta t$
# log-uniform in $[10^{-3}, 10^{-1}]$ for both, $A$ uniform in $(1, 16)$ for the softplus gate,
# $A_{\log} = 0$ ($A = 1$) for the lower-bound gate (fla's `safe_gate` layer starts there); for
# pre-activations from small to large:

# %%
gen = torch.Generator().manual_seed(11)
H_g, Dk_g = 32, 128
A_logs = {"softplus": gates.init_A_log(H_g, low=1.0, high=16.0, generator=gen),
          "lower bound": torch.zeros(H_g)}
dt_bias = gates.init_dt_bias(H_g, Dk_g, generator=gen)
print(f"{'x ~ N(0, σ²)':>13s} {'gate':>12s} {'min g':>9s} {'share g < -5':>13s} "
      f"{'worst exp(-Σg), 16 tokens':>26s}")
for sigma in (1.0, 4.0, 16.0):
    x = sigma * torch.randn(1, H_g, 256, Dk_g, generator=gen)
    for name, gate in (("softplus", gates.softplus_gate),
                       ("lower bound", gates.lower_bound_gate)):
        gx = gate(x, A_logs[name], dt_bias)
        worst = (-gx).reshape(1, H_g, 16, 16, Dk_g).sum(3).max()  # a 16-token sub-chunk
        share = (gx < -5).float().mean()
        print(f"{sigma:13.0f} {name:>12s} {gx.min():9.2f} {share:13.1%} "
              f"{torch.exp(worst).item():26.2e}")
print(f"the strongest decay the bound allows, per token: e^-5 = {math.exp(-5):.4f}; "
      f"after 3 tokens {math.exp(-15):.1e}")

# %% [markdown]
# With unit pre-activations the softplus gate already passes $-5$ now and then (the
# share column), and its worst factor over a 16-token sub-chunk (the last column) is still finite
# but already larger than the lower-bound gate's at any $\sigma$ in the table; with the larger
# pre-activations training can produce, it is `inf`: a channel erased in one token, and no
# factorised kernel safe. The lower-bound gate stays below $e^{80}$ whatever $x$ is. It costs
# little in expressiveness (a channel still falls to the fraction on the last line within
# three tokens) and buys the guarantee that every 16-token sub-chunk factorises in float32.
#
# **Error against chunk size and gate strength.** The whole chunked form in float32, two ways:
# *naive*, `kda_chunk_step` above with every $e^{G_i - G_j}$ computed as $e^{G_i} \cdot e^{-G_j}$
# (for $\Omega^{kk}$, $\Omega$ and the state-pass keys), and *stable*, `kda.chunked`. Gates
# $g = -s\,\sigma(x)$ for lower bounds $s$ from mild to beyond K3's 5, at $C = 16, 32, 64$, against
# the float64 token loop (relative error of the outputs; a cross at the top marks a non-finite
# result):

# %%
def kda_chunk_step_naive(q_c, k_c, v_c, beta_c, g_c, S):
    """kda_chunk_step with every exp(G_i − G_j) factorised as exp(G_i) · exp(−G_j)."""
    G = g_c.cumsum(-2)
    up, down = torch.exp(G), torch.exp(-G)  # γ_i and 1/γ_i
    n = g_c.shape[-2]
    Okk = ((k_c * up) @ (k_c * down).mT).tril(-1)  # (K ⊙ Γ)(K ⊘ Γ)ᵀ
    Tc = torch.linalg.solve_triangular(
        torch.eye(n, dtype=Okk.dtype) + beta_c.unsqueeze(-1) * Okk,
        torch.diag_embed(beta_c), upper=False)
    W, U = Tc @ (k_c * up), Tc @ v_c
    U_new = U - W @ S
    Om = ((q_c * up) @ (k_c * down).mT).tril()  # (Q ⊙ Γ)(K ⊘ Γ)ᵀ
    o = (q_c * up) @ S + Om @ U_new
    gamma_C = up[:, :, -1:]
    return o, gamma_C.mT * S + (k_c * gamma_C * down).mT @ U_new


def chunked_naive(q, k, v, beta, g, C, S):
    outs = []
    for start in range(0, q.shape[2], C):
        sl = slice(start, start + C)
        o_c, S = kda_chunk_step_naive(*(x[:, :, sl] for x in (q, k, v, beta, g)), S)
        outs.append(o_c)
    return torch.cat(outs, dim=2), S


t0 = time.perf_counter()
sweep = {}  # (form, C) -> [relative error or inf, one per strength]
for s_ in STRENGTHS:
    ins = kda_inputs(1, 2, T_STRESS, 32, 16, seed=int(10 * s_), low=-s_)
    o64, _ = kda.recurrent(*ins)
    ins32 = [x.float() for x in ins]
    S32 = torch.zeros(1, 2, 32, 16)
    for C in (16, 32, 64):
        for form in ("naive", "stable"):
            with torch.no_grad():
                if form == "naive":
                    o32, _ = chunked_naive(*ins32, C, S32)
                else:
                    o32, _ = kda.chunked(*ins32, chunk_size=C)
            err = rel_err(o32, o64) if torch.isfinite(o32).all() else math.inf
            sweep.setdefault((form, C), []).append(err)
print(f"relative error of the float32 outputs, T = {T_STRESS} "
      f"({time.perf_counter() - t0:.0f} s):")
print(f"{'lower bound s':>22s} " + " ".join(f"{s_:>7g}" for s_ in STRENGTHS))
for (form, C), errs in sweep.items():
    print(f"{form:>13s}, C = {C:2d} " + " ".join(f"{e:7.0e}" for e in errs))

# %% mystnb={"figure": {"caption": "Relative error of KDA's chunked outputs in float32 against the float64 token loop, as a function of the gate's lower bound s (gates in (−s, 0)), for chunk sizes 16, 32 and 64: the naive factorisation (dashed) overflows, marked by crosses on the top line, once a chunk's gate sums pass float32's exponent range; the stable form with 16-token sub-chunks (solid) stays finite and accurate at every chunk size.", "name": "fig-kda-numerics"}, "image": {"alt": "Line plot with a logarithmic vertical axis of relative error against the gate's lower bound s from 0.25 to 8. Solid lines for the stable form at chunk sizes 16, 32 and 64 stay below 1e-5 across the whole range. Dashed lines for the naive form lie on or just above them at mild gates, then end in crosses at the top, labelled non-finite and stacked by chunk size: at C = 64 from a bound of 3, at C = 32 from 5, at C = 16 only at 8. A vertical dotted line marks Kimi K3's bound of 5."}}
fig, ax = plt.subplots(figsize=(6.8, 4.0))
top = 1.0  # where non-finite results are drawn
for i, C in enumerate((16, 32, 64)):
    for form, ls in (("stable", "-"), ("naive", "--")):
        errs = np.array(sweep[(form, C)])
        finite = np.isfinite(errs)
        ax.plot(np.array(STRENGTHS)[finite], errs[finite], ls, marker="o", ms=3,
                color=f"C{i}", label=f"{form}, C = {C}")
        ax.plot(np.array(STRENGTHS)[~finite], np.full((~finite).sum(), top * 2.0**i),
                "x", color=f"C{i}", ms=8)  # stacked by C, so none hides another
ax.axhline(top, color="k", lw=0.5)
ax.text(STRENGTHS[0], top * 1.4, "non-finite (inf or NaN), crosses", fontsize=8)
ax.axvline(5, color="k", ls=":", lw=1)
ax.text(5.1, 1e-3, "K3's bound", fontsize=8)
ax.set(xscale="log", yscale="log", xlabel="gate lower bound s (gates in (−s, 0))",
       ylabel="relative error, float32", ylim=(1e-8, 10),
       title="Chunked KDA in float32 against the float64 loop")
ax.set_xticks(STRENGTHS, [f"{s_:g}" for s_ in STRENGTHS])
ax.minorticks_off()
ax.legend(fontsize=7, ncol=2, loc="center left")
plt.tight_layout()
plt.show()

# %% [markdown]
# The naive form is about as accurate as the stable one (the same to the digit printed at
# $C = 16$, at most a few times less accurate at $C = 64$) until it is not at all: the
# factorised exponentials lose little while they are representable, and then a chunk's gate sum
# passes float32's range and the output is `inf` or `NaN`. Where that happens depends on the chunk
# size, because the sum grows with $C$ (the table above): at $C = 64$ already at moderate bounds,
# at $C = 32$ within Kimi K3's bound of 5, at $C = 16$ only beyond it, where $e^{-5 \cdot 16}$ no
# longer bounds a chunk. The stable form keeps each factorised exponent inside one 16-token
# sub-chunk, so its reach does not depend on $C$; its error changes little with $C$ (at most a
# few times larger at $C = 64$: longer sums per entry and longer triangular solves) and stays
# around one part in a million or below.
#
# **Below the bound.** Past $-5$ per token, a sub-chunk's gates can sum below $-80$
# (`kda.EXP_LIMIT`), and then even one sub-chunk's $e^{-L_j}$ is unsafe. `kda.chunked` checks
# for that and forms the diagonal blocks pair by pair instead (`exact_diagonal`, the slower path
# the softplus gate needs). One chunk of 64 as above, the forgetting half of the channels at a
# constant gate at, just past and beyond the limit (relative errors against float64):

# %%
ks64 = F.normalize(torch.randn(1, 4, 16, D_s, dtype=torch.float64), dim=-1)
print(f"{'g per token':>12s} {'sub-chunk sum':>14s} {'exact path':>11s} "
      f"{'factorised diag':>16s} {'pairwise diag':>14s}")
for g_val in (-5.0, -5.5, -6.0, -20.0):
    g_ = torch.full((1, 4, 16, D_s), g_val, dtype=torch.float64)
    g_[..., D_s // 2:] = -0.01  # as above: half the channels keep
    L_ = g_.cumsum(2)
    r_ = torch.cat([torch.zeros_like(L_[:, :1, -1:]), L_[:, :-1, -1:].cumsum(1)], dim=1)
    exact = pairwise_scores(ks64.reshape(64, D_s), ks64.reshape(64, D_s),
                            (r_ + L_).reshape(64, D_s), strict=True)
    errs = []
    for diag in (False, True):
        P = kda.pair_scores(ks64.float(), ks64.float(), L_.float(), r_.float(),
                            strict=True, exact_diagonal=diag)[0]
        finite = bool(torch.isfinite(P).all())
        errs.append(f"{rel_err(P, exact):.0e}" if finite else "non-finite")
    print(f"{g_val:12.1f} {16 * g_val:14.0f} {str(16 * g_val < -kda.EXP_LIMIT):>11s} "
          f"{errs[0]:>16s} {errs[1]:>14s}")

ins = kda_inputs(1, 2, 200, 16, 8, seed=5, low=-20.0)
o_ref, _ = kda.recurrent(*ins)
o32, _ = kda.chunked(*(x.float() for x in ins))
finite = bool(torch.isfinite(o32).all())
print(f"kda.chunked, float32, gates down to -20: finite {finite}, "
      f"relative error {rel_err(o32, o_ref):.1e}")

# %% [markdown]
# At $-5$ both ways of forming the diagonal blocks are accurate. At $-5.5$ (a sub-chunk sum of
# $-88$) the factorised form still holds, with nothing to spare: $e^{88}$ is within a factor of
# two of float32's largest number, and $e^{-88}$ is already below its smallest normal one. At $-6$
# it is non-finite. The lib's `EXP_LIMIT` of 80 switches to the pairwise diagonal before that
# edge (the third column), and the pairwise form is accurate at every strength.

# %% [markdown]
# ## Check: `kda.chunked` against the token loop
#
# **float64.** Chunk sizes from 1 to beyond $T$, sizes that do not divide $T$, $D_k \ne D_v$, a
# random initial state, gates down to $-5$; the largest distance over the chunk sizes:

# %%
q, k, v, beta, g = kda_inputs(2, 2, 100, 16, 12, seed=1)
S0 = torch.randn(2, 2, 16, 12, dtype=torch.float64)
o_ref, S_ref = kda.recurrent(q, k, v, beta, g, initial_state=S0)
chunk_sizes = (1, 3, 16, 32, 33, 64, 100, 128)
short = [c for c in chunk_sizes if 100 % c and c < 100]
runs = [kda.chunked(q, k, v, beta, g, chunk_size=c, initial_state=S0)
        for c in chunk_sizes]
print(f"T = 100, C in {chunk_sizes} (a short last chunk for {short}): "
      f"max |o - recurrent| = {max(max_diff(o, o_ref) for o, _ in runs):.1e}, "
      f"max |S_T - recurrent| = {max(max_diff(S, S_ref) for _, S in runs):.1e}")

# %% [markdown]
# Round-off, far below the $10^{-10}$ the contract asks for.
#
# **float32, long sequences.** $T = 8192$ tokens, two heads of $D = 64$, gates down to $-5$ as
# above, the chunked form at the three contract chunk sizes and the token loop in float32, against
# the token loop in float64 (the cell prints its time):

# %%
t0 = time.perf_counter()
q, k, v, beta, g = kda_inputs(1, 2, T_LONG, 64, 64, seed=8192)
S0 = 0.1 * torch.randn(1, 2, 64, 64, dtype=torch.float64)
with torch.no_grad():
    o64, S64 = kda.recurrent(q, k, v, beta, g, initial_state=S0)
    f32_ins = [x.float() for x in (q, k, v, beta, g)]
    long_runs = {"token loop": kda.recurrent(*f32_ins, initial_state=S0.float())}
    for C in (16, 32, 64):
        long_runs[f"chunked C = {C}"] = kda.chunked(*f32_ins, chunk_size=C,
                                                    initial_state=S0.float())
LONG_BOUND = 1e-5  # the stated bound on the relative error of o and S_T
print(f"T = {T_LONG}, float32 against the float64 loop (outputs up to "
      f"{o64.abs().max():.1f}); stated bound {LONG_BOUND:.0e} relative:")
for name, (o32, S32) in long_runs.items():
    e_o, e_S = rel_err(o32, o64), rel_err(S32, S64)
    print(f"  {name:>16s}: finite {bool(torch.isfinite(o32).all())}, relative error "
          f"o {e_o:.1e}, S_T {e_S:.1e}, within the bound: "
          f"{e_o < LONG_BOUND and e_S < LONG_BOUND}")
print(f"({time.perf_counter() - t0:.0f} s)")

# %% [markdown]
# The chunked form's float32 error is a little above the token loop's and largest at $C = 64$
# (longer triangular solves and longer sums per entry), but it stays within the stated bound at
# every chunk size of the contract; the decay keeps the state bounded, so nothing accumulates
# along the sequence. `tests/test_gated_ops.py` asserts the same float32 bound (at a smaller head
# size), the reductions, and `gradcheck` of both forms; here a small `gradcheck`
# with respect to all six inputs, with a short last chunk:

# %%
S_tiny = torch.randn(1, 1, 3, 2, dtype=torch.float64)
ins = [x.clone().requires_grad_() for x in (*kda_inputs(1, 1, 7, 3, 2, seed=3), S_tiny)]
ok = torch.autograd.gradcheck(
    lambda q, k, v, b, g, S: kda.chunked(q, k, v, b, g, chunk_size=3, initial_state=S),
    ins, eps=1e-6, atol=1e-7)
print(f"gradcheck, T = 7, C = 3, inputs q, k, v, β, g, S_0: "
      f"{'passed' if ok else 'FAILED'}")
grads = {}  # the chunked form's gradients against the token loop's, same loss
forms = {"chunked": partial(kda.chunked, chunk_size=3), "loop": kda.recurrent}
for form, fn in forms.items():
    o_, S_ = fn(*ins[:5], initial_state=ins[5])
    grads[form] = torch.autograd.grad((o_ * o_).sum() + (S_ * S_).sum(), ins)
print("max |grad chunked - grad loop| for q, k, v, β, g, S_0: "
      + ", ".join(f"{max_diff(a, b):.0e}" for a, b in zip(*grads.values())))

# %% [markdown]
# ## Experiment: two time scales in one head
#
# Does a gate per channel buy anything a gate per head cannot? A task that needs two memories
# with different lifetimes, in one head with $D_k = 32$, $D_v = 16$:
#
# - **long-lived facts**: 16 key-value pairs written at the start, keys orthonormal within key
#   channels 0-15, recalled once, after the whole stream;
# - **short-lived facts**: a stream of key-value pairs with random unit keys in channels 16-31,
#   far more than 16 channels can hold; each is recalled once, 1 to 4 tokens after it was written
#   (the query at token $t$ is the key of token $t - \ell_t$, while token $t$ writes its own pair).
#
# Values are random unit vectors and $\beta = 1$; the error of a recall is
# $\lVert o - v \rVert^2$ (1 means nothing recalled). Training-free: Gated DeltaNet gets one gate
# for the head, swept; KDA gets gates set by hand per channel, $g = 0$ on the long channels (keep
# forever) and a swept $g$ on the short ones. Why would the short memory want to forget at all?
# The delta rule replaces what a key reads, but a later key that overlaps it reads a mixture of
# everything older still in the state; decaying the old content shrinks that mixture.

# %%
def two_scale_task(B, n_stream, seed, n_long=16, Dk=32, Dv=16, max_lag=4):
    """q, k, v [B, 1, T, D] (T = n_long + n_stream), where each query reads from
    (src) and at which token (at), and the number of long facts (and long channels)."""
    gen = torch.Generator().manual_seed(seed)
    T = n_long + n_stream
    k = torch.zeros(B, T, Dk, dtype=torch.float64)
    k[:, :n_long, :n_long] = orthonormal_keys(n_long, n_long, batch=B, generator=gen,
                                              dtype=torch.float64)
    stream = torch.randn(B, n_stream, Dk - n_long, generator=gen, dtype=torch.float64)
    k[:, n_long:, n_long:] = F.normalize(stream, dim=-1)
    v = F.normalize(torch.randn(B, T, Dv, generator=gen, dtype=torch.float64), dim=-1)
    lag = torch.randint(1, max_lag + 1, (n_stream,), generator=gen)
    t = torch.arange(n_stream)
    src = n_long + (t - lag).clamp_min(0)  # the token whose key is asked for
    q = torch.zeros_like(k)
    q[:, n_long:] = k[:, src]
    asked = t >= lag  # queries that reach back into the stream
    return [x.unsqueeze(1) for x in (q, k, v)], src[asked], n_long + t[asked], n_long


def recall_errors(o, S, q, k, v, src, at, n_long):
    """Mean squared recall errors: the long facts (read from S_T), the stream's."""
    o_long = torch.einsum("bnk,bkv->bnv", k[:, 0, :n_long], S[:, 0])
    e_long = (o_long - v[:, 0, :n_long]).square().sum(-1).mean().item()
    e_short = (o[:, 0, at] - v[:, 0, src]).square().sum(-1).mean().item()
    return e_long, e_short


(q, k, v), src, at, n_long = two_scale_task(B_EXP, T_EXP, seed=0)
T_all = q.shape[2]
beta1 = torch.ones(B_EXP, 1, T_all, dtype=torch.float64)
G_SWEEP = [0.0, -1e-4, -3e-4, -1e-3, -3e-3, -0.01, -0.03, -0.1, -0.3, -1.0]
t0 = time.perf_counter()
results = {"GDN": [], "KDA": []}
with torch.no_grad():
    for g_val in G_SWEEP:
        g_gdn = torch.full((B_EXP, 1, T_all), g_val, dtype=torch.float64)
        o, S = gated_delta_rule.chunked(q, k, v, beta1, g_gdn)
        results["GDN"].append(recall_errors(o, S, q, k, v, src, at, n_long))
        g_kda = torch.zeros(B_EXP, 1, T_all, 32, dtype=torch.float64)
        g_kda[..., n_long:] = g_val  # forget only in the short channels
        o, S = kda.chunked(q, k, v, beta1, g_kda)
        results["KDA"].append(recall_errors(o, S, q, k, v, src, at, n_long))
    # control: Gated DeltaNet with the state split into two heads, one gate each
    g_two = torch.zeros(B_EXP, 2, T_all, dtype=torch.float64)
    g_two[:, 1] = -0.03
    halves = [torch.cat([x[..., :n_long], x[..., n_long:]], dim=1) for x in (q, k)]
    o2, S2 = gated_delta_rule.chunked(*halves, v.expand(-1, 2, -1, -1).contiguous(),
                                      beta1.expand(-1, 2, -1).contiguous(), g_two)
    g_kda[..., n_long:] = -0.03
    o1, S1 = kda.chunked(q, k, v, beta1, g_kda)
    # control: the same facts, keys and queries rotated by a random orthogonal
    # matrix (the same information, each lifetime spread over every channel),
    # the same per-channel gates
    R = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(7),
                                    dtype=torch.float64)).Q
    q_rot, k_rot = q @ R, k @ R
    o_rot, S_rot = kda.chunked(q_rot, k_rot, v, beta1, g_kda)
print(f"{B_EXP} sequences of {n_long} long-lived facts and {T_EXP} streamed ones "
      f"({time.perf_counter() - t0:.0f} s); mean squared recall error:")
print(f"{'g':>8s} {'GDN long':>9s} {'GDN short':>10s} {'GDN mean':>9s}   "
      f"{'KDA long':>9s} {'KDA short':>10s} {'KDA mean':>9s}")
for g_val, (gl, gs_), (kl, ks_) in zip(G_SWEEP, results["GDN"], results["KDA"]):
    print(f"{g_val:8.0e} {gl:9.3f} {gs_:10.3f} {(gl + gs_) / 2:9.3f}   "
          f"{kl:9.3f} {ks_:10.3f} {(kl + ks_) / 2:9.3f}")
mean = {m: [(a + b) / 2 for a, b in results[m]] for m in results}
best = {m: int(np.argmin(mean[m])) for m in results}
for m in results:
    i = best[m]
    print(f"best {m}: g = {G_SWEEP[i]:g} on the {'short' if m == 'KDA' else 'whole'} "
          f"channels, long {results[m][i][0]:.3f}, short {results[m][i][1]:.3f}, "
          f"mean {mean[m][i]:.3f}")
print(f"short-fact error, best KDA / best GDN: "
      f"{results['KDA'][best['KDA']][1] / results['GDN'][best['GDN']][1]:.2f}")
print(f"two GDN heads (g = 0 | g = -0.03 on the halves) vs KDA with the same gates: "
      f"max |o| diff {max_diff(o2.sum(1), o1[:, 0]):.1e}")
for name, (o_, S_, q_, k_) in {"channel-aligned": (o1, S1, q, k),
                               "rotated": (o_rot, S_rot, q_rot, k_rot)}.items():
    e_l, e_s = recall_errors(o_, S_, q_, k_, v, src, at, n_long)
    print(f"KDA, g = 0 | -0.03, keys {name:>15s}: long {e_l:.3f}, short {e_s:.3f}")

# %% mystnb={"figure": {"caption": "Mean squared recall error on the two-time-scale task against the gate g: Gated DeltaNet (one gate for the whole head) and KDA (g on the short channels only, no decay on the long ones), for the long-lived facts recalled at the end and the streamed facts recalled 1 to 4 tokens later.", "name": "fig-kda-two-time-scales"}, "image": {"alt": "Line plot of recall error against the magnitude of the gate on a logarithmic axis, with g = 0 drawn at the left edge. Gated DeltaNet's long-fact error is 0 at g = 0 and rises to 1 by g = −0.01. The short-fact errors of both models coincide: they fall slightly from g = 0 to a minimum near g = −0.03 and rise steeply for stronger gates. KDA's long-fact error stays at 0 for every gate."}}
fig, ax = plt.subplots(figsize=(6.8, 3.8))
x_pos = [1e-5] + [-g_val for g_val in G_SWEEP[1:]]  # g = 0 drawn at the left edge
for m, color in (("GDN", "C0"), ("KDA", "C1")):
    ax.plot(x_pos, [r[0] for r in results[m]], "s--", color=color,
            label=f"{m}, long facts")
    ax.plot(x_pos, [r[1] for r in results[m]], "o-", color=color, ms=4,
            label=f"{m}, short facts")
ax.set_xscale("log")
ax.set_xticks([1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1],
              ["0", "1e-4", "1e-3", "0.01", "0.1", "1"])
ax.set(xlabel="−g (GDN: every channel; KDA: the short channels)",
       ylabel="mean ‖o − v‖²", title="Two time scales in one head")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# What happened, from the table:
#
# - **Gated DeltaNet** has to choose. Any gate strong enough to help the short memory erases the
#   long facts: after the whole stream the head keeps $e^{g T}$ of them, and its best single gate
#   (the "best GDN" line) is the one that protects the long facts, at the price of the short
#   facts' error without forgetting.
# - **KDA** takes both: no decay on the long channels, the short channels' best gate on the
#   others. Its long-fact error stays at round-off for every gate, and its short-fact error is
#   the minimum of the swept curve. (The two short-fact columns are identical: with the keys in
#   separate channels, the short memory does not see the long one.)
# - **The size of the gain** is modest: the ratio printed above. The delta rule already replaces
#   what each key reads, so forgetting only trims the residue older writes leave in overlapping
#   directions; a gate strong enough to erase recent facts makes the short error worse again
#   (the right side of the plot).
# - **The first control** is exact: here the two kinds of facts use disjoint key channels, so the
#   state splits into two blocks, and two Gated DeltaNet heads of half the size, one gate each,
#   compute the same outputs as KDA (the "two GDN heads" line). On this task KDA is two small
#   heads in one.
# - **The second control** keeps the information and mixes the channels: every key and query
#   rotated by one random orthogonal matrix. The same per-channel gates now forget a share of
#   every fact, and the long facts are lost (the last two lines). A gate per channel helps only
#   when the keys put each lifetime in channels of its own. In a layer the keys are $x W_k$, so
#   the projection must learn that alignment, channel by channel, by gradient descent: the same
#   decision that assigning facts to heads makes, learned rather than fixed by the architecture.
#   Training $W_k$ together with the gates would be the full experiment; the next one trains the
#   gates alone.
#
# **Trained gates.** Would gradient descent find the split? The same task with the gates
# learned: one parameter per channel for KDA, one for the head for Gated DeltaNet,
# $g = -\operatorname{softplus}(\theta)$, trained with Adam on the mean of the two recall errors, a
# fresh batch of sequences every step (keys and values stay as above: only the forgetting is
# learned). Two initialisations, $g = -10^{-4}$ and $g = -0.01$ in every channel (both milder
# than most initial gates of the softplus form, chapter 10's histogram of half-lives). The cell
# prints its time.

# %%
def train_gates(rule, g_init, steps, batch=8, lr=0.1):
    """Learn g = −softplus(θ), θ [Dk] (KDA) or [1] (GDN); return g and the errors."""
    theta = torch.full((32,) if rule == "KDA" else (1,), math.log(math.expm1(-g_init)),
                       requires_grad=True)  # softplus(θ) = −g_init
    opt = torch.optim.Adam([theta], lr=lr)
    history = []
    for step in range(steps):
        (q, k, v), src, at, n_long = two_scale_task(batch, T_EXP, seed=1000 + step)
        q, k, v = q.float(), k.float(), v.float()
        T_ = q.shape[2]
        beta = torch.ones(batch, 1, T_)
        g = -F.softplus(theta)
        if rule == "KDA":
            o, S = kda.chunked(q, k, v, beta, g.expand(batch, 1, T_, 32).contiguous())
        else:
            o, S = gated_delta_rule.chunked(q, k, v, beta,
                                            g.expand(batch, 1, T_).contiguous())
        o_long = torch.einsum("bnk,bkv->bnv", k[:, 0, :n_long], S[:, 0])
        e_long = (o_long - v[:, 0, :n_long]).square().sum(-1).mean()
        e_short = (o[:, 0, at] - v[:, 0, src]).square().sum(-1).mean()
        opt.zero_grad()
        ((e_long + e_short) / 2).backward()
        opt.step()
        history.append((e_long.item(), e_short.item()))
    return -F.softplus(theta).detach(), history


t0 = time.perf_counter()
trained = {(rule, g0): train_gates(rule, g0, TRAIN_STEPS)
           for rule in ("GDN", "KDA") for g0 in (-1e-4, -0.01)}
print(f"{TRAIN_STEPS} steps each ({time.perf_counter() - t0:.0f} s); errors averaged "
      f"over the last {TRAIN_STEPS // 5} steps:")
for (rule, g0), (g_learned, hist) in trained.items():
    last = np.array(hist[-(TRAIN_STEPS // 5):]).mean(0)
    gates_txt = (f"g = {g_learned.item():.1e}" if rule == "GDN" else
                 f"g long channels {g_learned[:n_long].mean():.1e}, "
                 f"short {g_learned[n_long:].mean():.1e}")
    print(f"  {rule} from g = {g0:g}: long {last[0]:.3f}, short {last[1]:.3f}, "
          f"mean {last.mean():.3f}; learned {gates_txt}")

# %% mystnb={"figure": {"caption": "Left: mean recall error during training of the gates, for Gated DeltaNet (one gate) and KDA (a gate per channel) from two initial gates. Right: the gates KDA learned, channel by channel.", "name": "fig-kda-trained-gates"}, "image": {"alt": "Two panels. Left: mean recall error against the training step for four runs. Both KDA runs fall to about 0.12. Gated DeltaNet started at g = -1e-4 stays near 0.145; started at g = -0.01 it stays near 0.62, because its long facts are lost. Right: the learned KDA gates on a logarithmic axis of -g against the channel index: channels 0 to 15 learn gates of magnitude 1e-4 or less, channels 16 to 31 about 0.04, for both initialisations."}}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.8, 3.2))
styles = {("GDN", -1e-4): ("C0", "-"), ("GDN", -0.01): ("C0", "--"),
          ("KDA", -1e-4): ("C1", "-"), ("KDA", -0.01): ("C1", "--")}
for (rule, g0), (g_learned, hist) in trained.items():
    color, ls = styles[(rule, g0)]
    ax1.plot(np.array(hist).mean(1), ls, color=color, label=f"{rule}, from {g0:g}")
    if rule == "KDA":
        ax2.plot(-g_learned.numpy(), ls, marker=".", color=color, label=f"from {g0:g}")
ax1.set(xlabel="training step", ylabel="mean ‖o − v‖²", ylim=(0, 1))
ax1.legend(fontsize=7)
ax2.axvline(n_long - 0.5, color="k", lw=0.5)
ax2.set(yscale="log", xlabel="key channel", ylabel="learned −g", title="KDA's gates")
ax2.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# KDA learns the split from both starts: gates near 0 on the long channels and near the
# hand-set optimum on the short ones, reaching about the best mean error of the hand-set sweep
# (the "best KDA" line of the earlier table). Gated DeltaNet ends where it starts from: from the mild gate it keeps the long facts and never forgets; from
# the stronger one it descends into the short memory's optimum and loses the long facts for good,
# because once $e^{gT}$ is near 0 the gradient that could bring them back is near 0 too. With one
# gate, the two time scales are two separate optima and the initialisation chooses between them;
# with a gate per channel there is one optimum that serves both.

# %% [markdown]
# ## Exercises
#
# ```{exercise} One step of Kimi Delta Attention
# :label: ex-kda-step
#
# Write `kda_step(S, k, v, beta, g)`: one token of KDA, forget before error. Inputs
# `S [B, H, Dk, Dv]`, `k [B, H, Dk]`, `v [B, H, Dv]`, `beta [B, H]` and the per-channel log decay
# `g [B, H, Dk]` (`g ≤ 0`); return the new state `[B, H, Dk, Dv]`,
# $S' = \operatorname{Diag}(e^{g}) S$, $S + k^\top \beta (v - k S')$ with $S$ replaced by $S'$.
# ```

# %%
def kda_step_mine(S, k, v, beta, g):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kda.step", kda_step_mine)

# %% [markdown]
# ```{solution-start} ex-kda-step
# :class: dropdown
# ```

# %%
def kda_step_solution(S, k, v, beta, g):
    S = torch.exp(g).unsqueeze(-1) * S  # Diag(α) S: row d (key channel d) times α_d
    v_old = torch.einsum("bhk,bhkv->bhv", k, S)  # k S'
    u = beta.unsqueeze(-1) * (v - v_old)  # β (v − k S')
    return S + k.unsqueeze(-1) * u.unsqueeze(-2)  # S' + kᵀ u


ok = checks.run("kda.step", kda_step_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The decayed key scores of one chunk
# :label: ex-kda-chunk-scores
#
# Write `chunk_scores(k, g)`: for one chunk, `k, g [B, H, C, Dk]`, return
# $\Omega^{kk}_{ij} = \sum_d k_{id} k_{jd}\, e^{G_{id} - G_{jd}}$ for $j < i$ and 0 on and above the diagonal,
# `[B, H, C, C]`, with $G_i = \sum_{s \le i} g_s$ per channel. It must be finite and accurate in
# float32 for $C$ up to 64 and gates down to $-5$ (the checker's cases go there), and keep the
# dtype. Any correct method passes: pair by pair, or sub-chunks as `kda.pair_scores` does.
# ```

# %%
def chunk_scores_mine(k, g):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kda.chunk_scores", chunk_scores_mine)

# %% [markdown]
# ```{solution-start} ex-kda-chunk-scores
# :class: dropdown
# ```

# %%
def chunk_scores_solution(k, g):
    G = g.cumsum(-2)  # G_i, per channel                          [B, H, C, Dk]
    C = G.shape[-2]
    i = torch.arange(C)
    below = (i[:, None] > i[None, :])[..., None]  # j < i         [C, C, 1]
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # G_i − G_j          [B, H, C, C, Dk]
    # −inf where j ≥ i BEFORE exp: there G_i − G_j ≥ 0 and exp may overflow
    decay = torch.exp(torch.where(below, diff, torch.full_like(diff, -math.inf)))
    return torch.einsum("bhid,bhjd,bhijd->bhij", k, k, decay)


ok = checks.run("kda.chunk_scores", chunk_scores_solution)

# %% [markdown]
# The naive `(k * exp(G)) @ (k * exp(-G)).mT` passes the cases with $C \le 16$, and the checker
# reports NaN at $C \ge 32$ with gates near $-5$ in float32: this chapter's numerics section in
# one line.
#
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - KDA is Gated DeltaNet with a forget gate per key channel,
#   $S_t = (I - \beta_t k_t^\top k_t)\operatorname{Diag}(\alpha_t) S_{t-1} + \beta_t k_t^\top v_t$;
#   equal gates give Gated DeltaNet, zero gates DeltaNet.
# - Its transition is diagonal plus rank one with both vectors made from the key: against general
#   DPLR that saves two of four score matrices and five of 13 products per chunk, so the chunk
#   form costs what chunked DeltaNet costs.
# - The chunk form undoes the decay: read keys $k \odot \gamma$, write keys $k \oslash \gamma$.
#   Unlike chapter 10's, the decayed scores are no rescaling of $KK^\top$ and must be formed.
# - Formed naively they overflow float32 once a chunk's gate sum passes about $-88$; 16-token
#   sub-chunks with reference points keep every factor bounded, and K3's lower-bound gate
#   guarantees the bound.
# - `kda.chunked` equals the token loop to float64 round-off and stays within the stated bound in
#   float32 at $T = 8192$.
# - Per-channel gates keep long and short facts apart only when the keys put each lifetime in
#   channels of its own: with the channels mixed, the same gates lose the long facts. Learned
#   gates found the split.

# %% [markdown]
# ## Optional: what the gate changes in the kernel
#
# This section reads the gated Triton kernels against chapter 9's; nothing before it depends on
# it, and a reader who skipped chapter 9 can stop at the summary.
#
# Chapter 9 wrote chunkwise DeltaNet as three Triton stages: the WY factors of every chunk in
# parallel, the one sequential pass over chunks that carries the state, and the outputs of every
# chunk in parallel again. The gated rules keep that split. `tinyk3.kernels.gated` holds gated
# copies of the three kernels, shared by both rules: a compile-time constant `GATE` selects one
# gate per head (`1`, Gated DeltaNet, chapter 10) or one per key channel (`2`, KDA), so Triton
# compiles a separate kernel for each and the `if GATE == …` branches cost nothing when it runs.
# `tinyk3.kernels.gated_delta_rule.chunked` and `tinyk3.kernels.kda.chunked` have the signatures
# of the ops. Below, each stage as a diff against chapter 9's source: lines with `-` are chapter
# 9's, lines with `+` the gated kernel's, everything else is unchanged.
#
# Two things set these kernels apart from fla's `chunk_kda`, and both are choices of simplicity
# over speed. **The sub-chunk scores**: KDA's gated $KK^\top$ and $QK^\top$ are formed with one
# full $C \times C$ `tl.dot` per reference point, the rows of the other sub-chunks zeroed, so
# $C/16$ full products where fla forms $16 \times 16$ blocks (`fla/ops/kda/chunk_intra.py`): at
# $C = 64$ these two products cost 4 times chapter 9's, so "the decay adds only elementwise
# exponentials", true of the counted form above, is not true of these kernels. **The operand
# precision**: in the production mode every `tl.dot` takes bfloat16 operands with float32
# accumulation, where fla's forward forms the sub-chunk scores from float32 tiles with TF32
# products. Neither has been timed on a GPU yet (`tools/gpu_check_kernels.py` holds the check).

# %%
import difflib
import inspect

import tinyk3.kernels as kernels
from tinyk3.kernels import delta_rule as kernel9
from tinyk3.kernels import gated as kernel_gated


def kernel_diff(name):
    """The unified diff of one stage's source, chapter 9 against the gated kernel."""
    old = inspect.getsource(getattr(kernel9, name)).splitlines()
    new = inspect.getsource(getattr(kernel_gated, name)).splitlines()
    lines = list(difflib.unified_diff(old, new, f"chapter 9 {name}", f"gated {name}",
                                      n=0, lineterm=""))
    body = [x for x in lines[2:] if not x.startswith("@@")]
    plus = sum(x.startswith("+") for x in body)
    minus = sum(x.startswith("-") for x in body)
    print(f"{name}: {len(new)} lines, {plus} added, {minus} removed "
          f"(chapter 9's: {len(old)} lines)")
    print("\n".join(body))


kernel_diff("_wy_kernel")

# %% [markdown]
# **Stage 1, the WY factors.** The triangular solve for $\mathcal{T}$ is untouched: the gate changes
# only the matrix it solves and the keys $W$ is made of. Gated DeltaNet forms $K K^\top$ as before
# and multiplies it by $\Gamma$, with the exponent set to $-\infty$ above the diagonal before the
# `exp` (chapter 10's `decay_mask`); then $W = \mathcal{T} \operatorname{diag}(\gamma) K$. KDA
# cannot multiply afterwards, because its decay sits inside the sum over channels: for each
# reference point $r_a$ the kernel multiplies the rows of sub-chunk $a$, scaled by $e^{L_i}$,
# with the columns of sub-chunks $b \le a$, scaled by $e^{r_a - r_b - L_j}$, and adds the
# products: `pair_scores` above, as `tl.dot`s. The gates of each chunk are summed inside the
# kernel (`tl.associative_scan`), so only $g$ itself is read from memory.

# %%
kernel_diff("_state_kernel")

# %% [markdown]
# **Stage 2, the state pass.** The sequential loop gains two decays per chunk: the state is
# multiplied by $\gamma_C$ (a scalar per head, or one factor per row of $S$ for KDA), and each
# key by $e^{G_C - G_i} = e^{\sum_{s > i} g_s}$ before $K^\top U'$ writes it into the state. That
# sum is taken as a reverse scan of the gates loaded one token later, so it holds only its own
# terms and never subtracts two large sums. Most of the lines removed are chapter 9's
# `FUSE_OUTPUT` option (the output computed inside this loop), which the gated kernels do not
# carry: their output always has its own parallel pass, as in fla. The others come back as
# gated lines (the keys, for one, are now loaded in float32 and decayed before rounding).

# %%
kernel_diff("_output_kernel")

# %% [markdown]
# **Stage 3, the outputs.** $O_{[c]} = (Q \odot \Gamma) S_{[c]} + \Omega U'$: the queries meet
# the chunk's starting state decayed by $\gamma_i$, and the intra-chunk scores are the decayed
# ones, formed exactly as in stage 1 (after the product for Gated DeltaNet, sub-chunk by
# sub-chunk for KDA).
#
# The kernels run on CPU tensors under the Triton interpreter, a real launch of the same code.
# Against the float64 token loops, at a length that is not a multiple of the chunk, $D_k \ne D_v$,
# a non-zero initial state, in the exact float32 mode and in the bf16-operand mode production
# kernels use, and for KDA once more with the gate-stress inputs of the numerics section (gates
# down to $-5$, a whole chunk at the bound):

# %%
def kernel_check(kernel, op, q, k, v, beta, g, S0, C, operands):
    """Relative max error of a kernel's o and S against the op's float64 token loop."""
    o_ref, S_ref = op.recurrent(q, k, v, beta, g, initial_state=S0)
    args = (t.float() for t in (q, k, v, beta, g))
    o, S = kernel(*args, chunk_size=C, initial_state=S0.float(), operands=operands)
    scale_o = max(1.0, o_ref.abs().max().item())
    scale_S = max(1.0, S_ref.abs().max().item())
    return max_diff(o, o_ref) / scale_o, max_diff(S, S_ref) / scale_S


if not kernels.AVAILABLE:
    print(f"Triton is not installed here ({kernels.REASON}): the kernels cannot run.")
else:
    from tinyk3.kernels import gated_delta_rule as kernel_gdn
    from tinyk3.kernels import kda as kernel_kda

    F64 = torch.float64
    gen = torch.Generator().manual_seed(11)
    B, H, T, Dk, Dv = 1, 2, 45 if SMOKE else 77, 24, 16
    q = torch.randn(B, H, T, Dk, generator=gen, dtype=F64)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=F64)
    beta = torch.rand(B, H, T, generator=gen, dtype=F64)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=F64)
    g_head = -torch.rand(B, H, T, generator=gen, dtype=F64)
    g_chan = -torch.rand(B, H, T, Dk, generator=gen, dtype=F64)
    g_stress = -5 * torch.rand(B, H, T, Dk, generator=gen, dtype=F64)
    g_stress[..., : Dk // 4] = -1e-3  # long-lived channels beside ...
    g_stress[..., Dk // 4: Dk // 2] = -5.0  # ... channels at the bound
    g_stress[:, :, 16:32] = -5.0  # a whole chunk of 16 at the bound
    cases = [("gated_delta_rule", kernel_gdn.chunked, gated_delta_rule, g_head),
             ("kda", kernel_kda.chunked, kda, g_chan),
             ("kda, gate stress", kernel_kda.chunked, kda, g_stress)]
    for name, kernel, op, g_ in cases:
        for C in (16, 32):
            for operands in ("float32", "bfloat16"):
                err_o, err_S = kernel_check(kernel, op, q, k, v, beta, g_, S0, C,
                                            operands)
                print(f"{name:>17s}  C={C}  {operands:>8s} operands: "
                      f"o {err_o:.1e}, S_T {err_S:.1e} (relative)")

# %% [markdown]
# The float32 mode agrees with the float64 loop to float32 round-off in every case; the bf16
# mode, which rounds every operand of a matrix product to bfloat16 (8 significant bits) and
# stores $W$, $U$, the chunk states and $U'$ in bfloat16, is off by what that rounding costs
# (the tests bound it by $1.5 \times 10^{-2}$). The stress case is about as accurate as the mild one:
# the sub-chunk factors never leave float32's range. Gates whose 16-token sum falls below
# $-80$ (possible only below $-5$ per step) are refused by the KDA kernel with a message, since
# its diagonal blocks are always factorised; the op's exact pairwise path handles them:

# %%
if kernels.AVAILABLE:
    g_bad = torch.full((1, 1, 32, 8), -6.0)  # 16 × −6 = −96 < −80
    x = torch.randn(1, 1, 32, 8)
    try:
        kernel_kda.chunked(x, F.normalize(x, dim=-1), x, torch.rand(1, 1, 32), g_bad,
                           chunk_size=16)
    except ValueError as err:
        print(f"ValueError: {err}")

# %% [markdown]
# What the gate costs on a GPU shows before any GPU runs: compiling the kernels for an H100
# (sm_90) without one, and reading the registers each thread needs and whether any spill to
# local memory (chapter 9's `runtime.ptxas_report`), at the production shape C = 64,
# $D_k = D_v = 128$, bf16 inputs with bf16 operands, against chapter 9's kernel at the same shape:

# %%
reason = None if not kernels.AVAILABLE else kernel9.cannot_compile_reason()
if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    from tinyk3.kernels import runtime

    t0 = time.perf_counter()
    shape = dict(chunk_size=16 if SMOKE else 64, Dk=128, Dv=128, dtype=torch.bfloat16,
                 operands="bfloat16")
    builds = {"chapter 9": kernel9.compile_for_gpu(90, **shape),
              "gated_delta_rule": kernel_gdn.compile_for_gpu(90, **shape),
              "kda": kernel_kda.compile_for_gpu(90, **shape)}
    print(f"compiled for sm_90 in {time.perf_counter() - t0:.1f} s "
          f"(C = {shape['chunk_size']}, D = 128, bf16 operands)")
    print(f"{'stage':>15s}" + "".join(f"{name:>28s}" for name in builds))
    for stage in ("_wy_kernel", "_state_kernel", "_output_kernel"):
        cells = []
        for compiled in builds.values():
            rep = runtime.ptxas_report(compiled[stage].asm["ptx"])
            smem = compiled[stage].metadata.shared / 1024
            cells.append(f"{rep['registers']} reg, {rep['spill_stores']} B spill, "
                         f"{smem:.0f} KB")
        print(f"{stage:>15s}" + "".join(f"{c:>28s}" for c in cells))

# %% [markdown]
# Registers per thread, bytes spilled and shared memory per program, stage by stage
# (a thread has at most 255 registers; what does not fit spills to local memory, off the chip).
# The gates cost registers most in KDA's stages, whose gates are `[C, BK]` tiles, and in the state
# pass, which carries the state in registers and reaches the cap for both rules; Gated DeltaNet's
# gate, one number per token, adds fewer in stage 1 and none in stage 3 (the table). The launch
# configuration (`kernel_gated.launch_config`, chapter 9's with smaller tiles where ptxas reported
# spills for the gated stages) keeps the bf16 mode free of spills.
# `benchmarks/2026-12-02-ptxas-gated/` records the same for sm_80 and sm_90 in both operand modes.
# Timing needs a GPU: `tools/gpu_check_kernels.py` checks the compiled kernels against the float64
# loops and times them against fla's `chunk_gated_delta_rule` and `chunk_kda` (bf16, B = 4,
# H = 16, D = 128, T from 2048 to 16384).

# %% [markdown]
# **Next.** Chapter 12 builds the KDA layer around this operator: the projections, the short
# convolution, the gate, the output norm and gate, and decoding with a cached state.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
