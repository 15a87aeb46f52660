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
# # Chunkwise DeltaNet
#
# Chapter 5 left DeltaNet with two exact forms and no good one: the token loop, $T$ dependent
# steps of tiny products, and the parallel form, one triangular system over the whole sequence,
# with $T \times T$ matrices. Chapter 6 resolved the same dilemma for linear attention by cutting
# the sequence into chunks, and chapter 7 found the closed form of a chunk of delta-rule steps:
# $S_{[1]} = S_0 + K^\top (U - W S_0)$, with $W = \mathcal{T} K$ and $U = \mathcal{T} V$ from the UT
# matrix $\mathcal{T}$. This
# chapter puts the two together into the algorithm of Yang et al. (2024, *Parallelizing Linear
# Transformers with the Delta Rule over Sequence Length*), the one DeltaNet, Gated DeltaNet and
# Kimi's KDA are trained with: per chunk, the true deltas $U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}$, the outputs
# $O_{[c]} = Q_{[c]} S_{[c]} + (Q_{[c]} K_{[c]}^\top \odot M)\, U'_{[c]}$ and the next state $S_{[c+1]} = S_{[c]} + K_{[c]}^\top U'_{[c]}$.
# Everything but a short pass over the chunks runs in parallel.
#
# **In this chapter** you derive the chunk algorithm from chapter 7's closed form and see why it
# is exact (each row of $U'_{[c]}$ is a delta the token loop writes, checked against its recorded
# deltas); build one chunk step in front of you; see that $C = 1$ is the recurrence and $C = T$
# the parallel form; read the lib's version, which computes every chunk at once except a
# sequential state pass of two matrix products per chunk; check it against the token loop in
# float64, in float32 at $T = 8192$, by `gradcheck`, and against the papers' transposed layout;
# count its flops; and time it against $T$ and $C$, against the token loop, and as a fraction of
# the machine's matrix-product rate.
#
# **Cost.** Under a minute on one CPU core, most of it in the timing experiment
# (the last cell prints the time); `SMOKE = True` runs in a few seconds.

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
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tinyk3 import bench, checks, cost
from tinyk3.ops import delta_rule, wy
from tinyk3.timing import distinguishable, time_fn
from tinyk3.util import max_diff

T_LONG = 1024 if SMOKE else 8192  # sequence length of the float32 accuracy check
T_TIME = 512 if SMOKE else 4096  # sequence length of the timing experiment against C
TIME_TS = [128, 256, 512] if SMOKE else [256, 512, 1024, 2048, 4096]  # lengths T timed
PARALLEL_MAX_T = 512 if SMOKE else 2048  # delta_rule.parallel is timed up to this T
H_TIME, D_TIME = (2, 16) if SMOKE else (4, 64)  # heads and head size of the timings
TIME_CS = [4, 16, 64] if SMOKE else [8, 16, 32, 64, 128, 256]  # chunk sizes C timed
REPEATS = 3 if SMOKE else 7  # timed runs per point: median of k runs (tinyk3.timing)


# Every time below: time_fn(fn, **TIMING), median of REPEATS runs (3 s at most).
TIMING = {"repeats": REPEATS, "max_seconds": 3.0}


