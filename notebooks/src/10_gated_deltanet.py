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
# # Gated DeltaNet
#
# Part III's DeltaNet forgets only by overwriting: a fact leaves the state when another write
# lands on its key, and not otherwise. Everything it ever stored and never overwrote stays, and
# every later read picks up some of it. Mamba-2 has the opposite habit: a decay factor per token
# shrinks the whole state, so old facts fade on their own, but it writes additively and cannot
# replace one fact. Gated DeltaNet (Yang, Kautz and Hatamizadeh, *Gated Delta Networks: Improving
# Mamba2 with Delta Rule*, ICLR 2025) puts the two together: one decay factor
# $\alpha_t = e^{g_t} \in (0, 1]$ per token and head, applied to the state before the delta rule
# writes. It is the linear layer of Qwen3-Next, and with one decay per key channel instead of one
# per head it becomes Kimi's KDA (chapter 11).
#
# **In this chapter** you build the gated step and see why the decay comes before the error; derive
# the chunked form of chapter 8 with the decay mask $\Gamma$ and see that the gated WY factors are
# the plain ones rescaled, and why the code does not use that; build one gated chunk step, shown as
# a diff against chapter 8's; check `tinyk3.ops.gated_delta_rule.chunked` against the token loop in
# float64 and float32; measure an erratum in the paper's chunk formula; look at the decays real
# models start from; and measure when forgetting helps recall, with hand-set gates and with one
# trained gate.
#
# **Cost.** Under a minute on one CPU core (the last cell prints the time); `SMOKE = True` runs
# in a few seconds.

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

from tinyk3 import checks, gates
from tinyk3.memory import random_unit_keys
from tinyk3.ops import delta_rule, linear_attention
from tinyk3.ops import gated_delta_rule as gdr
from tinyk3.util import max_diff

T_LONG = 1024 if SMOKE else 8192  # sequence length of the float32 accuracy check
N_HEADS_INIT = 10_000 if SMOKE else 200_000  # heads drawn for the half-life histogram
TRIALS = 8 if SMOKE else 64  # independent memories in the recall experiment
N_SEGMENTS = 8 if SMOKE else 32  # segments of facts per sequence in the experiment
F64 = torch.float64


