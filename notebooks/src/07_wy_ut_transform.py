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
# # The WY representation and the UT transform
#
# Chapter 6 made linear attention fast on long sequences by cutting them into chunks: inside a
# chunk a masked product, across chunks one state update, $S \leftarrow S + K_{[c]}^\top V_{[c]}$. That
# update works because linear attention's state is a *sum*, and a sum can be grouped any way.
# DeltaNet's state is not a sum: every token reads the state its predecessors left before it
# writes (chapter 5), so the writes of a chunk depend on one another and on the state the chunk
# starts from. This chapter finds the closed form of a chunk of delta-rule steps. The product
# of the chunk's $C$ transitions is the identity minus a matrix of rank at most $C$ (the *WY
# representation*), and one small lower-triangular $C \times C$ matrix, the *UT transform*,
# gives that matrix and the chunk's writes with matrix products and one triangular solve.
# Chapter 8 builds chunkwise DeltaNet from these pieces, and chapter 9 a GPU kernel.
#
# **In this chapter** you derive the WY representation by induction and check it against the
# explicit product of transitions; turn its recursion into the UT transform and see that the
# recursion *is* forward substitution; build the block-wise inverse that GPU kernels use;
# check that the papers', the blog's and the kernel library's ways of writing $\mathcal{T}$ give the same
# numbers (and that a sign slip seen in print does not); prove and measure how well
# conditioned the triangular solve is, and why normalised keys and $\beta \le 1$ matter; and time
# the WY form against the two direct ways of forming the product of transitions, and say what it
# buys.
#
# **Cost.** Well under a minute on one CPU core (the last cell prints the time);
# `SMOKE = True` runs in a few seconds.

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

from tinyk3 import bench, checks, conditioning
from tinyk3.ops import delta_rule, linear_attention, wy
from tinyk3.timing import distinguishable, time_fn
from tinyk3.util import max_diff

CHUNK_SIZES = [16, 32, 64] if SMOKE else [16, 32, 64, 128, 256]  # C in the sweep
BETAS = [0.1, 0.5, 1.0, 2.0] if SMOKE else [0.1, 0.25, 0.5, 1.0, 2.0]  # β in the sweep
N_CHUNKS = 4 if SMOKE else 16  # random chunks per point of the sweep
TIMING_DIMS = [16, 32, 64] if SMOKE else [16, 32, 64, 128, 256]  # head sizes D timed
TIMING_REPEATS = 3 if SMOKE else 7  # median of k runs (tinyk3.timing)