def unit_inputs(B, H, T, Dk, Dv, seed, dtype=torch.float64):
    """Unit queries and keys, standard normal values, β uniform in (0, 1),
    as DeltaNet layers make them."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    return q, k, v, beta


# %% [markdown]
# ## From one chunk to the whole sequence
#
# Number the chunks $c = 0, 1, \dots, N - 1$, $N = \lceil T/C \rceil$, and write $X_{[c]}$ for the
# rows of $X$ that belong to chunk $c$ ($Q_{[c]}, K_{[c]} \in \mathbb{R}^{C \times D_k}$,
# $V_{[c]} \in \mathbb{R}^{C \times D_v}$), as chapter 6 did. $S_{[c]}$ is the state when chunk $c$
# begins: $S_{[0]} = S_0$ is the initial state, $S_{[N]}$ the final one.
#
# **The state.** Chapter 7 found, for one chunk that starts from a state $S_0$,
# $S_{[1]} = S_0 + K^\top (U - W S_0)$, and nothing in its derivation used which chunk it was or what
# $S_0$ held. Applied to chunk $c$, which starts from $S_{[c]}$:
#
# $$
# U'_{[c]} = U_{[c]} - W_{[c]}\, S_{[c]}, \qquad S_{[c+1]} = S_{[c]} + K_{[c]}^\top\, U'_{[c]} ,
# $$
#
# with $W_{[c]} = \mathcal{T}_{[c]} K_{[c]}$, $U_{[c]} = \mathcal{T}_{[c]} V_{[c]}$ and
# $\mathcal{T}_{[c]} = \big(I + \operatorname{tril}(\operatorname{diag}(\beta_{[c]}) K_{[c]} K_{[c]}^\top, -1)\big)^{-1} \operatorname{diag}(\beta_{[c]})$.
#
# **Why this is exact.** Chapter 7 also showed what the rows of $U - W S_0$ are: row $r$ is the
# correction $u_r = \beta_r (v_r - k_r S_{r-1})$ that token $r$ writes when the chunk starts from
# $S_0$. So row $i$ of $U'_{[c]}$ is $u_t$ for the $i$-th token $t$ of chunk $c$, exactly the delta the
# token loop computes, and $S_{[c+1]} = S_{[c]} + \sum_{t \in c} k_t^\top u_t$ is the token loop's state
# after the chunk. No approximation enters: the WY form is an identity (proved by induction),
# and the rest is regrouping sums. In floating point the chunked form and the loop differ only
# by the order of additions.
#
# **The outputs.** Inside chunk $c$ the token loop's state after its $i$-th token $t$ wrote is
# $S_t = S_{[c]} + \sum_{j \le i} k_j^\top u_j$ (the chunk's tokens up to and including $t$), so
#
# $$
# \begin{gathered}
# o_t = q_t S_t = q_t S_{[c]} + \sum_{j \le i} (q_t \cdot k_j)\, u_j \\
# \Longrightarrow\; O_{[c]} = Q_{[c]}\, S_{[c]} + \big(Q_{[c]} K_{[c]}^\top \odot M\big)\, U'_{[c]} ,
# \end{gathered}
# $$
#
# with $M$ the $C \times C$ lower-triangular matrix of ones (diagonal included: $o_t$ reads the
# state after token $t$ wrote). This is chapter 6's chunked linear attention with $V_{[c]}$ replaced by
# $U'_{[c]}$: once the deltas are known, the delta rule *is* linear attention on the deltas. All the
# difficulty was in the deltas, and the UT transform gives a whole chunk's of them at once, up to
# the one term $W_{[c]} S_{[c]}$ that needs the state.
#
# **What is parallel and what is sequential.**
#
# | quantity | needs | computed |
# |---|---|---|
# | $\mathcal{T}_{[c]}$, $W_{[c]} = \mathcal{T}_{[c]} K_{[c]}$, $U_{[c]} = \mathcal{T}_{[c]} V_{[c]}$ | the chunk's $K_{[c]}, V_{[c]}, \beta_{[c]}$ | for all chunks at once |
# | scores $Q_{[c]} K_{[c]}^\top \odot M$ | the chunk's $Q_{[c]}, K_{[c]}$ | for all chunks at once |
# | $U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}$, $S_{[c+1]} = S_{[c]} + K_{[c]}^\top U'_{[c]}$ | $S_{[c]}$, from the chunk before | one chunk after another |
# | $O_{[c]} = Q_{[c]} S_{[c]} + (Q_{[c]} K_{[c]}^\top \odot M)\, U'_{[c]}$ | $S_{[c]}$ and $U'_{[c]}$ | for all chunks at once, after the pass |
#
# The token loop has $T$ dependent steps; the chunked form has $N = \lceil T / C \rceil$, each two
# matrix products with the $D_k \times D_v$ state ($W_{[c]} S_{[c]}$ and $K_{[c]}^\top U'_{[c]}$).

# %% [markdown]
# ## Build it: one chunk step
#
# The four equations for one chunk, taking the WY factors from `tinyk3.ops.wy` (chapter 7). The
# chunk may be shorter than $C$ (the last one); nothing below assumes its length.

# %%
def chunk_step(q_c, k_c, v_c, beta_c, S):
    """One chunk. q_c, k_c: [B, H, n, Dk]; v_c: [B, H, n, Dv]; beta_c: [B, H, n];
    S = S_[c]: [B, H, Dk, Dv]. Returns (O_[c], U'_[c], S_[c+1])."""
    # W_[c] = 𝒯_[c] K_[c], U_[c] = 𝒯_[c] V_[c]   [B, H, n, Dk], [B, H, n, Dv]
    W, U = wy.wy_factors(k_c, v_c, beta_c)
    U_new = U - W @ S  # U'_[c] = U_[c] − W_[c] S_[c]                     [B, H, n, Dv]
    scores = (q_c @ k_c.mT).tril()  # Ω_[c] = Q_[c] K_[c]ᵀ ⊙ M            [B, H, n, n]
    o = q_c @ S + scores @ U_new  # O_[c] = Q_[c] S_[c] + Ω_[c] U'_[c]     [B, H, n, Dv]
    S_next = S + k_c.mT @ U_new  # S_[c+1] = S_[c] + K_[c]ᵀ U'_[c]        [B, H, Dk, Dv]
    return o, U_new, S_next


# %% [markdown]
# To check it we need the token loop's deltas, which `delta_rule.recurrent` does not return. Here is
# chapter 5's loop once more, recording $u_t = \beta_t (v_t - k_t S_{t-1})$ as it goes:

# %%
def token_loop_with_deltas(q, k, v, beta, S):
    """The token loop from the state S: (o, every delta u_t [B, H, T, Dv], S_T)."""
    outs, deltas = [], []
    for t in range(q.shape[2]):
        k_t = k[:, :, t, None, :]  # a row          [B, H, 1, Dk]
        # β_t (v_t − k_t S_{t−1})   [B, H, 1, Dv]
        u_t = beta[:, :, t, None, None] * (v[:, :, t, None, :] - k_t @ S)
        S = S + k_t.mT @ u_t  # S_t = S_{t−1} + k_tᵀ u_t
        outs.append(q[:, :, t, None, :] @ S)  # o_t = q_t S_t
        deltas.append(u_t)
    return torch.cat(outs, dim=2), torch.cat(deltas, dim=2), S


# %% [markdown]
# One chunk of $C = 16$ tokens that starts from a random (non-zero) state, in float64: its
# outputs, its deltas and the state it leaves, against the loop over the same tokens from the
# same state.

# %%
B, H, T, Dk, Dv, C = 2, 3, 64, 8, 6, 16
q, k, v, beta = unit_inputs(B, H, T, Dk, Dv, seed=0)
S0 = torch.randn(B, H, Dk, Dv, dtype=torch.float64)
o_loop, u_loop, S_loop = token_loop_with_deltas(q, k, v, beta, S0)

first = slice(0, C)
chunk_0 = [x[:, :, first] for x in (q, k, v, beta)]  # q, k, v, β of chunk 0
o_c, U_c_new, S_1 = chunk_step(*chunk_0, S0)
_, _, S_after = token_loop_with_deltas(*chunk_0, S0)
print(f"chunk 0: max |O_0 - loop outputs| = {max_diff(o_c, o_loop[:, :, first]):.1e}, "
      f"max |U'_0 - loop deltas| = {max_diff(U_c_new, u_loop[:, :, first]):.1e}, "
      f"max |S_1 - loop state| = {max_diff(S_1, S_after):.1e}")

# %% [markdown]
# Now the whole sequence, chunk after chunk, each starting from the state the one before left
# (four chunks here):

# %%
S, outs, deltas = S0, [], []
for start in range(0, T, C):
    sl = slice(start, start + C)
    o_c, U_c_new, S = chunk_step(*(x[:, :, sl] for x in (q, k, v, beta)), S)
    outs.append(o_c)
    deltas.append(U_c_new)
o_chunks, u_chunks = torch.cat(outs, 2), torch.cat(deltas, 2)
print(f"{T // C} chunks: max |outputs - loop| = {max_diff(o_chunks, o_loop):.1e}, "
      f"max |U' of every chunk - loop deltas| = {max_diff(u_chunks, u_loop):.1e}, "
      f"max |S_N - loop| = {max_diff(S, S_loop):.1e}")

# %% [markdown]
# Every row of every $U'_{[c]}$ is the delta the token loop wrote, to float64 round-off. Two small
# changes show what each part of the step does. Use $U_{[c]}$ where $U'_{[c]}$ belongs (as if every chunk
# started from an empty state), or read the state *after* the chunk's update instead of before:

# %%
S_u, S_late, outs_u, outs_late = S0, S0, [], []
for start in range(0, T, C):
    sl = slice(start, start + C)
    W, U = wy.wy_factors(k[:, :, sl], v[:, :, sl], beta[:, :, sl])
    scores = (q[:, :, sl] @ k[:, :, sl].mT).tril()
    outs_u.append(q[:, :, sl] @ S_u + scores @ U)  # U instead of U' = U − W S
    S_u = S_u + k[:, :, sl].mT @ U
    o_c, _, S_next = chunk_step(*(x[:, :, sl] for x in (q, k, v, beta)), S_late)
    outs_late.append(o_c + q[:, :, sl] @ (S_next - S_late))  # as if O_[c] read S_[c+1]
    S_late = S_next
d_u = max_diff(torch.cat(outs_u, 2), o_loop)
d_late = max_diff(torch.cat(outs_late, 2), o_loop)
print(f"U instead of U':          max |outputs - loop| = {d_u:.2f}")
print(f"reading S_[c+1], not S_[c]: max |outputs - loop| = {d_late:.2f}"
      f"   (outputs up to {o_loop.abs().max():.2f})")

# %% [markdown]
# Both are errors of the size of the outputs themselves. The first is the trap of chapter 5's
# erratum one level up: each chunk's tokens would correct against an empty memory instead of
# what the earlier chunks stored. The second counts the chunk's own writes twice, once through
# the state and once through the masked block. The first exercise below asks you to write the
# whole loop, for any $T$.

# %% [markdown]
# ## Check: the two limits
#
# **$C = 1$.** A chunk is one token; $\mathcal{T}_{[c]}$ is the $1 \times 1$ matrix $\beta_t$, so $W_{[c]} = \beta_t k_t$,
# $U_{[c]} = \beta_t v_t$ and $U'_{[c]} = \beta_t (v_t - k_t S_{t-1}) = u_t$; the masked block is
# $(q_t \cdot k_t)$, and $O_{[c]} = q_t S_{t-1} + (q_t \cdot k_t) u_t = q_t (S_{t-1} + k_t^\top u_t) = q_t S_t$:
# the recurrence, step for step.
#
# **$C \ge T$.** One chunk, $S_0$ the initial state: $U' = \mathcal{T} V - \mathcal{T} K S_0 = \mathcal{T} (V - K S_0)$, which with
# $\mathcal{T} = A^{-1} \operatorname{diag}(\beta)$ is the solution of chapter 5's system
# $A U' = \operatorname{diag}(\beta)(V - K S_0)$; and $O = Q S_0 + (Q K^\top \odot M) U'$: the parallel
# form. The lib's `delta_rule.chunked` in both limits, in float64:

# %%
o_rec, S_rec = delta_rule.recurrent(q, k, v, beta, initial_state=S0)
o_par, S_par = delta_rule.parallel(q, k, v, beta, initial_state=S0)
limits = ((1, (o_rec, S_rec, "recurrent")), (T, (o_par, S_par, "parallel ")))
for C_, (o_ref, S_ref, name) in limits:
    o_ch, S_ch = delta_rule.chunked(q, k, v, beta, chunk_size=C_, initial_state=S0)
    print(f"C = {C_:2d} against {name}: max |o| diff {max_diff(o_ch, o_ref):.1e}, "
          f"max |S_T| diff {max_diff(S_ch, S_ref):.1e}")
o_lib, _ = delta_rule.chunked(q, k, v, beta, chunk_size=16, initial_state=S0)
print(f"(and my chunk steps against the lib at C = 16: "
      f"{max_diff(o_chunks, o_lib):.1e})")

# %% [markdown]
# ## The lib's version: every chunk at once, but one pass
#
# The loop above computes $\mathcal{T}_{[c]}$, $W_{[c]}$, $U_{[c]}$ and the scores one chunk at a time, although none of
# them needs the state. `tinyk3.ops.delta_rule.chunked` computes them for all chunks (and all
# heads and batch entries) in a few batched products, and keeps only what needs the state in a
# loop. It runs in four stages, the same split GPU kernel libraries use (chapter 9):
#
# 1. $\mathcal{T}_{[c]}$, $W_{[c]} = \mathcal{T}_{[c]} K_{[c]}$, $U_{[c]} = \mathcal{T}_{[c]} V_{[c]}$ for every chunk: one batched triangular solve and three
#    batched products;
# 2. the scores $Q_{[c]} K_{[c]}^\top \odot M$ for every chunk: one batched product;
# 3. **the state pass**, the only sequential stage: for $c = 0, \dots, N-1$,
#    $U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}$ and $S_{[c+1]} = S_{[c]} + K_{[c]}^\top U'_{[c]}$, recording every $S_{[c]}$ and $U'_{[c]}$;
# 4. the outputs of every chunk at once, $O_{[c]} = Q_{[c]} S_{[c]} + (Q_{[c]} K_{[c]}^\top \odot M)\, U'_{[c]}$.

# %%
tinyk3.notebook.show_source(delta_rule.chunked)

# %% [markdown]
# Heads and batch entries are flattened into one axis (`[B·H, N, C, D]`). Stage 1 is chapter 7's
# UT transform on every chunk at once:
#
# $$
# \begin{gathered}
# \mathcal{T}_{[c]} = \big(I + \operatorname{tril}(\operatorname{diag}(\beta_{[c]}) K_{[c]} K_{[c]}^\top, -1)\big)^{-1} \operatorname{diag}(\beta_{[c]}), \\
# W_{[c]} = \mathcal{T}_{[c]} K_{[c]}, \\
# U_{[c]} = \mathcal{T}_{[c]} V_{[c]} .
# \end{gathered}
# $$

# %%
tinyk3.notebook.show_source(delta_rule.wy_stage)

# %% [markdown]
# `wy_stage` hands the unmasked $K K^\top$ and $\beta$ to the lib's `delta_rule.ut_transform` (not
# chapter 7's `wy.ut_transform`, which takes the keys), which scales its rows by $\beta$ and calls
# `torch.linalg.solve_triangular(A, ·, upper=False, unitriangular=True)`. That call reads only the
# part of `A` strictly below the diagonal, and takes the diagonal to be ones. So the solve is given
# the unmasked $\operatorname{diag}(\beta) K K^\top$ and the lib never builds
# $I + \operatorname{tril}(\cdot, -1)$, one pass over a $C \times C$ matrix per chunk saved; and the
# right-hand side $\operatorname{diag}(\beta)$ gives
# $A^{-1}\operatorname{diag}(\beta)$ without a multiplication afterwards. Against chapter 7's
# `wy.ut_transform` and `wy.wy_factors`, which build the masked matrix:

# %%
k_c, v_c, b_c = k[:, :, :C], v[:, :, :C], beta[:, :, :C]
# diag(β) K Kᵀ, its diagonal and upper triangle included
unmasked = (b_c[..., None] * k_c) @ k_c.mT
T_unmasked = torch.linalg.solve_triangular(unmasked, torch.diag_embed(b_c), upper=False,
                                           unitriangular=True)
W_lib, U_lib = delta_rule.wy_stage(k_c, v_c, b_c[..., None])
W_ch7, U_ch7 = wy.wy_factors(k_c, v_c, b_c)
d_T = max_diff(T_unmasked, wy.ut_transform(k_c, b_c))
print(f"max |T from the unmasked matrix - wy.ut_transform| = {d_T:.1e}; "
      f"W, U: {max_diff(W_lib, W_ch7):.1e}, {max_diff(U_lib, U_ch7):.1e}")

# %% [markdown]
# Stage 3, the state pass, uses `torch.baddbmm` ($\text{input} + \alpha \cdot \text{batch1} \times
# \text{batch2}$, a product and an addition in one call) on the $B \cdot H$ states at once:
#
# $$
# U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}, \qquad S_{[c+1]} = S_{[c]} + K_{[c]}^\top U'_{[c]} \qquad (c = 0, 1, \dots, N - 1).
# $$
#
# Its `decay` argument serves the gated rules of chapters 10 and 11, which scale $S_{[c]}$ before
# adding $K_{[c]}^\top U'_{[c]}$; `chunked` passes none, so `kept` is $S_{[c]}$ itself and the pass
# is the two equations above.

# %%
tinyk3.notebook.show_source(delta_rule.state_pass)

# %% [markdown]
# **Why record $U'_{[c]}$ and not recompute it.** Stage 4 needs, per chunk, the state $S_{[c]}$ and the
# deltas $U'_{[c]}$; the pass computes both anyway, and storing them turns the outputs into two large
# batched products instead of two small products per chunk inside the loop. Production kernels
# do the same: one kernel runs the pass and writes every chunk's state and "new values" $U'_{[c]}$ to
# memory, a second computes all outputs in parallel. (An equivalent regrouping,
# $O_{[c]} = (Q_{[c]} - \Omega_{[c]} W_{[c]})\, S_{[c]} + \Omega_{[c]} U_{[c]}$ with $\Omega_{[c]} = Q_{[c]} K_{[c]}^\top \odot M$, needs only the states, at the
# price of one more $C \times C$ by $C \times D_k$ product per chunk; the check:)

# %%
Qc, Kc, Vc = (x.unflatten(2, (-1, C)) for x in (q, k, v))  # chunks: [B, H, N, C, D]
bc = beta.unflatten(2, (-1, C))  # [B, H, N, C]
Wc, Uc = wy.wy_factors(Kc, Vc, bc)
Ac = (Qc @ Kc.mT).tril()  # Ω_[c] = Q_[c] K_[c]ᵀ ⊙ M
# S_[c], from the token loop   [B, H, N, Dk, Dv]
S_starts = torch.stack(
    [S0] + [token_loop_with_deltas(*(x[:, :, :s] for x in (q, k, v, beta)), S0)[2]
            for s in range(C, T, C)], dim=2)
O_regrouped = (Qc - Ac @ Wc) @ S_starts + Ac @ Uc
print(f"max |(Q - Ω W) S + Ω U - token loop| = "
      f"{max_diff(O_regrouped.flatten(2, 3), o_loop):.1e}")

# %% [markdown]
# The price of computing all chunks at once is memory: stage 3 keeps every $S_{[c]}$, $N D_k D_v$
# numbers per head (the loop keeps one), and $U'_{[c]}$, as many numbers as $V$. At $C = 64$ the
# states are $D_k D_v / C = D_v$ numbers per token for $D_k = 64$, as much as the values;
# at $C = 1$ they would be $D_k D_v$ per token.
#
# ## Check: the lib against the token loop
#
# **float64.** Chunk sizes from 1 to beyond $T$, including sizes that do not divide $T$, from a
# zero and from a random initial state, with $D_k \ne D_v$; each line is the largest distance over
# the chunk sizes, for the outputs and the final state:

# %%
B, H, T, Dk, Dv = 2, 2, 100, 16, 12
q, k, v, beta = unit_inputs(B, H, T, Dk, Dv, seed=1)
S0 = torch.randn(B, H, Dk, Dv, dtype=torch.float64)
chunk_sizes = (1, 3, 7, 16, 33, 64, 100, 128)
short = [c for c in chunk_sizes if T % c and c < T]
print(f"T = {T}, C in {chunk_sizes} (the last chunk is short for {short})")
for name, init in (("zero S_0", None), ("random S_0", S0)):
    o_ref, S_ref = delta_rule.recurrent(q, k, v, beta, initial_state=init)
    results = [delta_rule.chunked(q, k, v, beta, chunk_size=c, initial_state=init)
               for c in chunk_sizes]
    d_o = max(max_diff(o, o_ref) for o, _ in results)
    d_S = max(max_diff(S, S_ref) for _, S in results)
    print(f"{name:>10s}: max |o - recurrent| = {d_o:.1e}, "
          f"max |S_T - recurrent| = {d_S:.1e} (outputs up to {o_ref.abs().max():.1f})")

# %% [markdown]
# Round-off, far below $10^{-10}$, at every chunk size. (`tests/test_delta_rule.py` checks the same
# against an independent float64 NumPy reference written in the papers' layout, for raw key norms and
# half precision as well.)
#
# **float32, long sequences.** A kernel runs in float32 (with bfloat16 inputs), and the state pass
# carries rounding errors from chunk to chunk. Do they grow? $T = 8192$ tokens, two
# heads of $D = 64$, unit $q$ and $k$, a small random initial state: the chunked form in float32, for
# three chunk sizes, and the token loop in float32, against the token loop in float64. A few
# seconds (the cell prints its time).

# %%
t0 = time.perf_counter()
q, k, v, beta = unit_inputs(1, 2, T_LONG, 64, 64, seed=8192)
S0 = 0.1 * torch.randn(1, 2, 64, 64, dtype=torch.float64)
with torch.no_grad():
    o64, S64 = delta_rule.recurrent(q, k, v, beta, initial_state=S0)  # the reference
    f32 = [x.float() for x in (q, k, v, beta)]
    runs = {"token loop": delta_rule.recurrent(*f32, initial_state=S0.float())}
    for C_ in (16, 64, 128):
        runs[f"chunked C = {C_}"] = delta_rule.chunked(*f32, chunk_size=C_,
                                                       initial_state=S0.float())
print(f"T = {T_LONG}, float32 against the float64 token loop "
      f"(outputs up to {o64.abs().max():.1f}):")
window = T_LONG // 16
errors = {}
for name, (o32, S32) in runs.items():
    # the largest error at each position   [T]
    err = (o32.double() - o64).abs().amax(dim=(0, 1, 3))
    errors[name] = err.view(16, window).amax(dim=1)  # per sixteenth of the sequence
    print(f"  {name:>16s}: max |o| error {err.max():.1e}, "
          f"max |S_T| error {max_diff(S32.double(), S64):.1e}, "
          f"first / last sixteenth {errors[name][0]:.1e} / {errors[name][-1]:.1e}")
print(f"({time.perf_counter() - t0:.0f} s)")

# %% mystnb={"figure": {"caption": "Largest float32 output error in each sixteenth of the sequence, for the token loop and the chunked form at three chunk sizes, against the float64 token loop: all stay near $10^{-6}$, well below the stated bound of $10^{-5}$, and hardly grow along the sequence.", "name": "fig-chunkwise-float32-error"}, "image": {"alt": "Line plot with a logarithmic vertical axis of the largest output error per window against the position in the sequence, for the float32 token loop and the chunked form at C = 16, 64 and 128: all four lines lie between about 1e-6 and 2e-6 and wander without an upward trend from start to end, well below a dashed horizontal line at the bound 1e-5."}}
fig, ax = plt.subplots(figsize=(6.8, 4.0))
for name, err in errors.items():
    marker = "o-" if "loop" in name else ".-"
    ax.plot((np.arange(16) + 1) * window, err.numpy(), marker, label=name)
ax.axhline(1e-5, color="k", ls="--", lw=1, label="stated bound 1e-5")
ax.set(yscale="log", xlabel="position t (end of each sixteenth of the sequence)",
       ylabel="max |o_t error| in the window",
       title="float32 against the float64 token loop")
ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2))
plt.tight_layout()
plt.show()