def gated_inputs(B, H, T, Dk, Dv, seed, *, g_low=-1.0, dtype=F64):
    """Unit q and k, standard normal v, β uniform in (0, 1), log decays g uniform in
    (g_low, 0), as Gated DeltaNet layers make them (the gate's form comes later)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=dtype)
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype)
    g = g_low * torch.rand(B, H, T, generator=gen, dtype=dtype)
    return q, k, v, beta, g


# %% [markdown]
# ## The idea: forget, then correct
#
# Chapter 5's delta rule reads what the state holds at the key, $k_t S_{t-1}$, and writes the
# correction $u_t = \beta_t (v_t - k_t S_{t-1})$. Gated DeltaNet first lets the whole state decay
# by $\alpha_t = e^{g_t}$, with $g_t \le 0$ the **log decay** a layer computes from the token, and
# then runs the delta rule on what is left:
#
# $$
# S'_t = \alpha_t S_{t-1}, \qquad
# u_t = \beta_t\,(v_t - k_t S'_t), \qquad
# S_t = S'_t + k_t^\top u_t, \qquad o_t = q_t S_t ,
# $$
#
# that is, $S_t = \alpha_t (I - \beta_t k_t^\top k_t)\, S_{t-1} + \beta_t k_t^\top v_t
# = \alpha_t F_t S_{t-1} + \beta_t k_t^\top v_t$: chapter 5's transition $F_t$ times a scalar.
# $g_t = 0$ is DeltaNet; a strongly negative $g_t$ empties the state before the token writes.
#
# One head, token by token, in front of you, against the lib's loop
# `tinyk3.ops.gated_delta_rule.recurrent` (which takes `beta` before `g`, as fla's token loop
# `naive_recurrent_gated_delta_rule` does; fla's `chunk_gated_delta_rule` takes `g` first):

# %%
def gated_loop(q, k, v, beta, g, S):
    """One head: q, k [T, Dk], v [T, Dv], beta, g [T], S [Dk, Dv]. Returns (o, S_T)."""
    outs = []
    for t in range(q.shape[0]):
        S = torch.exp(g[t]) * S  # forget: S' = α_t S_{t−1}
        u = beta[t] * (v[t] - k[t] @ S)  # the delta against what is left   [Dv]
        S = S + torch.outer(k[t], u)  # write: S_t = S' + k_tᵀ u_t   [Dk, Dv]
        outs.append(q[t] @ S)  # read: o_t = q_t S_t
    return torch.stack(outs), S


q, k, v, beta, g = gated_inputs(1, 1, 40, 8, 6, seed=0)
S0 = torch.randn(1, 1, 8, 6, dtype=F64)
o_mine, S_mine = gated_loop(q[0, 0], k[0, 0], v[0, 0], beta[0, 0], g[0, 0], S0[0, 0])
o_lib, S_lib = gdr.recurrent(q, k, v, beta, g, initial_state=S0)
print(f"my loop against gated_delta_rule.recurrent, 40 tokens: max |o| diff "
      f"{max_diff(o_mine, o_lib[0, 0]):.1e}, "
      f"max |S_T| diff {max_diff(S_mine, S_lib[0, 0]):.1e}")

# %% [markdown]
# **Why the decay comes first.** The other order is just as easy to write: compute the error from
# the undecayed state, $u_t = \beta_t (v_t - k_t S_{t-1})$, then $S_t = \alpha_t S_{t-1} +
# k_t^\top u_t$. Someone asked on fla's tracker whether the forget-before-error order of fla's
# reference loop was a bug (fla-org/flash-linear-attention issue 885); the maintainer answered
# that it is "actually the original Gated DeltaNet design, not a bug in the implementation",
# quoting the paper's rule $S_t = S_{t-1}\big(\alpha_t (I - \beta_t k_t k_t^\top)\big) + \beta_t
# v_t k_t^\top$ (the paper's column layout: our $S_t^\top$). The two orders differ in what a write
# achieves. Take a unit key that holds an old value, $k S = v_{\text{old}}$, and write a new one
# with $\beta = 1$ at $\alpha = \tfrac12$:

# %%
gen = torch.Generator().manual_seed(1)
k1 = F.normalize(torch.randn(8, generator=gen, dtype=F64), dim=0)
v_old, v_new = torch.randn(2, 6, generator=gen, dtype=F64)
S = torch.outer(k1, v_old)  # the state holds v_old at k1
alpha, b1 = 0.5, 1.0
# forget, then error; and error, then forget
S_first = alpha * S + torch.outer(k1, b1 * (v_new - k1 @ (alpha * S)))
S_other = alpha * S + torch.outer(k1, b1 * (v_new - k1 @ S))
print(f"forget before error: |k S_t - v_new| = {(k1 @ S_first - v_new).norm():.1e}")
print(f"error before forget: |k S_t - v_new| = {(k1 @ S_other - v_new).norm():.3f}, "
      f"|k S_t - (v_new - (1 - α) v_old)| = "
      f"{(k1 @ S_other - (v_new - (1 - alpha) * v_old)).norm():.1e}")

# %% [markdown]
# With the decay first, a full-strength write lands: reading the key gives $v_{\text{new}}$
# exactly. Chapter 5's view of a write as one gradient step says why. There the delta rule is a
# step of size $\beta_t$ on $\tfrac12\lVert k_t S - v_t\rVert^2$ from $S_{t-1}$; Gated DeltaNet
# first shrinks the weights, $S \to \alpha_t S_{t-1}$ (weight decay on the fast weights), and
# takes that step from the shrunk ones, so the error is measured against what the state holds
# after forgetting. The Kimi Linear report (§2.2) reads Gated DeltaNet, and KDA, this way.
# With the error first, the correction removes the whole old value although only
# $\alpha$ of it was left, so the read gives $v_{\text{new}} - (1 - \alpha) v_{\text{old}}$: the old
# value's share overshoots past zero. In matrix form its transition is $\alpha_t I - \beta_t
# k_t^\top k_t$, whose eigenvalue along a unit $k_t$ is $\alpha_t - \beta_t$, negative whenever
# $\beta_t > \alpha_t$. That other order is not a dead end: its scalar-plus-rank-one transition
# is Comba's (Hu et al. 2025, arXiv 2506.02475, which trains it with a chunkwise Triton kernel),
# and the Kimi Linear report's table of update rules (its Table 7) lists it with a parallel form. Its
# transition is not a scalar multiple of $F_t$, so the chunk form needs a different derivation
# from the one below, where the scalar decays factor out of a chunk's product of transitions.
# The choice between the orders is about what a write does, not about whether a chunk form
# exists. The first exercise asks for the step in Gated DeltaNet's order.

# %% [markdown]
# ## The chunk form, derived
#
# Take chapter 8's chunks and, inside chunk $c$, number its tokens $i = 1, \dots, C$. The decay
# from the chunk's start to its $i$-th token, and between two of its tokens, are
#
# $$
# \begin{gathered}
# G_i = \sum_{s \le i} g_s, \\
# \gamma_i = e^{G_i} = \alpha_1 \cdots \alpha_i, \\
# \Gamma_{ij} = \frac{\gamma_i}{\gamma_j} = e^{G_i - G_j} = \alpha_{j+1} \cdots \alpha_i \quad (j \le i), \\
# \Gamma_{ij} = 0 \quad (j > i).
# \end{gathered}
# $$
#
# $G_i$ is the **cumulative log decay**, $\gamma_i$ the **cumulative decay** and $\Gamma$ the
# **decay mask**: the binary causal mask $M$ of chapter 6 with each entry replaced by how much a
# write at token $j$ has faded by the time token $i$ reads. With $g = 0$, $\Gamma = M$.
#
# **The state inside a chunk.** Let token $t$ be the chunk's $i$-th and $u_t$ the delta it writes.
# Each write decays by the gates that come after it, so (by induction on $i$, using
# $\alpha_t \gamma_{i-1} = \gamma_i$ and $\alpha_t \Gamma_{i-1, j} = \Gamma_{ij}$)
#
# $$
# \alpha_t S_{t-1} = \gamma_i S_{[c]} + \sum_{j < i} \Gamma_{ij}\, k_j^\top u_j, \qquad
# S_t = \gamma_i S_{[c]} + \sum_{j \le i} \Gamma_{ij}\, k_j^\top u_j .
# $$
#
# **The outputs.** $o_t = q_t S_t = \gamma_i\, q_t S_{[c]} + \sum_{j \le i} \Gamma_{ij}
# (q_t \cdot k_j)\, u_j$; stacked over the chunk, with $U'_{[c]}$ the rows $u_j$,
#
# $$
# O_{[c]} = \operatorname{diag}(\gamma)\, Q_{[c]} S_{[c]} + \big(Q_{[c]} K_{[c]}^\top \odot
# \Gamma\big)\, U'_{[c]} .
# $$
#
# **The next state** is the last row's: $S_{[c+1]} = \gamma_C S_{[c]} + \sum_j
# \frac{\gamma_C}{\gamma_j} k_j^\top u_j = \gamma_C S_{[c]} + \big(\operatorname{diag}
# (\gamma_C / \gamma) K_{[c]}\big)^\top U'_{[c]}$.
#
# **The deltas.** $u_t = \beta_t (v_t - k_t\, \alpha_t S_{t-1})$, and with the first identity
#
# $$
# u_t + \beta_t \sum_{j < i} \Gamma_{ij} (k_t \cdot k_j)\, u_j = \beta_t\,(v_t - \gamma_i\, k_t
# S_{[c]}) ,
# $$
#
# a unit lower-triangular system, chapter 7's with $K K^\top \odot \Gamma$ where $K K^\top$ was:
#
# $$
# \begin{gathered}
# \mathcal{T}_\Gamma = \big(I + \operatorname{tril}(\operatorname{diag}(\beta)(K K^\top \odot \Gamma), -1)\big)^{-1} \operatorname{diag}(\beta), \\
# U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}, \quad U = \mathcal{T}_\Gamma V, \quad W = \mathcal{T}_\Gamma \operatorname{diag}(\gamma) K .
# \end{gathered}
# $$
#
# Chapter 8's algorithm, with one decay factor wherever a term crosses tokens: $\Gamma$ in the two
# score matrices, $\gamma$ on the queries and keys that meet the chunk's starting state, and
# $\gamma_C / \gamma$ on the keys that carry a write to the chunk's end.
#
# **The gated factors are the plain ones rescaled.** On and below the diagonal,
# $(K K^\top \odot \Gamma)_{ij} = \gamma_i\, (k_i \cdot k_j)\, \gamma_j^{-1}$, so
# $\operatorname{tril}(K K^\top \odot \Gamma, -1) = \operatorname{tril}(\operatorname{diag}(\gamma)
# K K^\top \operatorname{diag}(\gamma)^{-1}, -1)$. A diagonal similarity keeps a matrix lower
# triangular and commutes with $\operatorname{diag}(\beta)$, so
# $I + \operatorname{tril}(\operatorname{diag}(\beta)(KK^\top \odot \Gamma), -1) =
# \operatorname{diag}(\gamma)\, A\, \operatorname{diag}(\gamma)^{-1}$ with chapter 7's $A$, and
#
# $$
# \mathcal{T}_\Gamma = \operatorname{diag}(\gamma)\, \mathcal{T}\, \operatorname{diag}(\gamma)^{-1},
# \qquad W = \operatorname{diag}(\gamma)\, \mathcal{T} K .
# $$
#
# Checked numerically for one chunk of 32 tokens at mild gates, in float64:

# %%
C = 32
q, k, v, beta, g = gated_inputs(1, 1, C, 16, 16, seed=2, g_low=-0.2)
K, b, G = k[0, 0], beta[0, 0, :, None], g[0, 0].cumsum(0)  # K [C, Dk], β column, G_i
gamma = G.exp()  # γ_i
KK = K @ K.T
T_plain = delta_rule.ut_transform(KK, b)  # 𝒯 (chapter 7)
T_gated = delta_rule.ut_transform(KK * gdr.decay_mask(G, strict=True), b)  # 𝒯_Γ
rescaled = gamma[:, None] * KK / gamma[None, :]  # diag(γ) K Kᵀ diag(γ)⁻¹
print(f"γ over the chunk falls to {gamma[-1]:.3f}")
print(f"max |tril(KKᵀ ⊙ Γ, -1) - tril(diag(γ) KKᵀ diag(γ)⁻¹, -1)| = "
      f"{max_diff((KK * gdr.decay_mask(G)).tril(-1), rescaled.tril(-1)):.1e}")
print(f"max |𝒯_Γ - diag(γ) 𝒯 diag(γ)⁻¹| = "
      f"{max_diff(T_gated, gamma[:, None] * T_plain / gamma[None, :]):.1e}")
print(f"max |𝒯_Γ diag(γ) K - diag(γ) 𝒯 K| = "
      f"{max_diff(T_gated @ (gamma[:, None] * K), gamma[:, None] * (T_plain @ K)):.1e}")

# %% [markdown]
# **Why the code does not use it.** The identity suggests computing the plain $\mathcal{T}$ and
# rescaling. But $\gamma_i$ is a product of up to $C$ decays, and strong gates (fast-forgetting
# heads) drive it out of float32's range: $e^{-88}$ is about the smallest normal float32, so a
# chunk whose gates sum below $-88$ has $\gamma$ underflowing and $\operatorname{diag}(\gamma)^{-1}$
# overflowing. A chunk of 64 tokens at $g = -2$ per token, in float32, rescaled against the lib's
# form (both against float64):

# %%
C = 64
q, k, v, beta, g = gated_inputs(1, 1, C, 16, 16, seed=3, g_low=0.0, dtype=torch.float32)
g = torch.full_like(g, -2.0)  # a fast-forgetting head: half-life ln 2 / 2 ≈ 0.35 tokens
K32, b32, G32 = k[0, 0], beta[0, 0, :, None], g[0, 0].cumsum(0)
gamma32 = G32.exp()
T32 = delta_rule.ut_transform(K32 @ K32.T, b32)
T_rescaled = gamma32[:, None] * T32 / gamma32[None, :]
T_lib32 = delta_rule.ut_transform(K32 @ K32.T * gdr.decay_mask(G32, strict=True), b32)
K64, b64, G64 = K32.double(), b32.double(), G32.double()
T_ref = delta_rule.ut_transform(K64 @ K64.T * gdr.decay_mask(G64, strict=True), b64)
print(f"G_C = {G32[-1]:.0f}: γ_C = {gamma32[-1]:.1e} in float32, "
      f"1/γ_C = {1 / gamma32[-1]:.1e}")
for name, Tg in (("diag(γ) 𝒯 diag(γ)⁻¹", T_rescaled),
                 ("exp(G_i - G_j) (lib)", T_lib32)):
    bad = (~torch.isfinite(Tg)).sum().item()
    err = max_diff(Tg[torch.isfinite(Tg)], T_ref[torch.isfinite(Tg)])
    print(f"{name:>22s}: {bad:4d} of {Tg.numel()} entries not finite; "
          f"max error of the finite ones {err:.1e}")
W_plain = gamma32[:, None] * (T32 @ K32)  # diag(γ) 𝒯 K: no division by γ
W_ref = T_ref @ (G64.exp()[:, None] * K64)  # 𝒯_Γ diag(γ) K in float64
n_bad = (~torch.isfinite(W_plain)).sum().item()
print(f"W = diag(γ) 𝒯 K in float32: {n_bad} entries not finite, "
      f"max error {max_diff(W_plain, W_ref):.1e}")

# %% [markdown]
# The rescaled form is not finite wherever it divides by a $\gamma_j$ that underflowed to 0 (the
# count printed), and even its finite entries are off (the error printed), where $\gamma$ had
# fallen into float32's subnormal range and lost its digits. The lib's form, which takes every
# ratio as $e^{G_i - G_j}$ in log space (so every factor is $\le 1$), is exact to float32
# round-off.
# That is why `gated_delta_rule.decay_mask` forms $\Gamma$ elementwise, and why it writes $-\infty$
# above the diagonal before the exponential: there $G_i - G_j > 0$, and its exponential would
# overflow too (the second exercise is about exactly this). Only the half of the identity with
# $\operatorname{diag}(\gamma)^{-1}$ overflows: $W = \operatorname{diag}(\gamma)\, \mathcal{T} K$
# involves only $\gamma \le 1$ and is finite (the last printed line); NVlabs' reference code
# builds $W$ that way, with a second triangular solve. fla and the lib use $\mathcal{T}_\Gamma$
# for both factors because it takes one solve, and $U$ needs the ratios anyway. The rescaling is
# still worth knowing:
# it shows that the gate changes the WY factors only by row and column scalings, and KDA's kernels
# use the same kind of rescaling, but only over 16-token stretches where it stays in range
# (chapter 11).
#
# **Why the trick stops at KDA.** KDA (chapter 11) gives every key channel $d$ its own decay, so
# $G$ becomes a matrix $G_{id}$ and the pair score is $\sum_d k_{id} k_{jd}\, e^{G_{id} - G_{jd}}$,
# that is $(K \odot e^{G})(K \odot e^{-G})^\top$: the decay sits inside the sum over channels. No
# diagonal matrix on the left or right pulls it out, so there is no plain $\mathcal{T}$ to rescale,
# and the factor $K \odot e^{-G}$ is the overflowing $\operatorname{diag}(\gamma)^{-1}$ again, now
# inside the product. Chapter 11 measures that overflow and the fix real kernels use: a gate
# bounded below and 16-token sub-chunks with reference points.

# %% [markdown]
# ## Build it: one gated chunk step
#
# The equations above for one chunk, next to chapter 8's chunk step rewritten with the same pieces
# (`delta_rule.ut_transform(A, b)` is $(I + \operatorname{tril}(\operatorname{diag}(\beta) A,
# -1))^{-1} \operatorname{diag}(\beta)$ for any score matrix $A$, and `gdr.decay_mask(G)` is
# $\Gamma$ from $G$):

# %%
def delta_chunk_step(q_c, k_c, v_c, beta_c, S):
    """Chapter 8's chunk step. q_c, k_c [B, H, n, Dk], v_c [B, H, n, Dv],
    beta_c [B, H, n], S = S_[c] [B, H, Dk, Dv]. Returns (O_[c], U'_[c], S_[c+1])."""
    b = beta_c.unsqueeze(-1)  # β as a column   [B, H, n, 1]
    T_c = delta_rule.ut_transform(k_c @ k_c.mT, b)  # 𝒯
    W, U = T_c @ k_c, T_c @ v_c  # W = 𝒯 K, U = 𝒯 V
    U_new = U - W @ S  # U' = U − W S_[c]
    scores = (q_c @ k_c.mT).tril()  # Q Kᵀ ⊙ M
    o = q_c @ S + scores @ U_new  # O = Q S_[c] + (Q Kᵀ ⊙ M) U'
    S_next = S + k_c.mT @ U_new  # S_[c+1] = S_[c] + Kᵀ U'
    return o, U_new, S_next


def gated_chunk_step(q_c, k_c, v_c, beta_c, g_c, S):
    """One chunk of Gated DeltaNet; g_c [B, H, n] the log decays."""
    b = beta_c.unsqueeze(-1)  # β as a column   [B, H, n, 1]
    G = g_c.cumsum(-1)  # G_i   [B, H, n]
    gamma = G.exp().unsqueeze(-1)  # γ_i as a column   [B, H, n, 1]
    T_c = delta_rule.ut_transform(k_c @ k_c.mT * gdr.decay_mask(G, strict=True), b)
    W, U = T_c @ (gamma * k_c), T_c @ v_c  # W = 𝒯_Γ diag(γ) K, U = 𝒯_Γ V
    U_new = U - W @ S  # U' = U − W S_[c]
    scores = q_c @ k_c.mT * gdr.decay_mask(G)  # Q Kᵀ ⊙ Γ
    o = (gamma * q_c) @ S + scores @ U_new  # O = diag(γ) Q S_[c] + (Q Kᵀ ⊙ Γ) U'
    to_end = (G[..., -1:] - G).exp().unsqueeze(-1)  # γ_C / γ_i   [B, H, n, 1]
    S_next = gamma[..., -1:, :] * S + (to_end * k_c).mT @ U_new  # γ_C S + (…K)ᵀ U'
    return o, U_new, S_next


print(tinyk3.notebook.source_diff(delta_chunk_step, gated_chunk_step, "chapter 8",
                                  "chapter 10"))

# %% [markdown]
# The diff is the whole change: the cumulative decay, $\Gamma$ in two products, $\gamma$ on the
# queries and keys that meet $S_{[c]}$, and the decay of the state and of each write to the chunk's
# end. (The lib sums $G_C - G_i$ from the chunk's end, `gdr.suffix_sum`, instead of subtracting,
# so that a long strongly gated chunk loses no digits to cancellation.) Chunk after chunk, with a
# last chunk shorter than the others and a non-zero initial state, against the token loop:

# %%
B, H, T, Dk, Dv, C = 2, 3, 70, 8, 6, 16
q, k, v, beta, g = gated_inputs(B, H, T, Dk, Dv, seed=4)
S0 = torch.randn(B, H, Dk, Dv, dtype=F64)
o_loop, S_loop = gdr.recurrent(q, k, v, beta, g, initial_state=S0)
S, outs = S0, []
for start in range(0, T, C):  # ⌈T/C⌉ chunks, the last one of T mod C tokens
    chunk = (x[:, :, start:start + C] for x in (q, k, v, beta, g))
    o_c, _, S = gated_chunk_step(*chunk, S)
    outs.append(o_c)
o_steps = torch.cat(outs, dim=2)
print(f"{math.ceil(T / C)} gated chunk steps against the token loop: max |o| diff "
      f"{max_diff(o_steps, o_loop):.1e}, max |S_T| diff {max_diff(S, S_loop):.1e}")
o_lib, S_lib = gdr.chunked(q, k, v, beta, g, chunk_size=C, initial_state=S0)
print(f"and against gated_delta_rule.chunked: {max_diff(o_steps, o_lib):.1e}")

# %% [markdown]
# ## Check: `gated_delta_rule.chunked` against the token loop
#
# From here on the lib's `gdr.chunked`, which runs the same equations for all chunks at once and
# keeps only the state pass sequential (chapter 8's four stages, with the decays added). In
# float64, for chunk sizes from 1 to more than $T$, at a $T$ that no chunk size but 1 divides,
# $D_k \ne D_v$ and a non-zero initial state:

# %%
B, H, T, Dk, Dv = 2, 2, 101, 8, 12
q, k, v, beta, g = gated_inputs(B, H, T, Dk, Dv, seed=5, g_low=-2.0)
S0 = torch.randn(B, H, Dk, Dv, dtype=F64)
o_ref, S_ref = gdr.recurrent(q, k, v, beta, g, initial_state=S0)
for C_ in (1, 5, 16, 32, 64, 128):
    o_ch, S_ch = gdr.chunked(q, k, v, beta, g, chunk_size=C_, initial_state=S0)
    print(f"T = {T}, C = {C_:3d}: max |o| diff {max_diff(o_ch, o_ref):.1e}, "
          f"max |S_T| diff {max_diff(S_ch, S_ref):.1e}")

# %% [markdown]
# Float64 round-off at every chunk size. **$g = 0$ is DeltaNet**: with no decay, $\Gamma = M$,
# $\gamma = 1$, and the gated form must give chapter 8's numbers:

# %%
zero = torch.zeros_like(g)
o_g0, S_g0 = gdr.chunked(q, k, v, beta, zero, chunk_size=16, initial_state=S0)
o_dr, S_dr = delta_rule.recurrent(q, k, v, beta, initial_state=S0)
print(f"gated_delta_rule.chunked(g = 0) against delta_rule.recurrent: max |o| diff "
      f"{max_diff(o_g0, o_dr):.1e}, max |S_T| diff {max_diff(S_g0, S_dr):.1e}")

# %% [markdown]
# **Gradients.** A layer trains through the chunked form, so its derivatives with respect to every
# input, the gates included, must be right: `torch.autograd.gradcheck` compares them with finite
# differences, in float64 on a small case (two chunks and a short one).

# %%
small = [x.requires_grad_() for x in gated_inputs(1, 1, 11, 3, 2, seed=6, g_low=-1.0)]
S0_small = torch.randn(1, 1, 3, 2, dtype=F64, requires_grad=True)
ok_grad = torch.autograd.gradcheck(
    lambda q, k, v, b, g, S: gdr.chunked(q, k, v, b, g, chunk_size=4, initial_state=S),
    (*small, S0_small))
print(f"gradcheck of gated_delta_rule.chunked (q, k, v, β, g, S_0): "
      f"{'passed' if ok_grad else 'FAILED'}")
grads = {}  # the chunked form's gradients against the token loop's, same loss
forms = {"chunked": partial(gdr.chunked, chunk_size=4), "loop": gdr.recurrent}
for form, fn in forms.items():
    o_, S_ = fn(*small, initial_state=S0_small)
    grads[form] = torch.autograd.grad((o_ * o_).sum() + (S_ * S_).sum(),
                                      (*small, S0_small))
print("max |grad chunked - grad loop| for q, k, v, β, g, S_0: "
      + ", ".join(f"{max_diff(a, b):.0e}" for a, b in zip(*grads.values())))

# %% [markdown]
# **float32, long sequences.** The chunked form and the token loop in float32 against the token
# loop in float64, at $T = 8192$ (1024 in smoke mode), 2 heads of $D = 64$, gates in
# $(-1, 0)$ and, as a stress case, all at $-5$ (a half-life of a seventh of a token). The bound we
# hold every form to, in the lib's tests too, is $10^{-5}$ relative to the largest output:

# %%
BOUND = 1e-5
for g_low, label in ((-1.0, "g in (-1, 0)"), (-5.0, "g = -5")):
    q, k, v, beta, g = gated_inputs(1, 2, T_LONG, 64, 64, seed=7, g_low=g_low)
    if g_low == -5.0:
        g = torch.full_like(g, -5.0)
    o64, _ = gdr.recurrent(q, k, v, beta, g)
    scale = o64.abs().max().item()
    args32 = [x.float() for x in (q, k, v, beta, g)]
    forms = {"recurrent": gdr.recurrent(*args32)[0]}
    for C_ in (16, 64):
        forms[f"chunked C = {C_}"] = gdr.chunked(*args32, chunk_size=C_)[0]
    line = ", ".join(f"{name} {max_diff(o, o64) / scale:.1e}"
                     for name, o in forms.items())
    worst = max(max_diff(o, o64) / scale for o in forms.values())
    print(f"T = {T_LONG}, {label:12s}: error / max|o|: {line}; "
          f"within {BOUND:.0e}: {worst <= BOUND}")

# %% [markdown]
# All within the bound, the strongly gated case included: every factor the chunked form
# multiplies is at most 1, and none is formed by dividing one small number by another.

# %% [markdown]
# (erratum-gdn-chunk-mask)=
# ## Erratum: the paper's chunk output uses the mask $M$ where $\Gamma$ is needed
#
# **What is printed.** The paper's §3.3 states the chunkwise output of the gated delta rule in its
# column layout ($\mathbf{S} \in \mathbb{R}^{d_v \times d_k}$, our $S^\top$); as quoted in
# NVlabs/GatedDeltaNet issue 15 (open, January 2026) it reads
#
# $$
# \mathbf{O}_{[t]} = \overleftarrow{\mathbf{Q}_{[t]}}\, \mathbf{S}_{[t]}^\top +
# \big(\mathbf{Q}_{[t]} \mathbf{K}_{[t]}^\top \odot \mathbf{M}\big)
# \big(\widetilde{\mathbf{U}_{[t]}} - \overleftarrow{\mathbf{W}_{[t]}}\, \mathbf{S}_{[t]}^\top\big),
# $$
#
# where $\mathbf{M}$ is the paper's binary causal mask, and the author derives that
# $\mathbf{M}$ must be $\mathbf{\Gamma}$. An earlier, closed issue (number 13, September 2025)
# asked the same about §3.3 and pointed to Qwen3-Next's code, which multiplies $QK^\top$ by a
# `decay_mask`. We read the quoted formula and both issues in the issue threads themselves, not in
# the PDF. In the derivation the arrow scales rows by the cumulative decay,
# $\overleftarrow{Q} = \operatorname{diag}(\gamma) Q$ and $\overleftarrow{W} =
# \operatorname{diag}(\gamma)\, \mathcal{T} K$ (the plain WY rows scaled: our $W$, by the
# rescaling identity), and $\widetilde{U}$ plays our $U = \mathcal{T}_\Gamma V$. In our row layout
# the printed formula is then $O_{[c]} = \operatorname{diag}(\gamma) Q S_{[c]} + (Q K^\top \odot
# M)\, U'_{[c]}$: our derivation with $M$ in place of $\Gamma$.
#
# **What goes wrong.** $M$ lets every write inside the chunk reach the later tokens undecayed,
# while the state and the deltas around it are decayed: the output is wrong wherever the gates are
# not zero. Measured against the token loop, both formulas built from the same $U'_{[c]}$ and
# $S_{[c]}$ of every chunk ($T = 64$, $C = 16$, gates in $(-1, 0)$, float64):

# %%
def chunk_outputs(q, k, v, beta, g, C, mask):
    """Every chunk's O_[c] = diag(γ) Q S_[c] + (Q Kᵀ ⊙ mask) U'_[c], mask 'Γ' or 'M',
    with U'_[c] and S_[c] from gated_chunk_step."""
    S = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    outs = []
    for start in range(0, q.shape[2], C):
        q_c, k_c, v_c, b_c, g_c = (x[:, :, start:start + C] for x in (q, k, v, beta, g))
        o_c, U_new, S_next = gated_chunk_step(q_c, k_c, v_c, b_c, g_c, S)
        if mask == "M":  # the printed formula: the binary causal mask
            gamma = g_c.cumsum(-1).exp().unsqueeze(-1)
            o_c = (gamma * q_c) @ S + (q_c @ k_c.mT).tril() @ U_new
        outs.append(o_c)
        S = S_next
    return torch.cat(outs, dim=2)


q, k, v, beta, g = gated_inputs(1, 2, 64, 16, 16, seed=8)
o_loop, _ = gdr.recurrent(q, k, v, beta, g)
print(f"outputs of the token loop up to {o_loop.abs().max():.2f} in size")
for mask in ("M", "Γ"):
    err = max_diff(chunk_outputs(q, k, v, beta, g, 16, mask), o_loop)
    print(f"(Q Kᵀ ⊙ {mask}) U':  max |O - token loop| = {err:.1e}")

# %% [markdown]
# The printed formula's error is of the size of the outputs themselves (the first line); with
# $\Gamma$ it is exact to float64 round-off. The error grows with the gate's strength, and
# vanishes only at $g = 0$, where $M = \Gamma$ and the formula is chapter 8's (which may be why
# it survived):

# %%
for g_low in (0.0, -0.01, -0.1, -1.0, -3.0):
    q, k, v, beta, g = gated_inputs(1, 2, 64, 16, 16, seed=8, g_low=g_low)
    o_loop, _ = gdr.recurrent(q, k, v, beta, g)
    err = max_diff(chunk_outputs(q, k, v, beta, g, 16, "M"), o_loop)
    print(f"gates in ({g_low:5.2f}, 0]: max error of the printed formula {err:.1e}")

# %% [markdown]
# **The fix.** Use the decay mask in the intra-chunk term, $O_{[c]} = \operatorname{diag}(\gamma)
# Q S_{[c]} + (Q K^\top \odot \Gamma)\, U'_{[c]}$, as derived above, as fla's and Qwen3-Next's code
# do, and as `gated_delta_rule.chunked` does. This erratum is on the
# [errata page](../book/errata.md).

# %% [markdown]
# ## The gate as real models parametrise it
#
# A layer computes the log decay from the token, per head, as Mamba-2 does:
#
# $$
# g_t = -\,e^{A_{\log}} \cdot \operatorname{softplus}(a_t + \Delta_{\text{bias}}),
# $$
#
# with $a_t$ a linear projection of the token, and two parameters per head: a rate
# $A = e^{A_{\log}} > 0$ and a bias $\Delta_{\text{bias}}$ that sets the initial time step
# $\Delta t = \operatorname{softplus}(\Delta_{\text{bias}})$ (`tinyk3.gates.softplus_gate`). The
# form keeps $g_t < 0$ for any input. fla's Gated DeltaNet layer initialises $A$ uniform in
# $(0, 16)$ and $\Delta t$ log-uniform in $[10^{-3}, 10^{-1}]$ (`gates.init_A_log`,
# `gates.init_dt_bias`), so at $a_t = 0$ the gate is $g = -A\,\Delta t$, and a memory's **half-life**
# under a constant gate, the number of tokens until it has decayed to half, is
# $\ln 2 / (-g)$ (`gates.half_life`). What half-lives does a freshly initialised model start from?
# Drawn for many heads, once at $a_t = 0$ and once with $a_t$ standard normal (a projection's
# output at initialisation is of that order):

# %%
gen = torch.Generator().manual_seed(10)
A_log = gates.init_A_log(N_HEADS_INIT, generator=gen)
dt_bias = gates.init_dt_bias(N_HEADS_INIT, generator=gen)
x0 = torch.zeros(1, N_HEADS_INIT, 1)  # a_t = 0, one token per head   [B, H, T]
x1 = torch.randn(1, N_HEADS_INIT, 1, generator=gen)  # a_t ~ N(0, 1)
g_init = {"a = 0": gates.softplus_gate(x0, A_log, dt_bias).flatten(),
          "a ~ N(0, 1)": gates.softplus_gate(x1, A_log, dt_bias).flatten()}
h_init = {name: gates.half_life(g_) for name, g_ in g_init.items()}
levels = [0.01, 0.1, 0.5, 0.9, 0.99]
print(f"{N_HEADS_INIT} heads; half-life in tokens at the quantiles "
      + " ".join(f"{p:>6.0%}" for p in levels))
for name, h in h_init.items():
    qs = torch.quantile(h, torch.tensor(levels, dtype=F64))
    print(f"{name:>12s}: " + " ".join(f"{x:>10.1f}" for x in qs.tolist()))
for name, g_ in g_init.items():
    h = h_init[name]
    beyond = (-64 * g_ > 88).double().mean().item()
    print(f"{name:>12s}: {(h < 1).double().mean():.1%} of heads forget half within one "
          f"token, {(h > 1000).double().mean():.1%} keep half for over 1000 tokens; "
          f"{beyond:.1%} have e^(-G) > e^88 over a 64-token chunk")

# %% mystnb={"figure": {"caption": "Half-lives of a memory, $\\ln 2 / (-g)$ in tokens, under the gates of freshly initialised Gated DeltaNet heads ($A \\sim U(0, 16)$, $\\Delta t$ log-uniform in $[10^{-3}, 10^{-1}]$), at a zero pre-activation and at a standard normal one, log axis. Dotted lines: one token and a 64-token chunk.", "name": "fig-gdn-initial-half-lives"}, "image": {"alt": "Two overlapping histograms of half-lives on a logarithmic axis from below one token to beyond ten thousand tokens. Both are broad and skewed: a hump from about one token to about a hundred tokens with a long tail to the right; the standard-normal pre-activation histogram is spread a little wider than the zero one. Dotted vertical lines mark one token and 64 tokens."}}
fig, ax = plt.subplots(figsize=(6.7, 3.4), layout="constrained")
edges = np.logspace(-1.5, 5.5, 71)
for name, h in h_init.items():
    ax.hist(h.clamp(edges[0], edges[-1]).numpy(), bins=edges, histtype="step", lw=1.5,
            density=False, label=f"{name}")
for x_, text in ((1, "1 token"), (64, "one chunk")):
    ax.axvline(x_, color="k", ls=":", lw=1)
    ax.text(x_ * 1.15, ax.get_ylim()[1] * 0.92, text, fontsize=8)
ax.set(xscale="log", xlabel="half-life of a memory (tokens)", ylabel="heads",
       title=f"Initial decays of {N_HEADS_INIT} Gated DeltaNet heads")
ax.legend(fontsize=8, title="pre-activation", title_fontsize=8)
plt.show()

# %% [markdown]
# A freshly initialised model starts with a wide spread of memory lengths (the quantile lines
# above): the median head keeps half a memory for about ten tokens, one head in ten for about a
# hundred tokens or more, and a small share of heads, more with a random pre-activation, forgets
# half within a single token. Both parameters spread it: $\Delta t$ covers two decades, and $A$,
# uniform down to zero, adds the long tail of slow heads. Training moves every head from there.
# The last numbers on each line are the numerical point of the previous section: for a small share of
# heads even at initialisation, and for any head a token can push there (the gate is unbounded
# below), the decay over a 64-token chunk leaves float32's range, so $\operatorname{diag}(\gamma)^{-1}$
# cannot be formed. Kimi K3's KDA bounds the gate below instead ($g = -5\,\sigma(\cdot)$,
# chapter 11).

# %% [markdown]
# ## Experiment: recall when old facts must fade
#
# **The task.** A memory of head size $D = 32$ reads a sequence of segments. Each segment states 8
# facts, key $\to$ value: 8 keys drawn from a pool of 64 random unit keys, each with a fresh random
# unit value. Keys come back in later segments with new values, so a fact can be outdated by a
# newer one for the same key, and 64 keys in 32 dimensions are more than any state of this size
# can hold apart. After the last segment the memory is read at the keys of each segment, and the
# read is compared with what that segment said (keys restated later are left out of the older
# segments' scores). The score is the relative error $\sqrt{\sum \lVert k S - v \rVert^2 /
# \sum \lVert v \rVert^2}$ of chapter 4: 0 is perfect recall, 1 is what an empty memory scores.
#
# **The memories**, with nothing trained: additive memory (linear attention,
# $S_t = S_{t-1} + k_t^\top v_t$), DeltaNet with $\beta = 1$, and Gated DeltaNet with $\beta = 1$ and
# a constant gate, set by its half-life $h$: $g = -\ln 2 / h$. And one gate that is not constant,
# the kind a trained layer can compute from its input: $g = -30$ on the first token of each segment
# (it empties the state) and 0 elsewhere.

# %%
D_MEM, N_FACTS, POOL = 32, 8, 64
T_EXP = N_SEGMENTS * N_FACTS


def segments(trials, gen, dtype=F64):
    """`trials` sequences of N_SEGMENTS segments of N_FACTS facts: keys [M, 1, T, D]
    (one head), fresh unit values [M, 1, T, D], and which facts are restated later."""
    pool = random_unit_keys(POOL, D_MEM, batch=trials, generator=gen, dtype=dtype)
    key_id = torch.stack([torch.randperm(POOL, generator=gen)[:N_FACTS]
                          for _ in range(trials * N_SEGMENTS)]).view(trials, T_EXP)
    keys = torch.gather(pool, 1, key_id[..., None].expand(-1, -1, D_MEM))[:, None]
    vals = torch.randn(trials, 1, T_EXP, D_MEM, generator=gen, dtype=dtype)
    pos = torch.arange(T_EXP)
    restated = ((key_id[:, :, None] == key_id[:, None, :])  # the same key again, later
                & (pos[None, None, :] > pos[None, :, None])).any(-1)
    return keys, F.normalize(vals, dim=-1), restated


keys, vals, restated = segments(TRIALS, torch.Generator().manual_seed(11))
ones = torch.ones(TRIALS, 1, T_EXP, dtype=F64)  # β = 1


def fact_error(S, age):
    """Relative error of reading the facts of the segment `age` segments before the
    last, at its keys not restated since."""
    sl = slice(T_EXP - (age + 1) * N_FACTS, T_EXP - age * N_FACTS)
    keep = ~restated[:, sl]
    err = (keys[:, 0, sl] @ S[:, 0] - vals[:, 0, sl]).pow(2).sum(-1)
    return math.sqrt(err[keep].sum() / vals[:, 0, sl].pow(2).sum(-1)[keep].sum())


states = {"additive": linear_attention.recurrent(keys, keys, vals)[1],
          "DeltaNet": delta_rule.chunked(keys, keys, vals, ones)[1]}
half_lives = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
gated = {h: gdr.chunked(keys, keys, vals, ones,
                        torch.full_like(ones, -math.log(2) / h))[1]  # g = −ln 2 / h
         for h in half_lives}
g_reset = torch.zeros_like(ones)
g_reset[..., ::N_FACTS] = -30.0  # empty the state where a segment begins
states["gate at boundaries"] = gdr.chunked(keys, keys, vals, ones, g_reset)[1]
last = slice(T_EXP - N_FACTS, T_EXP)  # the last segment alone, from an empty state
alone = delta_rule.chunked(keys[:, :, last], keys[:, :, last], vals[:, :, last],
                           ones[..., last])[1]
print(f"{TRIALS} memories, {N_SEGMENTS} segments of {N_FACTS} facts, D = {D_MEM}, "
      f"{POOL} keys. Error on the last segment's facts:")
for name, S in states.items():
    print(f"  {name:>20s}: {fact_error(S, 0):.3f}")
print(f"  {'the segment alone':>20s}: {fact_error(alone, 0):.3f}  "
      "(DeltaNet, from an empty state)")
print("  Gated DeltaNet, half-life h in tokens: "
      + ", ".join(f"h = {h}: {fact_error(S, 0):.3f}" for h, S in gated.items()))
best_h = min(gated, key=lambda h: fact_error(gated[h], 0))
print(f"  best constant gate: h = {best_h} tokens ({best_h / N_FACTS:g} segments)")

# %% [markdown]
# **Can a gate learn that?** The boundary gate above was set by hand, from knowing where segments
# begin. The smallest trained model that can answer whether gradient descent finds it on its own
# trains nothing but the gate: the real models' form $g_t = -e^{A_{\log}}
# \operatorname{softplus}(a_t + \Delta_{\text{bias}})$, with the pre-activation
# $a_t = w_1 b_t + w_2 n_t$ computed from two features of each token: $b_t = 1$ on the first token
# of a segment (a separator, which real text has) and 0 elsewhere, and $n_t$ pure noise. Four
# numbers are trained ($w_1, w_2, A_{\log}, \Delta_{\text{bias}}$), starting from $w = 0$ and the
# middle of fla's initial ranges, $A = 8$ and $\Delta t = 0.01$ (a half-life of about 9 tokens);
# keys, values and $\beta = 1$ stay as they are. The loss is the squared relative error on the last
# segment's facts, on fresh sequences at every step, through `gated_delta_rule.chunked` in float32
# (its gradient is the one `gradcheck` passed above). Adam, learning rate 0.1, 32 sequences a step:

# %%
STEPS = 15 if SMOKE else 150
gen = torch.Generator().manual_seed(12)
first_token = (torch.arange(T_EXP) % N_FACTS == 0).float()  # b_t: a segment begins
w = torch.zeros(2, requires_grad=True)  # w_1 (boundary), w_2 (noise)
A_log = torch.tensor([math.log(8.0)], requires_grad=True)
# Δ_bias = softplus⁻¹(0.01), the inverse gates.init_dt_bias uses
dt_bias = torch.tensor([0.01 + math.log(-math.expm1(-0.01))], requires_grad=True)
opt = torch.optim.Adam([w, A_log, dt_bias], lr=0.1)


def learned_gate(noise):
    return gates.softplus_gate(w[0] * first_token + w[1] * noise, A_log, dt_bias)


def gate_summary():
    """The learned gate on a first token and inside a segment (noise feature 0)."""
    with torch.no_grad():
        g_b, g_in = (gates.softplus_gate(torch.full((1, 1, 1), x), A_log, dt_bias)
                     .item() for x in (w[0].item(), 0.0))
    return (f"g = {g_b:.2f} on a first token, {g_in:.4f} inside (half-life "
            f"{gates.half_life(g_in):.0f} tokens); w_2 = {w[1].item():+.3f}")


print(f"step   0: {gate_summary()}")
for step in range(1, STEPS + 1):
    k_tr, v_tr, _ = segments(32, gen, dtype=torch.float32)
    noise = torch.randn(32, 1, T_EXP, generator=gen)
    beta_tr = torch.ones(32, 1, T_EXP)
    _, S_tr = gdr.chunked(k_tr, k_tr, v_tr, beta_tr, learned_gate(noise))
    k_last, v_last = k_tr[:, 0, -N_FACTS:], v_tr[:, 0, -N_FACTS:]  # the last segment
    loss = (k_last @ S_tr[:, 0] - v_last).pow(2).sum() / v_last.pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % (STEPS // 5) == 0:
        print(f"step {step:3d}: training error {loss.sqrt().item():.3f}; "
              f"{gate_summary()}")

with torch.no_grad():  # on the same test sequences as every memory above
    noise = torch.randn(TRIALS, 1, T_EXP, generator=gen, dtype=F64)
    states["trained gate"] = gdr.chunked(keys, keys, vals, ones, learned_gate(noise))[1]
print(f"test error on the last segment's facts: trained gate "
      f"{fact_error(states['trained gate'], 0):.3f}, hand-set boundary gate "
      f"{fact_error(states['gate at boundaries'], 0):.3f}, best constant gate "
      f"{fact_error(gated[best_h], 0):.3f}, "
      f"DeltaNet {fact_error(states['DeltaNet'], 0):.3f}")

# %% mystnb={"figure": {"caption": "Recall after a sequence of segments of 8 facts each, keys reused with new values, head size 32. Top: error on the last segment's facts against the half-life of a constant gate (Gated DeltaNet, $\\beta = 1$), with DeltaNet, a hand-set gate that empties the state at segment boundaries, and a trained gate for reference (additive memory is off the scale: its value is in the title). Bottom: error on the facts of older segments, by age; 1 is what an empty read scores.", "name": "fig-gdn-fading-facts"}, "image": {"alt": "Two line plots. Top: error of Gated DeltaNet against half-life on a log axis, high at a half-life of one token, falling to a minimum at a few segments' worth of tokens and rising slowly towards the DeltaNet line at long half-lives; the hand-set boundary gate and the trained gate lie on one lower line, DeltaNet on a higher one. Bottom: error against the age of a segment; the shortest half-life and the trained gate jump to about 1 after one segment, DeltaNet rises steadily above 1, and the best constant half-life lies below DeltaNet at every age."}}
ages = list(range(min(N_SEGMENTS, 12)))
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.7, 6.4), layout="constrained")
ax1.plot(half_lives, [fact_error(gated[h], 0) for h in half_lives], "o-",
         label="Gated DeltaNet, constant gate")