def unit_chunk(shape, C, Dk, Dv, seed, dtype=torch.float64):
    """A chunk of C tokens: unit keys [*shape, C, Dk], values [*shape, C, Dv],
    β [*shape, C] in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    k = F.normalize(torch.randn(*shape, C, Dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(*shape, C, Dv, generator=g, dtype=dtype)
    beta = torch.rand(*shape, C, generator=g, dtype=dtype)
    return k, v, beta


# %% [markdown]
# ## The problem: a chunk of delta-rule writes is not a sum
#
# For linear attention, the state after a chunk of $C$ tokens is the state before it plus the
# chunk's writes, $S_{[1]} = S_0 + \sum_t k_t^\top v_t = S_0 + K^\top V$, whatever $S_0$ is. That one
# line is what made chapter 6's chunked form possible. The same shortcut for the delta rule
# would let every token of the chunk compute its correction against $S_0$,
# $S_{[1]} \overset{?}{=} S_0 + K^\top \operatorname{diag}(\beta)(V - K S_0)$: the read-once block
# update of chapter 5's erratum. One chunk of 64 tokens, unit keys in $D_k = 32$, both rules
# against their token loops:

# %%
B, H, C, Dk, Dv = 2, 3, 64, 32, 16
k, v, beta = unit_chunk((B, H), C, Dk, Dv, seed=0)
S0 = torch.randn(B, H, Dk, Dv, dtype=torch.float64)

_, S_linear = linear_attention.recurrent(k, k, v, initial_state=S0)
print(f"linear attention: max |S_0 + Kᵀ V - token loop|                    = "
      f"{max_diff(S0 + k.mT @ v, S_linear):.1e}")
_, S_delta = delta_rule.recurrent(k, k, v, beta, initial_state=S0)
read_once = S0 + k.mT @ (beta[..., None] * (v - k @ S0))
print(f"delta rule:       max |S_0 + Kᵀ diag(β)(V - K S_0) - token loop|    = "
      f"{max_diff(read_once, S_delta):.2f}   "
      f"(the state is {S_delta.abs().max():.2f} at most)")

# %% [markdown]
# What survives is linearity. Each delta-rule step is an affine map of the state,
# $S_t = F_t S_{t-1} + \beta_t k_t^\top v_t$ with the transition $F_t = I - \beta_t k_t^\top k_t$
# ($D_k \times D_k$; chapter 5 called it $A_t$, but here $A$ is kept for a matrix met below).
# Unrolled over a chunk of $C$ tokens:
#
# $$
# S_{[1]} \;=\; \underbrace{F_C F_{C-1} \cdots F_1}_{P}\; S_0 \;+\;
#   \underbrace{\sum_{t=1}^{C} F_C \cdots F_{t+1}\, \beta_t\, k_t^\top v_t}_{H} .
# $$
#
# In our row layout later tokens multiply **on the left**. $P$ depends only on the keys and write
# strengths of the chunk; $H$ is the state the chunk leaves behind when it starts from zero.
# `tinyk3.ops.wy.transition_product` multiplies the $C$ transitions out explicitly:

# %%
P = wy.transition_product(k, beta)  # F_C ⋯ F_1                   [B, H, Dk, Dk]
_, H_chunk = delta_rule.recurrent(k, k, v, beta)  # from S_0 = 0     [B, H, Dk, Dv]
print(f"max |P S_0 + H - token loop from S_0| = "
      f"{max_diff(P @ S0 + H_chunk, S_delta):.1e}")

# %% [markdown]
# So a chunk *could* be handled like chapter 6's: compute each chunk's $(P, H)$ independently,
# then pass the state through the chunks with one $P S + H$ each. Multiplying the $C$ transitions
# out as dense matrices costs $2 C D_k^3$ flops per chunk, but that is not the way to form $P$: each
# factor is the identity minus a rank-one matrix, so $P \leftarrow F_t P = P - \beta_t k_t^\top
# (k_t P)$ costs $4 D_k^2$ per token, $4 C D_k^2$ per chunk. Even so $P$ is a dense $D_k \times D_k$
# matrix per chunk, built in $C$ dependent steps of vector-times-matrix products, which no
# tensor core runs well. The product has more structure than that: the identity minus a matrix
# of rank at most $C$, which can be kept in that form.

# %% [markdown]
# ## The WY representation
#
# **Claim.** For every $r \le C$ there are rows $w_1, \dots, w_r \in \mathbb{R}^{1 \times D_k}$ with
#
# $$
# P_r \;=\; F_r \cdots F_1 \;=\; I - \sum_{i=1}^{r} k_i^\top w_i \;=\; I - K_r^\top W_r ,
# $$
#
# where $K_r$ and $W_r$ stack the first $r$ keys and $w$'s as rows. **Proof by induction.** For
# $r = 1$, $w_1 = \beta_1 k_1$. If it holds for $r - 1$, then
#
# $$
# \begin{aligned}
# P_r &= \big(I - \beta_r k_r^\top k_r\big)\Big(I - \sum_{i<r} k_i^\top w_i\Big) \\
#     &= I - \sum_{i<r} k_i^\top w_i - \beta_r k_r^\top k_r + \beta_r k_r^\top \sum_{i<r} \big(k_r k_i^\top\big)\, w_i \\
#     &= I - \sum_{i<r} k_i^\top w_i - k_r^\top \Big[\beta_r\Big(k_r - \sum_{i<r} (k_r \cdot k_i)\, w_i\Big)\Big],
# \end{aligned}
# $$
#
# using $k_r k_i^\top = k_r \cdot k_i$, a number. The bracket is the new row:
#
# $$
# w_r = \beta_r \Big(k_r - \sum_{i<r} (k_r \cdot k_i)\, w_i\Big).
# $$
#
# The writes follow the same pattern. $H_r = F_r H_{r-1} + \beta_r k_r^\top v_r$; if
# $H_{r-1} = \sum_{i<r} k_i^\top u_i$ then $k_r H_{r-1} = \sum_{i<r} (k_r \cdot k_i)\, u_i$ and
#
# $$
# H_r = \sum_{i \le r} k_i^\top u_i = K_r^\top U_r, \qquad
# u_r = \beta_r \Big(v_r - \sum_{i<r} (k_r \cdot k_i)\, u_i\Big):
# $$
#
# $u_r$ is exactly the correction token $r$ writes when the chunk starts from zero. The two
# recursions are one recursion with different right-hand sides, $x_r = k_r$ for $W$ and
# $x_r = v_r$ for $U$. Here it is, row by row:

# %%
def wy_recursion(k, x, beta):
    """Rows y_r = β_r (x_r − Σ_{i<r} (k_r·k_i) y_i).

    k [..., C, Dk], x [..., C, D], beta [..., C]."""
    rows = []
    for r in range(k.shape[-2]):
        y = x[..., r, :]  # x_r                                     [..., D]
        for i in range(r):
            # k_r · k_i   [..., 1]
            k_dot = (k[..., r, :] * k[..., i, :]).sum(-1, keepdim=True)
            y = y - k_dot * rows[i]
        rows.append(beta[..., r, None] * y)  # y_r
    return torch.stack(rows, dim=-2)  # [..., C, D]


# %% [markdown]
# The product of the 64 transitions of the chunk above against its WY form $I - K^\top W$, in
# float64 and in float32 (both computed in the precision named, the distance measured in float64):

# %%
for dtype in (torch.float64, torch.float32):
    k_, beta_ = k.to(dtype), beta.to(dtype)
    W_loop = wy_recursion(k_, k_, beta_)  # [B, H, C, Dk]
    P_wy = torch.eye(Dk, dtype=dtype) - k_.mT @ W_loop  # I − Kᵀ W
    P_explicit = wy.transition_product(k_, beta_)  # F_C ⋯ F_1
    dist = max_diff(P_explicit.double(), P_wy.double())
    print(f"{str(dtype):14s} max |F_C ⋯ F_1 - (I - Kᵀ W)| = {dist:.1e}"
          f"   (float64 product vs this one: {max_diff(P, P_explicit.double()):.1e})")

# %% [markdown]
# And the whole chunk, $S_{[1]} = P S_0 + K^\top U$, which with $P = I - K^\top W$ is
#
# $$
# S_{[1]} = S_0 + K^\top \big(U - W S_0\big).
# $$
#
# Read it as chapter 5 would: row $t$ of $U - W S_0$ is the correction
# $\beta_t (v_t - k_t S_{t-1})$ that token $t$ writes when the chunk starts from $S_0$. $W$ and $U$
# depend only on the chunk's own tokens; $S_0$ enters through one product. Both claims, against
# the token loop (the corrections recorded as it runs):

# %%
U_loop = wy_recursion(k, v, beta)  # [B, H, C, Dv]
W_loop = wy_recursion(k, k, beta)  # [B, H, C, Dk]
S_C = S0 + k.mT @ (U_loop - W_loop @ S0)  # S_0 + Kᵀ (U − W S_0)
print(f"max |S_0 + Kᵀ (U - W S_0) - token loop| = {max_diff(S_C, S_delta):.1e}")

S, corrections = S0.clone(), []
for t in range(C):
    v_old = (k[..., t, None, :] @ S).squeeze(-2)  # k_t S_{t-1}
    u_t = beta[..., t, None] * (v[..., t, :] - v_old)  # β_t (v_t − k_t S_{t-1})
    corrections.append(u_t)
    S = S + k[..., t, :, None] * u_t[..., None, :]  # S_t = S_{t-1} + k_tᵀ u_t
print(f"max |U - W S_0 - the corrections of the token loop| = "
      f"{max_diff(U_loop - W_loop @ S0, torch.stack(corrections, dim=-2)):.1e}")

# %% [markdown]
# **Where the name comes from.** With a unit key and $\beta = 2$, $I - 2 k^\top k$ is a Householder
# reflection; for $\beta \in (0, 1]$ Yang et al. (2024, *Parallelizing Linear Transformers with the
# Delta Rule over Sequence Length*) call $I - \beta_t k_t^\top k_t$ a generalised Householder
# transformation. Bischof and Van Loan (1987, *The WY representation for products of Householder
# matrices*) wrote a product of reflections as the identity plus a product of two thin matrices,
# $W$ and $Y$, so that blocked QR factorisations could use matrix products; Schreiber and Van
# Loan (1989) found the compact form $I - Y \mathcal{T} Y^\top$ with a small triangular $\mathcal{T}$. Here the thin
# matrix is the keys themselves, and the next section finds $\mathcal{T}$. (Papers write the transposed
# state; the section on conventions below maps the two.)

# %% [markdown]
# ## The UT transform: all rows at once
#
# Move the sum in the recursion to the left-hand side. For every row $r$,
#
# $$
# \begin{gathered}
# y_r + \beta_r \sum_{i<r} (k_r \cdot k_i)\, y_i = \beta_r x_r \\
# \Longleftrightarrow\; \underbrace{\Big(I + \operatorname{tril}\big(\operatorname{diag}(\beta) K K^\top, -1\big)\Big)}_{A}\, Y = \operatorname{diag}(\beta)\, X ,
# \end{gathered}
# $$
#
# with $\operatorname{tril}(\cdot, -1)$ the strictly lower triangle: entry $(r, i)$ of $A$ is
# $\beta_r\, k_r \cdot k_i$ for $i < r$, ones on the diagonal, zeros above. So
#
# $$
# \begin{gathered}
# W = \mathcal{T} K, \\
# U = \mathcal{T} V, \\
# \mathcal{T} = A^{-1} \operatorname{diag}(\beta) = \Big(I + \operatorname{tril}\big(\operatorname{diag}(\beta) K K^\top, -1\big)\Big)^{-1} \operatorname{diag}(\beta).
# \end{gathered}
# $$
#
# $\mathcal{T}$ (a calligraphic T; plain $T$ is the sequence length) is the *UT transform* of the chunk (Yang et al. take the name from Joffrain et al., 2006,
# *Accumulating Householder transformations, revisited*). It is $C \times C$, lower triangular
# (token $r$ combines only tokens $\le r$), with $\beta$ on its diagonal, and it depends on the keys
# and write strengths only: the same $\mathcal{T}$ gives $W$ from $K$ and $U$ from $V$. `tinyk3.ops.wy`
# builds $A$ and $\mathcal{T}$:

# %%
tinyk3.notebook.show_source(wy.ut_matrix)

# %%
A = wy.ut_matrix(k, beta)  # I + tril(diag(β) K Kᵀ, −1)   [B, H, C, C]
T = wy.ut_transform(k, beta)  # A⁻¹ diag(β)                 [B, H, C, C]
W, U = wy.wy_factors(k, v, beta)  # 𝒯 K, 𝒯 V
print(f"max |T K - W from the recursion| = {max_diff(T @ k, W_loop):.1e}")
print(f"max |T V - U from the recursion| = {max_diff(T @ v, U_loop):.1e}")
print(f"T above its diagonal: max |entry| = {T.triu(1).abs().max():.1e}; "
      f"max |diagonal of T - β| = {max_diff(T.diagonal(dim1=-2, dim2=-1), beta):.1e}")

# %% [markdown]
# ## Build it: forward substitution, then blocks
#
# **The recursion is forward substitution.** Solving a lower-triangular system $A Y = R$ row by
# row, each row uses only the rows already solved:
#
# $$
# Y_r = R_r - \sum_{i<r} A_{ri}\, Y_i \qquad (A_{rr} = 1).
# $$
#
# With $A_{ri} = \beta_r\, k_r \cdot k_i$ and $R = \operatorname{diag}(\beta) X$ this is
# `wy_recursion` line for line. With $R = I$ it gives $A^{-1}$ itself, one row at a time; the
# first exercise asks you to write that function, and `tinyk3.ops.wy.forward_substitution` is
# the one the library uses. `wy.ut_transform` can take $A^{-1}$ three ways: a library triangular
# solve, forward substitution, or the block-wise inverse built below. All three against the
# explicit matrix inverse, for the chunk above and for a chunk of 100 tokens:

# %%
k100, _, beta100 = unit_chunk((2,), 100, 32, 1, seed=1)
for name, (k_, beta_) in (("C = 64 ", (k, beta)), ("C = 100", (k100, beta100))):
    # A⁻¹ diag(β), by a general matrix inverse
    T_inv = torch.linalg.inv(wy.ut_matrix(k_, beta_)) * beta_.unsqueeze(-2)
    dists = {m: max_diff(wy.ut_transform(k_, beta_, m), T_inv)
             for m in ("solve", "forward", "block")}
    print(f"{name}: max |T - inv(A) diag(β)|: "
          + ", ".join(f"{m} {d:.1e}" for m, d in dists.items()))

# %% [markdown]
# **Why kernels do not stop there.** Forward substitution of a $64 \times 64$ system is 63 steps,
# each waiting for the one before, and each is a vector operation. A GPU is fast at matrix
# products on tiles (tensor cores), so kernels restructure the inverse into small triangular
# solves plus matrix products. The tool is the inverse of a block lower-triangular matrix:
#
# $$
# \begin{pmatrix} A_{11} & 0 \\ A_{21} & A_{22} \end{pmatrix}^{-1}
# = \begin{pmatrix} A_{11}^{-1} & 0 \\ -A_{22}^{-1} A_{21} A_{11}^{-1} & A_{22}^{-1} \end{pmatrix}.
# $$
#
# (Multiply out: the lower-left block of $A X$ is $A_{21} A_{11}^{-1} + A_{22} X_{21}$, which must be
# zero.) The diagonal blocks of a unit lower-triangular matrix are unit lower triangular
# themselves, so they can be inverted the same way, independently and at the same time.
# `wy.block_inverse` inverts the $16 \times 16$ diagonal blocks by forward substitution and then
# merges neighbouring blocks with the formula, $16 \to 32 \to 64$:

# %%
tinyk3.notebook.show_source(wy.block_inverse)

# %%
for C_, blk in ((64, 16), (64, 4), (100, 16), (100, 1)):
    k_, _, beta_ = unit_chunk((2, 2), C_, 32, 1, seed=C_ + blk)
    A_ = wy.ut_matrix(k_, beta_)
    print(f"C = {C_:3d}, blocks of {blk:2d}: max |block_inverse(A) - inv(A)| = "
          f"{max_diff(wy.block_inverse(A_, blk), torch.linalg.inv(A_)):.1e}")

# %% [markdown]
# The kernel library `flash-linear-attention` (fla; its `solve_tril`, in the version we read)
# also inverts $16 \times 16$ diagonal blocks by forward substitution, but then fills in the rest
# of the $64 \times 64$ inverse with matrix products, one block diagonal after another (the blocks
# next to the diagonal first), from forward substitution with blocks for entries:
#
# $$
# X_{ii} = A_{ii}^{-1}, \qquad X_{ij} = -X_{ii} \sum_{m=j}^{i-1} A_{im} X_{mj} \quad (i > j).
# $$
#
# The block version, written from this equation, against the pairwise merges:

# %%
def block_rows_inverse(A, b=16):
    """X = A⁻¹ by block forward substitution with b × b blocks (C a multiple of b)."""
    n = A.shape[-1] // b
    blk = lambda M, i, j: M[..., i * b:(i + 1) * b, j * b:(j + 1) * b]  # noqa: E731
    X = torch.zeros_like(A)
    for i in range(n):
        X_ii = wy.forward_substitution(blk(A, i, i))  # a small triangular solve
        X[..., i * b:(i + 1) * b, i * b:(i + 1) * b] = X_ii
        for j in range(i):  # the block row: matrix products only
            acc = sum(blk(A, i, m) @ blk(X, m, j) for m in range(j, i))
            X[..., i * b:(i + 1) * b, j * b:(j + 1) * b] = -X_ii @ acc
    return X


A64 = wy.ut_matrix(k, beta)
dist = max_diff(block_rows_inverse(A64), wy.block_inverse(A64))
print(f"max |block rows - pairwise merges| = {dist:.1e}")

# %% [markdown]
# How much waiting each way does for one chunk, counting the steps that must run one after
# another (the small solves of different blocks run side by side):

# %% tags=["nbval-check-output"]
b = 16
print(f"{'C':>4s} {'forward substitution':>21s} {'16-blocks + pairwise merges':>28s} "
      f"{'16-blocks + block rows':>23s}")
for C_ in (64, 128):
    levels = int(math.log2(C_ // b))
    print(f"{C_:4d} {C_ - 1:>15d} steps {b - 1:>9d} + {levels:d} merge levels "
          f"{b - 1:>12d} + {C_ // b - 1} block rows")

# %% [markdown]
# ## Conventions: the papers, the blog and the kernels agree
#
# Three ways of writing the same $\mathcal{T}$ are in circulation. Each is written below in a few lines
# from its own equation, not from anyone's code.
#
# **Papers and the blog** (Yang et al., 2024, and Songlin Yang's blog post *DeltaNet Explained,
# Part II*) keep the state transposed, $S^{\text{p}} \in \mathbb{R}^{D_v \times D_k}$ with column
# vectors: $S^{\text{p}}_t = S^{\text{p}}_{t-1}(I - \beta_t k_t k_t^\top) + \beta_t v_t k_t^\top$.
# Their product of transitions runs the other way, later tokens on the **right**, and its WY
# form is $P^{\text{p}} = I - \sum_i w_i k_i^\top = I - W^\top K$, with the chunk update
# $S^{\text{p}}_{[1]} = S^{\text{p}}_0 + (U - W S^{\text{p}\top}_0)^\top K$. Their $\mathcal{T}$, $W$ and $U$ are
# ours (rows of $W$ and $U$ are tokens in both); only $P$ and $S$ are transposed.
#
# **The kernel library** (fla) splits the work into stages. The first computes the strictly
# lower $\tilde A = \operatorname{tril}(\operatorname{diag}(\beta) K K^\top, -1)$ of each chunk, the
# second returns $(I + \tilde A)^{-1}$ (its `solve_tril` is documented to take a strictly lower
# triangular matrix and return that inverse), and the third folds $\beta$ into the right-hand sides: $W = (I + \tilde A)^{-1}(\beta \odot K)$,
# $U = (I + \tilde A)^{-1}(\beta \odot V)$. Since $(I + \tilde A)^{-1}(\beta \odot K) = A^{-1}
# \operatorname{diag}(\beta) K$, this is $\mathcal{T} K$ again.
#
# **fla's reference implementation and an earlier version of its kernels** store the negated matrix
# $N = -\tilde A$ and invert $I - N$ in place, row by row: $Y_i = N_i + \sum_{m<i} N_{im} Y_m$ for
# the part below the diagonal, then add $I$.

# %%
def paper_layout_chunk(k, v, beta, S0_paper):
    """Papers' layout, from its equations.

    S ∈ R^{Dv×Dk}, later transitions on the right."""
    Dk_ = k.shape[-1]
    eye_k = torch.eye(Dk_, dtype=k.dtype)
    P_paper = eye_k.expand(*k.shape[:-2], Dk_, Dk_)
    for t in range(k.shape[-2]):
        k_col = k[..., t, :, None]  # a column vector  [..., Dk, 1]
        F_t = eye_k - beta[..., t, None, None] * k_col @ k_col.mT  # I − β_t k_t k_tᵀ
        P_paper = P_paper @ F_t  # later transitions on the right
    W_, U_ = wy.wy_factors(k, v, beta)  # the same 𝒯, W, U
    # S_0 + (U − W S_0ᵀ)ᵀ K   [..., Dv, Dk]
    S_C = S0_paper + (U_ - W_ @ S0_paper.mT).mT @ k
    return P_paper, W_, S_C


def fla_style_T(k, beta):
    """Strictly lower Ã, then (I + Ã)⁻¹; β goes into the right-hand sides:
    W = (I + Ã)⁻¹ (β ⊙ K)."""
    A_strict = (beta[..., :, None] * (k @ k.mT)).tril(-1)
    eye_C = torch.eye(k.shape[-2], dtype=k.dtype).expand_as(A_strict)
    Ai = torch.linalg.solve_triangular(eye_C + A_strict, eye_C, upper=False,
                                       unitriangular=True)
    return Ai * beta[..., None, :]  # so that 𝒯 K = Ai (β ⊙ K)


def negated_in_place_T(k, beta):
    """N = −Ã; rows Y_i = N_i + Σ_{m<i} N_im Y_m below the diagonal;
    then I + Y = (I − N)⁻¹."""
    Y = -(beta[..., :, None] * (k @ k.mT)).tril(-1)
    for i in range(1, k.shape[-2]):
        Y[..., i, :i] = Y[..., i, :i] + (Y[..., i, :i, None] * Y[..., :i, :i]).sum(-2)
    return (Y + torch.eye(k.shape[-2], dtype=k.dtype)) * beta[..., None, :]


P_paper, W_paper, S_C_paper = paper_layout_chunk(k, v, beta, S0.mT)
eye = torch.eye(Dk, dtype=torch.float64)
d_wy = max_diff(P_paper, eye - W_paper.mT @ k)
d_state = max_diff(S_C_paper, S_delta.mT)
d_stages = max_diff(fla_style_T(k, beta), T)
d_negated = max_diff(negated_in_place_T(k, beta), T)
print(f"papers: max |P^p - (I - Wᵀ K)|           = {d_wy:.1e}")
print(f"papers: max |P^p - our P transposed|      = {max_diff(P_paper, P.mT):.1e}")
print(f"papers: max |S^p_[1] - our S_[1] transposed| = {d_state:.1e}")
print(f"kernel stages: max |T - ours|             = {d_stages:.1e}")
print(f"negated, in place: max |T - ours|         = {d_negated:.1e}")

# %% [markdown]
# **A sign to watch.** The sign in front of the strictly lower part is easy to lose between these
# forms, because some code stores $\tilde A$ and some stores $-\tilde A$. fla's reference
# implementation carries the comment "compute (I - tri(diag(beta) KK^T))^{-1}" above code that
# computes $(I + \operatorname{tril}(\operatorname{diag}(\beta) K K^\top, -1))^{-1}$ from the negated
# matrix (the comment describes what is stored, not what is inverted), and a reader reported
# (fla issue 191) that the Gated DeltaNet paper prints $(I - \ldots)^{-1}$ where the DeltaNet paper
# has $(I + \ldots)^{-1}$. Read literally, the minus sign gives another matrix, and the product it
# implies is not the chunk's:

# %%
A_minus = torch.eye(C, dtype=torch.float64) - (beta[..., :, None] * (k @ k.mT)).tril(-1)
T_minus = torch.linalg.inv(A_minus) * beta[..., None, :]
P_minus = torch.eye(Dk, dtype=torch.float64) - k.mT @ (T_minus @ k)
print(f"(I - tril(...))⁻¹ diag(β): max |T - ours| = {max_diff(T_minus, T):.2f}, "
      f"max |I - Kᵀ T K - F_C ⋯ F_1| = {max_diff(P_minus, P):.2f}")
print(f"(I + tril(...))⁻¹ diag(β): max |I - Kᵀ T K - F_C ⋯ F_1| = "
      f"{max_diff(torch.eye(Dk, dtype=torch.float64) - k.mT @ (T @ k), P):.1e}")

# %% [markdown]
# ## Conditioning: how hard is the triangular solve?
#
# A triangular solve in float32 is only as good as the matrix allows. Two questions: how large
# can $\mathcal{T}$ get, and how much does rounding move it?
#
# **A bound from the recurrence.** Take one column of $\mathcal{T}$. Since $U = \mathcal{T} V$, column $j$ of $\mathcal{T}$ is the
# vector of corrections $u_1, \dots, u_C$ of a chunk that starts from $S_0 = 0$ with a single value
# channel ($D_v = 1$) in which only token $j$ writes, $v_j = 1$. Before token $j$ nothing is
# written, so $u_i = 0$; token $j$ writes $u_j = \beta_j$ and leaves the state $\beta_j k_j^\top$, of
# norm $\beta_j$ for a unit key. Every later token only applies its transition
# $I - \beta_i k_i^\top k_i$, whose eigenvalues are 1 and $1 - \beta_i\|k_i\|^2$ (chapter 5), so the
# state never grows when $\|k_i\| = 1$ and $0 \le \beta_i \le 2$, and token $i$'s correction
# $u_i = -\beta_i k_i S_{i-1}$ is at most $\beta_i \beta_j$ in size. Hence, for unit keys and
# $\beta \in [0, 2]$, whatever the directions of the keys:
#
# $$
# |\mathcal{T}_{ij}| \le \beta_i \beta_j \ (i > j), \qquad \mathcal{T}_{jj} = \beta_j, \qquad
# |(A^{-1})_{ij}| = |\mathcal{T}_{ij}| / \beta_j \le \beta_i .
# $$
#
# With $\beta \le 1$ every entry of $A$ and of $A^{-1}$ is at most 1 in size, so the condition
# number in the $\infty$-norm is at most $\kappa_\infty(A) = \|A\|_\infty \|A^{-1}\|_\infty \le C \cdot C = C^2$,
# where $\|A\|_\infty = \max_i \sum_j |A_{ij}|$ is the largest absolute row sum. The sweep below
# reports the more common $\kappa_2(A) = \sigma_{\max}(A) / \sigma_{\min}(A)$, the ratio of the largest
# to the smallest singular value (`conditioning.condition_number`); a rounding error of relative
# size $\epsilon$ in $A$ can move the solution by up to about $\kappa_2(A)\,\epsilon$, and for a
# $C \times C$ matrix $\kappa_2 \le C \kappa_\infty$. Without normalised keys
# nothing of this holds: once $\beta_i \|k_i\|^2 > 2$ a transition amplifies the state along its key,
# and $\mathcal{T}$ can grow geometrically along the chunk. (DeltaNet uses $\beta \in (0, 1)$; Grazzi et al.,
# 2025, *Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues*, extend it to
# $(0, 2)$, which the bound still covers.)
#
# `tinyk3.conditioning` makes test keys of three kinds: **unit** (random directions, normalised,
# as DeltaNet's keys are), **correlated** (unit keys that share one direction, any two with
# cosine about 0.9: nearly parallel keys are the hard case for a Gram matrix) and **raw**
# (standard Gaussian entries, not normalised, so $\|k\|^2 \approx D_k$). First the bound, as the
# largest ratio $|\mathcal{T}_{ij}| / (\beta_i \beta_j)$ below the diagonal over 16 random chunks of 128 tokens
# with $D_k = 64$ and $\beta$ uniform up to the value shown:

# %%
g = torch.Generator().manual_seed(7)
print(f"{'keys':>11s} {'β up to':>8s} {'max |T_ij| / (β_i β_j)':>24s} {'max |T|':>10s}")
for kind in ("unit", "correlated", "raw"):
    keys_ = conditioning.chunk_keys(kind, 16, 128, 64, generator=g)
    for beta_max in (1.0, 2.0):
        b_ = beta_max * torch.rand(16, 128, generator=g, dtype=torch.float64)
        T_ = wy.ut_transform(keys_, b_)
        ratio = (T_.tril(-1).abs() / (b_[:, :, None] * b_[:, None, :])).tril(-1)
        print(f"{kind:>11s} {beta_max:8.1f} {ratio.max():24.3g} {T_.abs().max():10.3g}")

# %% [markdown]
# The bound holds for unit and correlated keys at both ranges of $\beta$; for raw keys $\mathcal{T}$ is
# astronomically large. Now the sweep. For each kind of key, chunk size $C$ from 16 to 256 and a
# constant write strength $\beta$ from 0.1 to 2, over 16 random chunks with $D_k = 128$ (the head
# size of Kimi Linear's KDA layers): the condition number $\kappa_2(A)$, the largest
# entry of $\mathcal{T}$, and the relative error $\max|\mathcal{T}_{32} - \mathcal{T}| / \max|\mathcal{T}|$ of $\mathcal{T}$ computed in float32
# from keys stored in float32, against $\mathcal{T}$ in float64 from the exact keys
# (`conditioning.ut_precision`). The cell prints its time.

# %%
t0 = time.perf_counter()
KINDS = ("unit", "correlated", "raw")
g = torch.Generator().manual_seed(8)
sweep = {}  # (kind, C, β) -> medians over the chunks
for kind in KINDS:
    for C_ in CHUNK_SIZES:
        keys_ = conditioning.chunk_keys(kind, N_CHUNKS, C_, 128, generator=g)
        for b in BETAS:
            betas_ = torch.full((N_CHUNKS, C_), b, dtype=torch.float64)  # constant β
            r = conditioning.ut_precision(keys_, betas_)
            sweep[kind, C_, b] = dict(
                cond=r.cond.median().item(), t_max=r.t_max.median().item(),
                error=r.error.nan_to_num(nan=math.inf).median().item())
print(f"{len(sweep)} points in {time.perf_counter() - t0:.1f} s")

# %% mystnb={"figure": {"caption": "Median condition number $\\kappa_2(A)$ of the UT system over random chunks with $D_k = 128$, against the chunk size $C$ and the write strength $\\beta$, one panel per kind of key, each with its own colour scale: small for unit keys, growing polynomially with $C$ and $\\beta$ for correlated keys, and astronomically large for raw keys ($10^{17}$ to $10^{19}$) except in the smallest chunks at small $\\beta$.", "name": "fig-wy-sweep-condition"}, "image": {"alt": "Three heat maps stacked vertically, for unit, correlated and raw keys, each with chunk size from 16 to 256 on the vertical axis, beta from 0.1 to 2 on the horizontal axis and its own colour bar; every cell is coloured by the logarithm of the condition number and labelled with its value: single digits to tens for unit keys, up to a few thousand for correlated keys, and from about 1e17 to 1e19 over most of the raw-key panel, smaller, down to about 1000, only in its lower left corner of small chunks and small beta."}}
def label_of(x):
    if not np.isfinite(x):
        return "inf"
    if x >= 1e4 or x < 1e-2:
        return f"{x:.0e}".replace("e-0", "e-").replace("e+0", "e+")
    return f"{x:.0f}" if x >= 100 else f"{x:.2g}"


def plot_sweep(metric, title):
    """A heat map per kind of key: log10 of `metric` over C and β, values written in;
    each panel has its own colour scale and colourbar (inf drawn at the panel's top)."""
    fig, axes = plt.subplots(len(KINDS), 1, figsize=(6.6, 7.6), sharex=True,
                             layout="constrained")
    for ax, kind in zip(axes, KINDS):
        grid = np.array([[sweep[kind, C_, b][metric] for b in BETAS]
                         for C_ in CHUNK_SIZES])
        finite = np.log10(np.clip(grid[np.isfinite(grid)], 1e-12, None))
        lo, hi = finite.min(), finite.max()
        hi = max(hi, lo + 1)  # at least one decade of colour
        shown = np.log10(np.clip(np.nan_to_num(grid, posinf=10**hi), 1e-12, None))
        im = ax.imshow(shown, origin="lower", aspect="auto", cmap="viridis",
                       vmin=lo, vmax=hi)
        for i in range(len(CHUNK_SIZES)):
            for j in range(len(BETAS)):
                color = "white" if shown[i, j] < (lo + hi) / 2 else "black"
                ax.text(j, i, label_of(grid[i, j]), ha="center", va="center",
                        fontsize=9, color=color)
        ax.set_xticks(range(len(BETAS)), [str(b) for b in BETAS])
        ax.set_yticks(range(len(CHUNK_SIZES)), [str(c) for c in CHUNK_SIZES])
        ax.set(ylabel="chunk size C", title=f"{kind} keys: {title}")
        ax.grid(False)
        fig.colorbar(im, ax=ax, label="log10", pad=0.02)
    axes[-1].set_xlabel("β")
    plt.show()


plot_sweep("cond", "κ₂(A)")

# %% mystnb={"figure": {"caption": "Median relative error of $\\mathcal{T}$ computed in float32 from keys stored in float32, against $\\mathcal{T}$ in float64, over the same sweep: from $10^{-8}$ to $10^{-6}$ for unit keys (about $10^{-7}$ at $\\beta = 1$), up to about $10^{-5}$ for correlated keys, and overflow (inf) for raw keys once $C \\beta$ is moderate.", "name": "fig-wy-sweep-float32-error"}, "image": {"alt": "Three heat maps stacked vertically, for unit, correlated and raw keys, each with chunk size on the vertical axis, beta on the horizontal axis and its own colour bar; every cell is coloured by the logarithm of the float32 error of the UT matrix and labelled with its value: between 1e-8 and 1e-6 for unit keys, up to about 1e-5 for correlated keys, and for raw keys about 1e-6 in the smallest chunks but inf over most of the upper right."}}
plot_sweep("error", "float32 error of the UT matrix")

# %% [markdown]
# The numbers at the chunk size kernels use, $C = 64$, with $\beta = 1$, and at the largest chunk of
# the sweep; then, for each kind of key, the largest $\kappa_2(A)$ and float32 error over the whole
# sweep, separately for $\beta \le 1$ and for all $\beta$ up to 2:

# %%
C_big = max(CHUNK_SIZES)
for C_ in sorted({64, C_big} & set(CHUNK_SIZES)):
    for kind in KINDS:
        s = sweep[kind, C_, 1.0]
        print(f"C = {C_:3d}, β = 1, {kind:>10s} keys: κ₂(A) = {s['cond']:9.3g}, "
              f"max |T| = {s['t_max']:9.3g}, float32 error of T = {s['error']:.1e}")
print()
for kind in KINDS:
    parts = []
    for label, bs in (("β ≤ 1", [b for b in BETAS if b <= 1]), ("β ≤ 2", BETAS)):
        pts = [sweep[kind, C_, b] for C_ in CHUNK_SIZES for b in bs]
        finite = [p["error"] for p in pts if math.isfinite(p["error"])]
        worst_cond = max(p["cond"] for p in pts)
        n_overflow = len(pts) - len(finite)
        parts.append(f"{label}: κ₂ ≤ {worst_cond:8.2g}, error ≤ {max(finite):.0e}, "
                     f"overflow at {n_overflow:2d} of {len(pts)} points")
    print(f"{kind:>10s} keys, C ≤ {C_big}:  " + ";  ".join(parts))

# %% [markdown]
# What the sweep shows:
#
# - **Unit keys make the solve easy.** For $\beta \le 1$, $\kappa_2(A)$ stays below 10 and $\mathcal{T}$ comes out
#   of float32 with a relative error of a few times $10^{-7}$ at most, at every chunk size up to
#   256; even at $\beta = 2$ the condition number stays below 50 and the error is about
#   $10^{-6}$ at most. The largest entry of $\mathcal{T}$ is $\beta$ itself, on the diagonal, as the bound says. The bound
#   $\kappa_\infty \le C^2$ is far from reached: the measured $\kappa_2$ grows slowly with $C$ and $\beta$.
# - **Correlated keys are harder, but only polynomially.** Nearly parallel keys make the Gram
#   matrix nearly singular; $\kappa_2(A)$ grows with $C$ and $\beta$, to a few hundred at $\beta = 1$ and a
#   few thousand at $\beta = 2$, and the float32 error grows with it, to about $10^{-6}$ and
#   $10^{-5}$. The bound keeps $\mathcal{T}$ itself small.
# - **Raw keys break it.** With $\|k\|^2 \approx 128$ every transition amplifies the state along its
#   key, $\mathcal{T}$ grows geometrically with $C$, and from moderate $C\beta$ on it overflows float32
#   ("inf" in the raw-key panel of the second figure) while $\kappa_2(A)$ saturates at $10^{18}$ to $10^{19}$, where float64 itself
#   can no longer resolve it. The chunked form cannot rescue such keys: the recurrence itself is
#   unstable for them (chapter 5's norm experiment).
#
# **bfloat16 keys.** Kernels read the keys in bfloat16 and do the solve in float32. The rounding
# of the keys then sets the accuracy of $\mathcal{T}$, not the solve; at $C = 64$, $\beta = 1$:

# %%
g = torch.Generator().manual_seed(9)
for kind in ("unit", "correlated"):
    keys_ = conditioning.chunk_keys(kind, N_CHUNKS, 64, 128, generator=g)
    ones_ = torch.ones(N_CHUNKS, 64, dtype=torch.float64)
    line = []
    key_dtypes = (("float32 keys", {}),
                  ("bfloat16 keys", dict(input_dtype=torch.bfloat16)))
    for label, kwargs in key_dtypes:
        errs = {}
        for m in ("solve", "forward", "block"):
            r = conditioning.ut_precision(keys_, ones_, method=m, **kwargs)
            errs[m] = r.error.median().item()
        line.append(f"{label}: " + ", ".join(f"{m} {e:.1e}" for m, e in errs.items()))
    print(f"{kind:>10s} keys, float32 solve ({'; '.join(line)})")

# %% [markdown]
# The three ways of inverting agree to the same accuracy, and keys stored in bfloat16 move $\mathcal{T}$
# by about $10^{-3}$, three to four orders of magnitude more than the float32 arithmetic does.
#
# **So why do kernels use $C = 64$, and 16-row sub-blocks?** Not because the solve becomes
# ill-conditioned for larger chunks: with unit keys it does not (the sweep goes to 256). The
# reasons are cost and hardware. Per token, the work inside a chunk grows with $C$ (the
# $C \times C$ matrices $A$ and $Q K^\top$, chapters 6 and 8), while the sequential pass over
# chunks shrinks as $T/C$; GPU kernels settle on 64 (or 128), sizes that fill the tensor cores'
# tiles. Inside the chunk, the 16-row sub-blocks keep the part of the solve that is truly
# sequential to 15 steps and turn the rest into products of $16 \times 16$ tiles, whose inner
# dimension, 16, is the smallest Triton's matrix product accepts for 16- and 32-bit inputs on
# NVIDIA GPUs (Triton 3.7). Chapter 11 meets a numerical reason for 16-token sub-chunks: Kimi Delta Attention's
# gates put $\exp$ of cumulative decays into $A$, and over 64 tokens those overflow float32.
#
# **Normalised keys and $\beta \le 1$ (or 2)** are exactly the hypotheses of the bound: with them
# every entry of $\mathcal{T}$ is at most 1 (for $\beta \le 1$) and the float32 solve was accurate at
# every chunk size measured; without them $\mathcal{T}$ can overflow within one chunk.

# %% [markdown]
# ## Experiment: the WY form against the direct ways of forming $P$
#
# One chunk of $C = 64$ tokens, head size $D = D_k = D_v$ from 16 to 256, for a batch of 8
# chunks; four ways, with their flop counts:
#
# 1. **Dense products** $F_C \cdots F_1$: $C$ products of $D \times D$ matrices
#    (`wy.transition_product`), $2 C D^3$.
# 2. **Rank-one updates** $P \leftarrow P - \beta_t k_t^\top (k_t P)$, one per token: $4 D^2$ per
#    token, $4 C D^2$ per chunk, in $C$ dependent steps. This is the honest baseline.
# 3. **The WY form of $P$**: $A$ from $K K^\top$ ($2C^2D$), the triangular solve ($C^3/3$),
#    $W = \mathcal{T} K$ ($C^2 D$, $\mathcal{T}$ is triangular), then $I - K^\top W$ ($2 C D^2$).
# 4. **The WY factors alone**, $\mathcal{T}$, $W$ and $U$ ($2C^2D + C^3/3 + 2C^2D$): what
#    chunkwise DeltaNet needs, since it applies $P$ as $S_0 - K^\top (W S_0)$ and never forms it.
#
# Each time is the median of several runs after a warm-up (`tinyk3.timing`), with the quartiles.

# %%
def rank_one_P(k, beta):
    """P = F_C ⋯ F_1 by C rank-one updates P ← P − β_t k_tᵀ (k_t P): 4D² per token."""
    D = k.shape[-1]
    P = torch.eye(D, dtype=k.dtype).expand(*k.shape[:-2], D, D)
    for t in range(k.shape[-2]):
        k_t = k[..., t : t + 1, :]  # [..., 1, D]
        P = P - (beta[..., t, None, None] * k_t.mT) @ (k_t @ P)  # k_t P: [..., 1, D]
    return P


def wy_P(k, beta):
    W_ = wy.ut_transform(k, beta) @ k  # W = 𝒯 K
    return torch.eye(k.shape[-1]) - k.mT @ W_  # I − Kᵀ W


def flops(method, C, D):
    if method == "dense products":
        return 2 * C * D**3
    if method == "rank-one updates":
        return 4 * C * D**2
    if method == "WY form of P":
        return 2 * C**2 * D + C**3 / 3 + C**2 * D + 2 * C * D**2
    return 2 * C**2 * D + C**3 / 3 + 2 * C**2 * D  # 𝒯, W and U


N_TIMED, C_TIMED = 8, 64
METHODS = ("dense products", "rank-one updates", "WY form of P", "WY factors 𝒯, W, U")
timings = {m: [] for m in METHODS}
print(bench.stamp())
print("ms for the batch: median (first-third quartile)")
for D in TIMING_DIMS:
    k_, v_, beta_ = unit_chunk((N_TIMED,), C_TIMED, D, D, seed=D, dtype=torch.float32)
    P_ref = wy.transition_product(k_, beta_)
    dist = max(max_diff(P_ref, wy_P(k_, beta_)), max_diff(P_ref, rank_one_P(k_, beta_)))
    forms = {"dense products": partial(wy.transition_product, k_, beta_),
             "rank-one updates": partial(rank_one_P, k_, beta_),
             "WY form of P": partial(wy_P, k_, beta_),
             "WY factors 𝒯, W, U": partial(wy.wy_factors, k_, v_, beta_)}
    for m, fn in forms.items():
        timings[m].append(time_fn(fn, repeats=TIMING_REPEATS, max_seconds=2.0))
    r1, wyp = timings["rank-one updates"][-1], timings["WY form of P"][-1]
    verdict = (f"{r1 / wyp:.1f}x the WY form of P" if distinguishable(r1, wyp)
               else "within the spread of the WY form of P")
    print(f"D = {D} (max |P by each way - dense P| = {dist:.1e}, float32):")
    for m in METHODS:
        t = timings[m][-1]
        print(f"  {m:>19s} {t.ms(2):>24s}")
    print(f"  rank-one updates: {verdict}")

# %% mystnb={"figure": {"caption": "Top: median time (bars: first to third quartile) of the dense product of transitions, of the rank-one updates, of the WY form of $P$ and of the WY factors alone, for a batch of chunks of $C = 64$ tokens, against the head size $D$. Bottom: the dense products' and the rank-one updates' time over the WY form's, measured (solid) and as the flop counts predict (dashed).", "name": "fig-wy-explicit-vs-wy-time"}, "image": {"alt": "Two stacked log-log line plots against head size D from 16 to 256. Top: milliseconds per batch of chunks for four ways, each point with a bar from the first to the third quartile; the dense products rise steeply with D, to over a hundred milliseconds at 256, the rank-one updates more slowly, and both WY lines stay lowest, near a millisecond. Bottom: the dense products' time and the rank-one updates' time divided by the WY form's, solid, with dashed lines for the ratios of their flop counts; the dense products' ratio grows with D like its flop-count line, within a small factor of it, while the rank-one updates' ratio stays well above one, about three times or more, although its flop-count line stays below one or near it (one is marked by a horizontal line)."}}
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.8, 6.6), sharex=True)
for m, marker in zip(METHODS, "osD^"):
    med = np.array([float(t) for t in timings[m]]) * 1e3
    err = np.array([[float(t) - t.low, t.high - float(t)] for t in timings[m]]).T * 1e3
    label = m.replace("𝒯", r"$\mathcal{T}$")  # mathtext: the font lacks the glyph
    ax1.errorbar(TIMING_DIMS, med, yerr=err, fmt=marker + "-", capsize=2, label=label)