# %% [markdown]
# The float32 errors of the chunked form are about as large as the float32 token loop's, at every
# chunk size, and they hardly grow along the sequence (first sixteenth against last): with unit
# keys and $\beta \le 1$ every transition
# $I - \beta_t k_t^\top k_t$ has eigenvalues in $[0, 1]$ (chapter 5), so the state pass does not
# amplify the rounding of earlier chunks, and chapter 7 showed the triangular solve is well
# conditioned for such keys. The stated bound, which `tests/test_delta_rule.py` asserts at
# $T = 8192$ for unit $q$ and $k$, is a maximum absolute error of $10^{-5}$ on the outputs and the
# final state.
#
# **Gradients.** The lib's chunked form is differentiable through autograd.
# `torch.autograd.gradcheck` compares its
# analytic gradients with finite differences in float64, at a tiny size with a short last chunk,
# with respect to all five inputs ($q, k, v, \beta, S_0$); then the gradients of chunked and
# recurrent are compared directly, at a larger size:

# %%
S0_tiny = torch.randn(1, 2, 3, 2, dtype=torch.float64)
# q, k, v, β, S_0
ins = tuple(x.requires_grad_() for x in (*unit_inputs(1, 2, 7, 3, 2, seed=3), S0_tiny))
ok = torch.autograd.gradcheck(
    lambda q, k, v, b, S: delta_rule.chunked(q, k, v, b, chunk_size=3, initial_state=S),
    ins, eps=1e-6, atol=1e-7)