ax1.axhline(fact_error(states["DeltaNet"], 0), color="C1", ls="--", label="DeltaNet")
ax1.axhline(fact_error(states["gate at boundaries"], 0), color="C2", ls="--",
            label="gate at segment boundaries")
ax1.axhline(fact_error(states["trained gate"], 0), color="C3", ls="-.",
            label="trained gate")
ax1.axvline(N_FACTS, color="k", ls=":", lw=1)
ax1.text(N_FACTS * 1.1, 0.9, "one segment", fontsize=8)
ax1.set(xscale="log", xlabel="half-life h of the gate (tokens)", ylim=(0, 1.05),
        ylabel="error, last segment",
        title=f"Additive memory: {fact_error(states['additive'], 0):.2f} "
              "(off the scale)")
for h, color in ((2, "C4"), (best_h, "C0"), (1024, "C5")):
    ax2.plot(ages, [fact_error(gated[h], a) for a in ages], "o-", color=color,
             label=f"Gated DeltaNet, h = {h}")
ax2.plot(ages, [fact_error(states["DeltaNet"], a) for a in ages], "s--", color="C1",
         label="DeltaNet")
ax2.plot(ages, [fact_error(states["trained gate"], a) for a in ages], "^-.", color="C3",
         label="trained gate")
ax2.axhline(1, color="k", ls=":", lw=1)
ax2.set(xlabel="age of the segment (segments before the last)", ylabel="error",
        title="Older facts")