ax1.set(xscale="log", yscale="log", ylabel=f"ms for {N_TIMED} chunks of C = {C_TIMED}",
        title="Time per batch of chunks (median, quartiles)")
ax1.legend(loc="upper left", fontsize=8)
ratios = {}
for m, color in (("dense products", "C0"), ("rank-one updates", "C1")):
    ratios[m] = [a / b for a, b in zip(timings[m], timings["WY form of P"])]
    model = [flops(m, C_TIMED, D) / flops("WY form of P", C_TIMED, D)
             for D in TIMING_DIMS]
    ax2.plot(TIMING_DIMS, ratios[m], "o-", color=color, label=f"{m}, measured")
    ax2.plot(TIMING_DIMS, model, "--", color=color, label=f"{m}, flop count")
ax2.axhline(1.0, color="k", lw=0.8)
ax2.set(xscale="log", yscale="log", xlabel="head size D",
        ylabel="time / WY form of P", title="Against the WY form of P")
ax2.legend(loc="upper left", fontsize=8)
for ax in (ax1, ax2):
    ax.set_xticks(TIMING_DIMS, [str(d) for d in TIMING_DIMS])
    ax.minorticks_off()
plt.tight_layout()
plt.show()

print(f"{'D':>4s} {'dense / WY P':>13s} {'rank-one / WY P':>16s} "
      f"{'rank-one flops / WY P flops':>28s} {'rank-one GFLOP/s':>17s}")