print(f"gradcheck, T = 7, C = 3 (chunks of 3, 3, 1), all five inputs: "
      f"{'passed' if ok else 'FAILED'}")

grads, S0 = {}, torch.randn(2, 2, 8, 6, dtype=torch.float64)
for form in ("recurrent", "chunked"):
    inputs = (*unit_inputs(2, 2, 50, 8, 6, seed=4), S0)  # the same for both forms
    ins = [x.clone().requires_grad_() for x in inputs]
    kw = {"chunk_size": 16} if form == "chunked" else {}
    o, S = getattr(delta_rule, form)(*ins[:4], initial_state=ins[4], **kw)
    (o.sin().sum() + S.square().sum()).backward()
    grads[form] = [x.grad for x in ins]
dists = [max_diff(a, b) for a, b in zip(grads["chunked"], grads["recurrent"])]
print("T = 50, C = 16: max |grad chunked - grad recurrent| for q, k, v, β, S_0: "
      + ", ".join(f"{d:.1e}" for d in dists))

# %% [markdown]
# ## The papers' layout: the same numbers, transposed
#
# Yang et al. (2024) and Songlin Yang's blog post *DeltaNet Explained (Part II)* keep the state as
# $S^{\text{p}} \in \mathbb{R}^{D_v \times D_k}$, read by $S^{\text{p}} q$ with column vectors: our $S$
# transposed (the [notation page](../book/notation.md)). Their chunk matrices $Q, K, V, W, U$ stack
# tokens as rows, as ours do, and their $\mathcal{T}$, $W = \mathcal{T} K$ and $U = \mathcal{T} V$ are ours (chapter 7 checked
# that). In their layout the chunk recurrence reads
#
# $$
# \begin{gathered}
# S^{\text{p}}_{[c+1]} = S^{\text{p}}_{[c]} + \big(U_{[c]} - W_{[c]} S^{\text{p}\top}_{[c]}\big)^\top K_{[c]} , \\
# O_{[c]} = Q_{[c]} S^{\text{p}\top}_{[c]} + \big(Q_{[c]} K_{[c]}^\top \odot M\big)\big(U_{[c]} - W_{[c]} S^{\text{p}\top}_{[c]}\big).
# \end{gathered}
# $$
#
# Written from these two equations, in that layout:

# %%
def chunkwise_papers_layout(q, k, v, beta, C, S_p):
    """The papers' chunk recurrence; S_p ∈ R^{Dv×Dk} per head: [B, H, Dv, Dk]."""
    outs = []
    for start in range(0, q.shape[2], C):
        Q, K, V, b = (x[:, :, start : start + C] for x in (q, k, v, beta))
        # 𝒯 = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β); W = 𝒯 K, U = 𝒯 V
        W, U = wy.wy_factors(K, V, b)
        # O = Q Sᵀ + (Q Kᵀ ⊙ M)(U − W Sᵀ)
        outs.append(Q @ S_p.mT + (Q @ K.mT).tril() @ (U - W @ S_p.mT))
        S_p = S_p + (U - W @ S_p.mT).mT @ K  # S ← S + (U − W Sᵀ)ᵀ K   [B, H, Dv, Dk]
    return torch.cat(outs, dim=2), S_p


q, k, v, beta = unit_inputs(2, 2, 50, 8, 6, seed=5)
S0 = torch.randn(2, 2, 8, 6, dtype=torch.float64)  # ours: [B, H, Dk, Dv]
o_p, S_p = chunkwise_papers_layout(q, k, v, beta, 16, S0.mT)  # theirs starts from S_0ᵀ
o_ours, S_ours = delta_rule.chunked(q, k, v, beta, chunk_size=16, initial_state=S0)
print(f"max |outputs, papers' layout - ours|   = {max_diff(o_p, o_ours):.1e}")
print(f"max |S^p_N - our S_N transposed|       = {max_diff(S_p, S_ours.mT):.1e}")

# %% [markdown]
# ## The cost: what the delta rule adds to chunked linear attention
#
# Per chunk of $C$ tokens and per head, with a product $[m, k] \times [k, n]$ costing $2mkn$ flops (as in
# chapter 6), and $D_k = D_v = D$:
#
# | stage | product | flops |
# |---|---|---|
# | 1 | $\operatorname{diag}(\beta) K_{[c]} K_{[c]}^\top$ | $2C^2 D$ |
# | 1 | the inverse of a $C \times C$ unit lower-triangular matrix | $C^3/3$ |
# | 1 | $W_{[c]} = \mathcal{T}_{[c]} K_{[c]}$, $U_{[c]} = \mathcal{T}_{[c]} V_{[c]}$ | $2 \cdot 2C^2 D$ |
# | 2 | $Q_{[c]} K_{[c]}^\top$ | $2C^2 D$ |
# | 3 | $W_{[c]} S_{[c]}$, $K_{[c]}^\top U'_{[c]}$ | $2 \cdot 2CD^2$ |
# | 4 | $Q_{[c]} S_{[c]}$, $(Q_{[c]} K_{[c]}^\top \odot M)\, U'_{[c]}$ | $2CD^2 + 2C^2D$ |
#
# Over $T/C$ chunks: $6TD^2 + 10TCD + TC^2/3$. Chunked linear attention (chapter 6) costs
# $4TD^2 + 4TCD$; the delta rule adds $W_{[c]} S_{[c]}$, three $C \times C$-sized products and the
# inverse. As in chapter 6, masked halves are counted. `tinyk3.cost.chunked_delta_rule_flops`
# holds this count (for the padded $\lceil T/C \rceil$ chunks the lib runs):

# %%
tinyk3.notebook.show_source(cost.chunked_delta_rule_flops)

# %% [markdown]
# PyTorch's flop counter sees every matrix product the lib performs. It has no formula for the
# triangular solve, so it should count exactly the model minus the $C^3/3$ term:

# %% tags=["nbval-check-output"]
for T_, C_ in ((1024, 64), (1000, 64), (256, 1), (256, 256)):
    x = torch.zeros(1, 2, T_, 32)
    with FlopCounterMode(display=False) as counter:
        delta_rule.chunked(x, x, x, torch.zeros(1, 2, T_), chunk_size=C_)
    model = 2 * cost.chunked_delta_rule_flops(T_, 32, C_)  # two heads
    inverse = 2 * cost.n_chunks(T_, C_) * C_**3 / 3
    print(f"T = {T_:4d}, C = {C_:3d}: PyTorch counts {counter.get_total_flops():11,d}; "
          f"the model minus the inverse: {model - inverse:13,.0f}")

# %% [markdown]
# Exact. The inverse term is small next to the rest for $C \le D$, but the solve does more work than
# $C^3/3$: a triangular solve with $C$ right-hand sides costs about $C^3$ whatever they are, because it does
# not know that the right-hand side $\operatorname{diag}(\beta)$ is mostly zeros. The split between
# the two algorithms, per head at the size of the timing experiment:

# %% tags=["nbval-check-output"]
T_, D_ = 4096, 64
print(f"T = {T_}, D = {D_}, per head: "
      f"{'C':>4s} {'linear attention':>17s} {'delta rule':>14s} {'ratio':>6s}")
for C_ in (16, 64, 128):
    la_flops = cost.chunked_linear_attention_flops(T_, D_, C_).matmul
    dr_flops = cost.chunked_delta_rule_flops(T_, D_, C_)
    print(f"{'':>31s} {C_:4d} {la_flops:17,d} {dr_flops:14,.0f} "
          f"{dr_flops / la_flops:6.2f}")

# %% [markdown]
# Between 1.7 and 2.3 times chapter 6's work, more at larger $C$, in the same linear-in-$T$ shape.

# %% [markdown]
# ## Experiment: time against $T$ and $C$
#
# Now the payoff. On one CPU thread, float32, $H = 4$ heads of $D = 64$, time the
# forward pass of
#
# - **the token loop** (`delta_rule.recurrent`),
# - **the one-block parallel form** (`delta_rule.parallel`, up to $T = 2048$: it builds
#   $T \times T$ matrices),
# - **the chunked form** at $C = 64$,
#
# for $T$ from 256 to 4096; then the chunked form at $T = 4096$ for $C$ from 8 to 256. Each time is
# the median of several runs (`tinyk3.timing`), printed with its quartiles in ms; chunk sizes are
# ranked only where their quartile ranges do not overlap. The matrix-product rate
# (`bench.matmul_flops`, $512 \times 512$) is measured before and after, and the higher counts.
# The cell prints its time.

# %%
t0 = time.perf_counter()
peak_before = bench.matmul_flops()
rows = []
with torch.no_grad():
    for T_ in TIME_TS:
        q, k, v, beta = unit_inputs(1, H_TIME, T_, D_TIME, D_TIME, seed=T_,
                                    dtype=torch.float32)
        forms = {"recurrent": partial(delta_rule.recurrent, q, k, v, beta),
                 "chunked C = 64": partial(delta_rule.chunked, q, k, v, beta,
                                           chunk_size=64)}
        if T_ <= PARALLEL_MAX_T:
            forms["parallel"] = partial(delta_rule.parallel, q, k, v, beta)
        for name, fn in forms.items():
            rows.append((name, T_, time_fn(fn, **TIMING)))
    q, k, v, beta = unit_inputs(1, H_TIME, T_TIME, D_TIME, D_TIME, seed=1,
                                dtype=torch.float32)
    by_C = {C_: time_fn(partial(delta_rule.chunked, q, k, v, beta, chunk_size=C_),
                        **TIMING)
            for C_ in TIME_CS}
peak = max(peak_before, bench.matmul_flops())
by_T = {name: {T_: s for n, T_, s in rows if n == name}
        for name in ("recurrent", "chunked C = 64", "parallel")}
print(bench.stamp())
print(f"matmul 512x512: {peak / 1e9:.0f} GFLOP/s on this core "
      f"({time.perf_counter() - t0:.0f} s)")
print(f"{'T':>5s} {'recurrent, ms':>20s} {'parallel, ms':>20s} "
      f"{'chunked C=64, ms':>20s} {'speed-up':>9s}")
for T_ in TIME_TS:
    t_loop, t_chunked = by_T["recurrent"][T_], by_T["chunked C = 64"][T_]
    par = by_T["parallel"][T_].ms() if T_ in by_T["parallel"] else "-"
    print(f"{T_:5d} {t_loop.ms():>20s} {par:>20s} {t_chunked.ms():>20s} "
          f"{t_loop / t_chunked:8.0f}x")

flops_C = {C_: H_TIME * cost.chunked_delta_rule_flops(T_TIME, D_TIME, C_)
           for C_ in TIME_CS}
print(f"\nT = {T_TIME}: {'C':>4s} {'time, ms':>20s} {'GFLOP':>7s} {'GFLOP/s':>8s} "
      f"{'of matmul':>10s}")
for C_, t in by_C.items():
    print(f"{'':>9s} {C_:4d} {t.ms():>20s} {flops_C[C_] / 1e9:7.2f} "
          f"{flops_C[C_] / t / 1e9:8.1f} {flops_C[C_] / t / peak:10.0%}")
best_C = min(by_C, key=by_C.get)
tied = [C_ for C_ in by_C
        if C_ != best_C and not distinguishable(by_C[C_], by_C[best_C])]
speed_up = by_T["recurrent"][T_TIME] / by_C[best_C]
print(f"fastest median at C = {best_C}, {speed_up:.0f}x faster than the token loop at "
      f"T = {T_TIME}; within the spread of it: "
      + (", ".join(f"C = {c}" for c in tied) or "no other C"))

# %% mystnb={"figure": {"caption": "Top: forward-pass time of the token loop, the one-block parallel form and the chunked form at $C = 64$ against the sequence length $T$. Middle and bottom: the chunked form's time against the chunk size $C$, with the time its flops would take at the matrix-product rate and the token loop's time, and the fraction of the matrix-product rate it reaches.", "name": "fig-chunkwise-time-vs-t-and-c"}, "image": {"alt": "Three stacked line plots. Top: log-log time against sequence length from 256 to 4096; the token loop and the chunked form grow about linearly, the chunked form about an order of magnitude faster, and the parallel form grows faster than linearly and, at 2048, the longest length it was timed at, takes about as long as the token loop. Middle: time of the chunked form against chunk size from 8 to 256, a U, lowest at the small and middle chunk sizes and rising steeply towards 256, above a rising dashed line for its flops at the matmul rate and below a dotted line for the token loop. Bottom: fraction of the matmul rate against chunk size, lowest at the smallest chunks, rising with the chunk size and levelling off at the largest, below one half everywhere."}}
fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(6.7, 7.4), layout="constrained")
for name, marker in (("recurrent", "s-"), ("parallel", "v-"), ("chunked C = 64", "o-")):
    pts = sorted(by_T[name].items())
    ax1.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker, label=name)