for ax in (ax1, ax2):
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %% [markdown]
# **What the numbers say** (the lines above the figure):
#
# - **Additive memory** fails outright: every restated key returns the sum of all the values it was
#   ever given, so its error is larger than the values themselves. This is chapter 5's lesson
#   again; the delta rule's overwrite is what fixes it, gate or no gate.
# - **DeltaNet** recalls the last segment with a moderate error. Its writes at $\beta = 1$ land
#   exactly, so the error is interference: each later write of the segment disturbs the earlier ones
#   in proportion to its delta, and the deltas are larger when the state is full of stale facts
#   that the new keys partly overlap.
# - **A constant gate trades retention against interference.** A short half-life empties the
#   stale facts but also the segment's own first facts (the sweep's largest error, at $h = 1$); a
#   long one is DeltaNet. In between, at a half-life of a few segments, the error is lowest,
#   lower than DeltaNet's: the U in the top panel. On older facts (bottom panel; error 1 is what
#   an empty read scores) a short half-life returns about nothing after one segment, while
#   DeltaNet and the longest half-life keep older facts so noisily that past a few segments their
#   reads are worse than an empty one: stale facts read back as wrong values rather than as
#   nothing. The best constant gate lies below DeltaNet at every age.
# - **A gate that depends on the input** beats every constant one: emptying the state where a
#   segment begins leaves only the segment's own interference (the same error as the segment stored
#   alone, printed above).
# - **The trained gate finds it.** From a gate that decays every token alike, gradient descent
#   through the chunked form turns the boundary feature into a strong decay on first tokens, lets
#   the decay inside a segment fall towards none, and leaves the noise feature's weight near zero
#   (the training log). Its test error ends at about the hand-set boundary gate's, below every
#   constant gate. It does not empty the state completely: the learned first-token decay leaves a
#   small fraction of the old state, which is why its older segments read slightly worse than
#   empty. It learned what the loss asked for, the last segment, and nothing more.
#
# The gains over DeltaNet here are modest, and honest: with $\beta = 1$ the delta rule already
# replaces outdated values, so the gate helps only with what is left, interference and capacity.
# What the gate adds is a way to drop a whole context at once, and a layer learns where to do it
# when its input marks the place. A full Gated DeltaNet layer learns the keys, values and $\beta$
# too, from the token's projections (chapter 12).