for i, D in enumerate(TIMING_DIMS):
    r1 = timings["rank-one updates"][i]
    rate = N_TIMED * flops("rank-one updates", C_TIMED, D) / r1 / 1e9
    count = flops("rank-one updates", C_TIMED, D) / flops("WY form of P", C_TIMED, D)
    print(f"{D:4d} {ratios['dense products'][i]:13.1f} "
          f"{ratios['rank-one updates'][i]:16.1f} {count:28.2f} {rate:17.2f}")

# %% [markdown]
# What the table and the figure show:
#
# - **The dense products are the strawman.** Their count grows as $D^3$, and their time with it
#   once $D$ is large; at small $D$ the 64 calls' fixed costs dominate.
# - **The rank-one updates do about as much arithmetic as the WY form, or less** (the flop-count
#   column: $4CD^2$ against $2CD^2 + 3C^2D + C^3/3$, less up to $D = C$, somewhat more beyond), yet
#   take about three times longer or more at every $D$ (the verdict lines): $C$ dependent
#   vector-times-matrix steps run at a small fraction of the rate of a large matrix product (last
#   column, against chapter 6's first table) and pay a call each, where the WY form is a few
#   chunk-wide products.
# - **The factors alone cost less still as $D$ grows**: chunkwise DeltaNet needs only
#   $\mathcal{T}$, $W$ and $U$, $O(C^2 D)$ per chunk, and the state enters through $W S_0$ and
#   $K^\top(\cdot)$ in the sequential pass, chapter 8's subject.
#
# So the WY form's gain is not a smaller flop count than the rank-one chain (only somewhat
# smaller, at the largest $D$, against a time about three or more times shorter). It is the shape of
# the work: (1) no $D_k \times D_k$ matrix per chunk, only $W$ and $U$, $C \times D$ each; (2) the
# work inside a chunk is a few products of $C \times C$ and $C \times D$ matrices, the shapes that
# tensor cores run, instead of $C$ dependent rank-one steps; (3) every chunk's factors depend on
# that chunk alone, so all chunks are computed at once, and only the cheap pass that carries the
# state through them is sequential.