ax1.set(yscale="log", xlabel="sequence length T", ylabel="time (ms)",
        title=f"Forward pass, {H_TIME} heads of D = {D_TIME}")
Cs = list(by_C)
ax2.plot(Cs, [by_C[c] * 1e3 for c in Cs], "o-", label="chunked")
ax2.plot(Cs, [flops_C[c] / peak * 1e3 for c in Cs], "k--", lw=1,
         label="its flops at the\nmatmul rate")
ax2.axhline(by_T["recurrent"][T_TIME] * 1e3, color="C3", ls=":", label="token loop")
ax2.set(yscale="log", xlabel="chunk size C", ylabel="time (ms)", title=f"T = {T_TIME}")
ax3.plot(Cs, [flops_C[c] / by_C[c] / peak for c in Cs], "o-")
ax3.set(xlabel="chunk size C", ylabel="fraction of the\n512×512 matmul rate",
        title="Rate achieved (flops of the model / time)", ylim=(0, 1))
for ax in (ax1, ax2, ax3):
    ax.set_xscale("log", base=2)
for ax in (ax1, ax2):  # beside the panels, where they cover no data
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %% [markdown]
# - **Against $T$** (top), the token loop and the chunked form both grow about linearly, and the
#   chunked form is about an order of magnitude faster (the speed-up column): $T/C$ sequential
#   steps instead of $T$, each made of matrix products. The parallel form grows faster than
#   linearly, its $T \times T$ scores and triangular system costing $O(T^2 D)$; at the longest
#   length it was timed at, $T = 2048$, it takes about as long as the token loop itself.
# - **Against $C$** (middle), the chunked form traces chapter 6's U: slowest at the largest chunks,
#   where the $10TCD + TC^2/3$ of the diagonal blocks and the triangular solves dominates, and
#   slower again towards the smallest, where the per-chunk costs do (the state pass has $T/C$
#   iterations, each a few calls). Two chunk sizes are ranked only where their quartile ranges
#   are apart; the quartile ranges are wide on a shared machine, so the line under the table names
#   the fastest median and the chunk sizes within its spread, and those are not ranked against
#   each other.
# - **As a rate** (bottom), the chunked form reaches a fraction of what one large matrix product
#   reaches on this core (the "of matmul" column). The rest is lost to small products ($64 \times 64$
#   tiles run slower than $512 \times 512$ ones), to the triangular solve (which does about three times
#   the flops the model counts for it), to element-wise passes over memory, and to the state pass,
#   whose $2 \cdot T/C$ products run one after another on $B \cdot H$ matrices at a time.
#
# **Where the time goes.** The four stages timed one by one at $T = 4096$ and $C = 64$,
# with the lib's own stage functions for stages 1 and 3 and its one-line stages 2 and 4, next to
# each stage's share of the flops.

# %%
C_ = 64 if not SMOKE else 16
with torch.no_grad():
    # [B·H, N, C, D]
    Qc, Kc, Vc = (x.unflatten(2, (-1, C_)).flatten(0, 1) for x in (q, k, v))
    # β as a column   [B·H, N, C, 1]
    bc = beta.unflatten(2, (-1, C_)).flatten(0, 1)[..., None]
    causal = torch.ones(C_, C_).tril()
    S_start = Qc.new_zeros(Qc.shape[0], D_TIME, D_TIME)
    Wc, Uc = delta_rule.wy_stage(Kc, Vc, bc)
    scores = (Qc @ Kc.mT) * causal
    S_all, U_new, _ = delta_rule.state_pass(Wc, Uc, Kc.mT, S_start)
    stages = {
        "1. 𝒯, W, U": lambda: delta_rule.wy_stage(Kc, Vc, bc),
        "2. scores": lambda: (Qc @ Kc.mT) * causal,
        "3. state pass": lambda: delta_rule.state_pass(Wc, Uc, Kc.mT, S_start),
        "4. outputs": lambda: Qc @ S_all + scores @ U_new,
    }
    stage_s = {name: time_fn(fn, **TIMING) for name, fn in stages.items()}
    whole = time_fn(lambda: delta_rule.chunked(q, k, v, beta, chunk_size=C_),
                    **TIMING)
N_ = cost.n_chunks(T_TIME, C_)
stage_flops = {"1. 𝒯, W, U": N_ * (2 * C_**2 * D_TIME + C_**3 / 3 + 4 * C_**2 * D_TIME),
               "2. scores": N_ * 2 * C_**2 * D_TIME,
               "3. state pass": N_ * 4 * C_ * D_TIME**2,
               "4. outputs": N_ * (2 * C_ * D_TIME**2 + 2 * C_**2 * D_TIME)}
total_s, total_flops = sum(stage_s.values()), sum(stage_flops.values())
low_sum = sum(t.low for t in stage_s.values())
high_sum = sum(t.high for t in stage_s.values())
print(f"T = {T_TIME}, C = {C_}, {H_TIME} heads, ms, median (quartiles): the whole call "
      f"{whole.ms()}; the four stages, summed {total_s * 1e3:.1f} "
      f"({low_sum * 1e3:.1f}-{high_sum * 1e3:.1f}): "
      + ("apart" if high_sum < whole.low or whole.high < low_sum
         else "within the spread of each other"))
print(f"{'stage':>14s} {'time, ms':>20s} {'of the time':>12s} {'of the flops':>13s} "
      f"{'GFLOP/s':>8s} {'of matmul':>10s}")
for name, t in stage_s.items():
    fl = H_TIME * stage_flops[name]
    print(f"{name:>14s} {t.ms():>20s} {t / total_s:12.0%} "
          f"{stage_flops[name] / total_flops:13.0%} "
          f"{fl / t / 1e9:8.1f} {fl / t / peak:10.0%}")

# %% [markdown]
# Stage 1, the UT transform and the WY factors, takes the largest share of the time, more than its
# share of the flops: its triangular solve is a loop of small solves inside PyTorch, one per chunk
# and head, and does about three times the flops the model counts for it. (The first line compares
# the whole call with the sum of its stages and says whether their quartile ranges are apart;
# single runs of either vary on a shared machine, which is why every time in this chapter is a
# median with its quartiles.) The state pass, the only sequential stage, makes $2N$ calls on
# $B \cdot H$ small matrices one after another, where every other stage makes a handful of calls
# on all $N \cdot B \cdot H$ chunks at once; it still runs at a rate comparable to the batched
# stages at this size (the GFLOP/s column), because each of its calls multiplies $64 \times 64$
# matrices. With more heads or a larger batch every call of the pass does more work for the same
# overhead; with smaller chunks there are more calls (the left side of the U above). A GPU kernel changes the balance again: chapter 9 keeps the state in fast
# on-chip memory for the whole pass and runs one program per head and value block, so the
# sequential part becomes $N$ steps of on-chip work instead of $2N$ trips through the framework.
#
# **The full benchmark.** `python -m tinyk3.bench delta_rule` times the same forms over a grid of
# $T$ and $C$ and writes CSV, JSON and a plot, each stamped with the hardware, the versions and the
# git commit, for example
#
# ```
# OMP_NUM_THREADS=1 python -m tinyk3.bench delta_rule --T 1024 4096 --C 16 32 64 128 \
#     --loop-max-T 4096 --repeats 7 --csv delta_rule.csv --plot delta_rule.png
# ```
#
# With `--fla` it also times the reference chunked code of flash-linear-attention
# (`fla.ops.delta_rule.naive.delta_rule_chunkwise`) where that package is installed, and skips it with
# a message where it is not. A small run of it:

# %%
lengths = ["1024"] + (["4096"] if not SMOKE else [])
print(bench.stamp())  # the commit, +dirty when the checkout had uncommitted changes
bench.main(["delta_rule", "--T", *lengths, "--C", "32", "64", "128",
            "--loop-max-T", "1024", "--repeats", "3"])

# %% [markdown]
# ## Exercises
#
# ```{exercise} The chunkwise delta rule
# :label: ex-chunkwise-delta-rule
#
# Write `chunkwise_delta_rule(q, k, v, beta, chunk_size)`: the delta rule over a whole sequence,
# chunk by chunk, from $S_0 = 0$. Inputs are `q, k [B, H, T, Dk]`, `v [B, H, T, Dv]`,
# `beta [B, H, T]`; return `(o [B, H, T, Dv], S [B, H, Dk, Dv])`, the outputs and the final state.
# You may call `tinyk3.ops.wy.ut_transform(k_c, beta_c)` for each chunk's $\mathcal{T}_{[c]}$ (or
# `wy.wy_factors`). $T$ need not be a multiple of the chunk size, and the chunk size may exceed $T$.
# ```

# %%
def chunkwise_delta_rule_mine(q, k, v, beta, chunk_size):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("chunkwise.delta_rule", chunkwise_delta_rule_mine)

# %% [markdown]
# ```{solution-start} ex-chunkwise-delta-rule
# :class: dropdown
# ```

# %%
def chunkwise_delta_rule_solution(q, k, v, beta, chunk_size):
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])  # S_0 = 0
    outs = []
    for start in range(0, T, chunk_size):  # ⌈T/C⌉ chunks; the last may be short
        Q, K, V, b = (x[:, :, start : start + chunk_size] for x in (q, k, v, beta))
        T_c = wy.ut_transform(K, b)  # (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β)
        W, U = T_c @ K, T_c @ V
        U_new = U - W @ S  # U'_[c] = U_[c] − W_[c] S_[c]
        # O_[c], from S_[c]: before the update
        outs.append(Q @ S + (Q @ K.mT).tril() @ U_new)
        S = S + K.mT @ U_new  # S_[c+1] = S_[c] + K_[c]ᵀ U'_[c]
    return torch.cat(outs, dim=2), S


ok = checks.run("chunkwise.delta_rule", chunkwise_delta_rule_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The flops of the chunked delta rule
# :label: ex-chunkwise-flops
#
# Write `chunked_delta_rule_flops(T, D, C)`: the matrix-product flops per head of the chunked delta
# rule as the lib runs it, with $D_k = D_v = D$: $\lceil T/C \rceil$ chunks of $C$ rows (the last one
# zero-padded, and its zeros multiplied too), a product $[m, k] \times [k, n]$ counted as $2mkn$ flops
# and the inverse of a $C \times C$ unit lower-triangular matrix as $C^3/3$. Return a number. Then use
# it: at $T = 4096$ and $D = 128$ (Kimi Linear's head size), which of $C = 16, 32, 64, 128$ needs the
# fewest flops?
# ```

# %%
def chunked_delta_rule_flops_mine(T, D, C):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("chunkwise.flops", chunked_delta_rule_flops_mine)

# %% [markdown]
# ```{solution-start} ex-chunkwise-flops
# :class: dropdown
# ```

# %%
def chunked_delta_rule_flops_solution(T, D, C):
    n_chunks = -(-T // C)  # ⌈T/C⌉
    c2d = 5 * 2 * C * C * D  # K Kᵀ, Q Kᵀ, 𝒯 K, 𝒯 V, (Q Kᵀ ⊙ M) U'
    cd2 = 3 * 2 * C * D * D  # W S, Q S, Kᵀ U'
    return n_chunks * (c2d + cd2 + C**3 / 3)


ok = checks.run("chunkwise.flops", chunked_delta_rule_flops_solution)
for C_ in (16, 32, 64, 128):
    gflop = chunked_delta_rule_flops_solution(4096, 128, C_) / 1e9
    print(f"T = 4096, D = 128, C = {C_:3d}: {gflop:.3f} GFLOP per head")

# %% [markdown]
# The fewest flops are at the smallest $C$, as for linear attention: the state work $6TD^2$ does not
# depend on $C$, and everything else grows with it. The experiment above shows why kernels do not
# choose the smallest $C$ anyway: time is not flops.
#
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Chapter 7's closed form of a chunk, applied to chunk $c$ from the state $S_{[c]}$, gives the chunk
#   algorithm: $U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}$, $O_{[c]} = Q_{[c]} S_{[c]} + (Q_{[c]} K_{[c]}^\top \odot M)\, U'_{[c]}$,
#   $S_{[c+1]} = S_{[c]} + K_{[c]}^\top U'_{[c]}$, with $W_{[c]} = \mathcal{T}_{[c]} K_{[c]}$, $U_{[c]} = \mathcal{T}_{[c]} V_{[c]}$ from the UT transform.
# - It is exact: every row of $U'_{[c]}$ is the delta $u_t = \beta_t (v_t - k_t S_{t-1})$ the token loop
#   writes (checked against the loop's recorded deltas), and once the deltas are known the delta rule
#   is chunked linear attention on them. $C = 1$ is the recurrence, $C \ge T$ chapter 5's parallel
#   form.
# - $\mathcal{T}_{[c]}$, $W_{[c]}$, $U_{[c]}$ and the scores depend only on their chunk and are computed for all chunks at
#   once; the outputs too, once every $S_{[c]}$ and $U'_{[c]}$ is recorded. Only the state pass is
#   sequential: $\lceil T/C \rceil$ steps of two matrix products with the state.
# - `tinyk3.ops.delta_rule.chunked` does exactly that in four stages. It equals the token loop to
#   float64 round-off for every chunk size (short last chunks and initial states included), stays
#   within $10^{-5}$ in float32 at $T = 8192$ with hardly any growth along the sequence, passes `gradcheck`,
#   and equals the papers' transposed form.
# - It costs $6TD^2 + 10TCD + TC^2/3$ flops per head, about twice chunked linear attention, and it was
#   about an order of magnitude faster than the token loop at every length measured (the
#   speed-up column), at a fraction of the machine's matrix-product rate that rises with $C$ and
#   levels off at the largest chunks (the "of matmul" column); the UT transform's small
#   triangular solves and the sequential state pass are where the rest goes.
#
# **Next.** Chapter 9 turns exactly these stages into a GPU kernel: the scaled $KK^\top$, the
# triangular solve, $W$ and $U$, the sequential state pass, the parallel output pass, written in
# Triton and checked against `delta_rule.chunked`.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