# %% [markdown]
# ## Exercises
#
# ```{exercise} One step of the gated delta rule
# :label: ex-gated-step
#
# Write `gated_step(S, k, v, beta, g)`: one token's update of a batch of states, forget before
# error. `S` is `[B, H, Dk, Dv]`, `k` is `[B, H, Dk]`, `v` is `[B, H, Dv]`, `beta` and `g` are
# `[B, H]` (one write strength and one log decay per head, $g \le 0$). Return
# $S' + k^\top \beta\,(v - k S')$ with $S' = e^{g} S$, `[B, H, Dk, Dv]`, in the inputs' dtype.
# ```

# %%
def gated_step_mine(S, k, v, beta, g):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("gated.step", gated_step_mine)

# %% [markdown]
# ```{solution-start} ex-gated-step
# :class: dropdown
# ```

# %%
def gated_step_solution(S, k, v, beta, g):
    S = torch.exp(g)[..., None, None] * S  # forget: S' = α S, α [B, H, 1, 1]
    v_old = torch.einsum("bhk,bhkv->bhv", k, S)  # what is left at k   [B, H, Dv]
    u = beta.unsqueeze(-1) * (v - v_old)  # β (v − k S')
    return S + k.unsqueeze(-1) * u.unsqueeze(-2)  # S' + kᵀ u