# %% [markdown]
# ## Exercises
#
# ```{exercise} Forward substitution
# :label: ex-forward-substitution
#
# Write `forward_substitution(A)`: the inverse of a unit lower-triangular matrix `A`
# (`[..., C, C]`, ones on the diagonal, zeros above it), computed row by row from
# $X_i = e_i - \sum_{j<i} A_{ij} X_j$, where $e_i$ is row $i$ of the identity. Return `[..., C, C]`
# in the input's dtype. (A library inverse would pass the check too; the point is to write the
# substitution.)
# ```

# %%
def forward_substitution_mine(A):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("wy.forward_substitution", forward_substitution_mine)

# %% [markdown]
# ```{solution-start} ex-forward-substitution
# :class: dropdown
# ```

# %%
def forward_substitution_solution(A):
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype)
    X = torch.zeros_like(A)  # [..., C, C]
    for i in range(C):
        # X_i = e_i − Σ_{j<i} A_ij X_j: only rows that are already finished
        X[..., i, :] = eye[i] - (A[..., i, None, :i] @ X[..., :i, :]).squeeze(-2)
    return X


ok = checks.run("wy.forward_substitution", forward_substitution_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} Merge two block inverses
# :label: ex-merge-block-inverse
#
# Write `merge_block_inverse(A11_inv, A21, A22_inv)`. A unit lower-triangular matrix is split
# into blocks $\begin{pmatrix} A_{11} & 0 \\ A_{21} & A_{22}\end{pmatrix}$ with $A_{11}$ of size
# $m \times m$ and $A_{22}$ of size $n \times n$; you are given the inverses of the two diagonal
# blocks (`[..., m, m]` and `[..., n, n]`) and the lower-left block `A21` (`[..., n, m]`). Return
# the inverse of the whole matrix, `[..., m + n, m + n]`. The cases include blocks of different
# sizes.
# ```