ok = checks.run("gated.step", gated_step_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The decay mask of a chunk
# :label: ex-gated-decay-mask
#
# Write `decay_mask(g)`: from the log decays `g [..., C]` of one chunk, the decay mask
# `Gamma [..., C, C]` with $\Gamma_{ij} = e^{G_i - G_j}$ for $j \le i$ and 0 above the diagonal,
# $G_i = \sum_{s \le i} g_s$, in `g`'s dtype. It must be finite for any $g \le 0$ in float32,
# including gates as strong as $-20$ per token.
# ```

# %%
def decay_mask_mine(g):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("gated.decay_mask", decay_mask_mine)

# %% [markdown]
# ```{solution-start} ex-gated-decay-mask
# :class: dropdown
# ```

# %%
def decay_mask_solution(g):
    G = g.cumsum(-1)  # G_i = Σ_{s ≤ i} g_s, inclusive
    diff = G[..., :, None] - G[..., None, :]  # G_i − G_j   [..., C, C]
    C = g.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool).tril()  # j ≤ i
    # −inf before the exponential: exp gives exact zeros, never inf · 0
    return torch.where(keep, diff, -torch.inf).exp()


ok = checks.run("gated.decay_mask", decay_mask_solution)

# Masking after the exponential: .tril() selects, a 0/1 mask multiplies; gradients
g_strong = torch.full((16,), -20.0, requires_grad=True)
G_ = g_strong.cumsum(-1)
keep = torch.ones(16, 16, dtype=torch.bool).tril()
builds = {"exp, then * mask": lambda D: D.exp() * keep,
          "exp, then .tril()": lambda D: D.exp().tril(),
          "-inf, then exp": lambda D: torch.where(keep, D, -torch.inf).exp()}
for name, build in builds.items():
    Gamma_ = build(G_[:, None] - G_[None, :])
    (grad,) = torch.autograd.grad(Gamma_.sum(), g_strong)
    n_bad = (~torch.isfinite(Gamma_)).sum().item()
    n_nan = torch.isnan(grad).sum().item()
    print(f"{name:>18s}: Γ has {n_bad:3d} non-finite entries, "
          f"its gradient {n_nan:2d} NaN of {grad.numel()}")

# %% [markdown]
# Masking after the exponential by multiplying with a 0/1 mask, as chapter 8 did with its
# scores, turns an overflowed $e^{G_i - G_j} = \infty$ above the diagonal into NaN. Masking with
# `.tril()` gives the right values (it selects entries, it does not multiply), but the gradient is
# still NaN: the derivative of a discarded entry is $0 \cdot \infty$. Only the mask before the
# exponential is safe in both directions, and it is what `gated_delta_rule.decay_mask` does.
#
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Gated DeltaNet decays the whole state by $\alpha_t = e^{g_t}$ before the delta rule writes:
#   $S_t = \alpha_t (I - \beta_t k_t^\top k_t) S_{t-1} + \beta_t k_t^\top v_t$. Forget before error is
#   the paper's order; it makes a full-strength write land exactly, and keeps the transition a
#   scalar times chapter 5's, so the decays factor out of a chunk. The other order is Comba's,
#   which has a chunk form of its own: the choice is about what a write does.
# - The chunk form is chapter 8's with the decay mask $\Gamma_{ij} = \gamma_i / \gamma_j =
#   e^{G_i - G_j}$: $\mathcal{T}_\Gamma$ from $KK^\top \odot \Gamma$, $W = \mathcal{T}_\Gamma
#   \operatorname{diag}(\gamma) K$, $O_{[c]} = \operatorname{diag}(\gamma) Q S_{[c]} + (QK^\top \odot
#   \Gamma) U'_{[c]}$, $S_{[c+1]} = \gamma_C S_{[c]} + (\operatorname{diag}(\gamma_C/\gamma) K)^\top
#   U'_{[c]}$. The gated factors are the plain ones rescaled, $\mathcal{T}_\Gamma =
#   \operatorname{diag}(\gamma) \mathcal{T} \operatorname{diag}(\gamma)^{-1}$, but
#   $\operatorname{diag}(\gamma)^{-1}$ overflows float32 for strong gates, so the code forms
#   $e^{G_i - G_j}$ elementwise, masked before the exponential. With one decay per channel (KDA)
#   no such rescaling exists.
# - `tinyk3.ops.gated_delta_rule.chunked` equals the token loop to float64 round-off for every
#   chunk size, reduces to DeltaNet at $g = 0$, passes `gradcheck`, and stays within $10^{-5}$ of
#   the float64 loop in float32 at $T = 8192$, with gates as strong as $-5$ per token.
# - The paper's §3.3 output formula uses the binary mask $M$ where $\Gamma$ is needed
#   (NVlabs/GatedDeltaNet issue 15): its error, measured above, is of the size of the outputs.
# - Real layers parametrise $g = -e^{A_{\log}} \operatorname{softplus}(a + \Delta_{\text{bias}})$ and
#   start from half-lives spread from under a token to thousands of tokens.
# - On recall with outdated facts the delta rule's overwrite does most of the work; a constant gate
#   lowers the error a little further at a half-life of a few segments (shorter ones lose the
#   segment's own facts), a gate that empties the state at segment boundaries does best, and a
#   gate trained from a boundary feature learns to do just that.
#
# **Next.** Chapter 11 gives every key channel its own decay: Kimi Delta Attention, where the
# rescaling trick fails and float32's range shapes the algorithm.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