# %%
def merge_block_inverse_mine(A11_inv, A21, A22_inv):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("wy.merge_block_inverse", merge_block_inverse_mine)

# %% [markdown]
# ```{solution-start} ex-merge-block-inverse
# :class: dropdown
# ```

# %%
def merge_block_inverse_solution(A11_inv, A21, A22_inv):
    m, n = A11_inv.shape[-1], A22_inv.shape[-1]
    # the upper-right block stays 0
    X = A11_inv.new_zeros(*A11_inv.shape[:-2], m + n, m + n)
    X[..., :m, :m] = A11_inv
    X[..., m:, m:] = A22_inv
    X[..., m:, :m] = -A22_inv @ A21 @ A11_inv  # [n, n] [n, m] [m, m]
    return X


ok = checks.run("wy.merge_block_inverse", merge_block_inverse_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The WY factors of a chunk
# :label: ex-wy-factors
#
# Write `wy_factors(k, v, beta)`: for a chunk with keys `k` (`[..., C, Dk]`), values `v`
# (`[..., C, Dv]`) and write strengths `beta` (`[..., C]`), return `(W, U)` with $W = \mathcal{T} K$, $U = \mathcal{T} V$
# and $\mathcal{T} = \big(I + \operatorname{tril}(\operatorname{diag}(\beta) K K^\top, -1)\big)^{-1}
# \operatorname{diag}(\beta)$, using matrix operations (no loop over tokens). Use `k` as given:
# some cases have keys that are not of unit length.
# ```

# %%
def wy_factors_mine(k, v, beta):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("wy.wy_factors", wy_factors_mine)

# %% [markdown]
# ```{solution-start} ex-wy-factors
# :class: dropdown
# ```

# %%
def wy_factors_solution(k, v, beta):
    C = k.shape[-2]
    eye = torch.eye(C, dtype=k.dtype)
    # I + tril(diag(β) K Kᵀ, −1): row r scaled by β_r   [..., C, C]
    A = eye + (beta[..., :, None] * (k @ k.mT)).tril(-1)
    A_inv = torch.linalg.solve_triangular(A, eye.expand_as(A), upper=False,
                                          unitriangular=True)
    T = A_inv * beta[..., None, :]  # A⁻¹ diag(β): column j scaled by β_j   [..., C, C]
    return T @ k, T @ v


ok = checks.run("wy.wy_factors", wy_factors_solution)

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - A chunk of $C$ delta-rule steps is an affine map of the state,
#   $S_{[1]} = P S_0 + H$ with $P = F_C \cdots F_1$, $F_t = I - \beta_t k_t^\top k_t$ (later tokens on the
#   left in our layout). Its writes cannot be summed independently; $P$ is a dense
#   $D_k \times D_k$ matrix, $4 C D_k^2$ flops per chunk by rank-one updates in $C$ dependent steps.
# - **WY representation:** $P = I - K^\top W$, proved by induction, with rows
#   $w_r = \beta_r (k_r - \sum_{i<r} (k_r \cdot k_i) w_i)$; the writes are $H = K^\top U$ with the same
#   recursion on $V$; so $S_{[1]} = S_0 + K^\top(U - W S_0)$, and $U - W S_0$ are the tokens' corrections.
# - **UT transform:** $\mathcal{T} = (I + \operatorname{tril}(\operatorname{diag}(\beta) K K^\top, -1))^{-1}
#   \operatorname{diag}(\beta)$, $W = \mathcal{T} K$, $U = \mathcal{T} V$. The recursion is forward substitution of
#   this unit lower-triangular system; kernels invert $16 \times 16$ diagonal blocks and merge them
#   with $[[A_{11}, 0], [A_{21}, A_{22}]]^{-1} = [[A_{11}^{-1}, 0], [-A_{22}^{-1} A_{21} A_{11}^{-1}, A_{22}^{-1}]]$.
# - The papers' transposed layout ($P^{\text{p}} = I - W^\top K$), the kernels' staged form
#   ($(I + \tilde A)^{-1}$ applied to $\beta \odot K$) and the negated in-place form all give the same
#   $\mathcal{T}$; the minus sign $(I - \ldots)^{-1}$ seen in print does not.
# - For unit keys and $\beta \le 2$, $|\mathcal{T}_{ij}| \le \beta_i \beta_j$ whatever the key directions; with
#   $\beta \le 1$ the entries of $A$ and $A^{-1}$ are at most 1, and the float32 solve was accurate to a
#   few times $10^{-7}$ up to $C = 256$ (nearly parallel keys: about $10^{-6}$); raw keys overflow. Bfloat16 keys, not the solve, limit the accuracy of $\mathcal{T}$ in a
#   kernel. Chunk size 64 is a choice of cost and hardware, not of conditioning.
# - The WY form does about as much arithmetic as the rank-one chain (more at small $D$, somewhat
#   less at the largest) and was about three times faster or more at every head size timed (the
#   timing table), its work being a few chunk-wide products instead of $C$ dependent steps; what
#   it buys is no $D_k \times D_k$ matrix per chunk, chunk-wide matrix products that tensor cores
#   run, and chunks computed independently. Chunkwise DeltaNet never forms $P$.
#
# **Next.** Chapter 8 puts the pieces together: compute $\mathcal{T}$, $W$ and $U$ for every chunk at once,
# then one pass over the chunks with $U' = U - W S$, $O = Q S + (Q K^\top \odot M)\, U'$ and
# $S \leftarrow S + K^\top U'$, and checks it against the token loop.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
