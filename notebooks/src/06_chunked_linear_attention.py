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
# # Chunked linear attention
#
# Chapter 3 left linear attention with two exact forms and no good one. The recurrence does
# $O(T D^2)$ work, but as $T$ steps that must run one after another, each a handful of tiny
# products; the masked parallel form is made of large matrix products, which is what CPUs and
# GPUs are built for, but it does $O(T^2 D)$ work and writes a $T \times T$ matrix. Chapter 5's
# DeltaNet inherited the same dilemma. This chapter, the first of Part III, resolves it for
# linear attention: cut the sequence into chunks of $C$ tokens, use the parallel form *inside*
# each chunk and the recurrence *across* chunks, carried by the state. Every step is then a
# matrix product, and only a short running sum over chunks is sequential.
#
# **In this chapter** you derive the chunked form from the recurrence, build it as a loop over
# chunks and check it equal to `tinyk3`'s vectorised version and to the recurrence (any $T$,
# with the normaliser, from a non-zero state); see that $C = 1$ is the recurrence and $C = T$
# the parallel form; follow how the lib computes the starting state of every chunk at once;
# count the flops (state work against diagonal blocks) and check the count against PyTorch's
# flop counter and against measured time as $C$ varies; find by measurement where the time of
# the vectorised form goes at small $C$; and correct two errors of the post: its two orders of
# multiplication are swapped, and its chunked listing drops the last tokens when $T$ is not a
# multiple of $C$. Part III continues with the delta rule (chapters 7 and 8) and ends in a GPU
# kernel (chapter 9).
#
# **Cost.** About a minute on one CPU core, most of it in the timing experiments (the last cell
# prints the time); `SMOKE = True` runs in a few seconds.

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
from torch.utils.flop_counter import FlopCounterMode

from tinyk3 import bench, checks, cost
from tinyk3.ops import chunks, feature_maps
from tinyk3.ops import linear_attention as la
from tinyk3.timing import distinguishable, time_fn
from tinyk3.util import max_diff
from tinyk3.widgets import figure_png, image_grid_explorer

T_TIME = 256 if SMOKE else 4096  # sequence length of the timing experiments
H_TIME, D_TIME = (2, 16) if SMOKE else (4, 64)  # heads and head size there
CHUNK_SIZES = [2**e for e in range(T_TIME.bit_length())]  # 1, 2, 4, ..., T_TIME
REPEATS = 3 if SMOKE else 7  # timed runs per point: median of k runs (tinyk3.timing)
WIDGET_T = 6 if SMOKE else 16  # the widget draws a WIDGET_T × WIDGET_T attention matrix


# Every time below: time_fn(fn, **TIMING), a warm-up run, then REPEATS runs (fewer
# if they pass 3 s in all); a Timing, the median in seconds with its quartiles.
TIMING = {"repeats": REPEATS, "max_seconds": 3.0}


# %% [markdown]
# ## The problem: one form is sequential, the other quadratic
#
# Chapter 3's two forms, per head, with rows as tokens ($q_t, k_t \in \mathbb{R}^{1 \times D_k}$,
# $v_t \in \mathbb{R}^{1 \times D_v}$, $M$ the $T \times T$ lower-triangular matrix of ones):
#
# $$
# \begin{gathered}
# \text{recurrent:}\quad S_t = S_{t-1} + k_t^\top v_t,\quad o_t = q_t S_t \\
# \text{parallel:}\quad O = Q S_0 + (Q K^\top \odot M)\, V .
# \end{gathered}
# $$
#
# The recurrence costs $4 D_k D_v$ flops per token (a matrix product $[m, k] \times [k, n]$ costs
# $2mkn$ flops, a multiply and an add per term), but in $T$ steps that depend on each other,
# each far too small to keep a processor busy. The parallel form costs $2T^2(D_k + D_v)$ flops for
# the masked scores and their product with $V$, in two large products. Both, timed on one
# CPU thread for $H$ heads (median of several runs, `tinyk3.timing`), next to the rate a large
# matrix product reaches on the same core (`tinyk3.bench.matmul_flops`, $512 \times 512$).

# %%
torch.manual_seed(0)
B, H, T, D = 1, H_TIME, T_TIME, D_TIME
# the timing inputs, float32
q_time, k_time, v_time = (torch.randn(B, H, T, D) / D**0.25 for _ in range(3))

peak = bench.matmul_flops()  # flop/s of a 512 × 512 matrix product on this core
t_recurrent = time_fn(lambda: la.recurrent(q_time, k_time, v_time), **TIMING)
t_parallel = time_fn(lambda: la.parallel(q_time, k_time, v_time), **TIMING)
flops_recurrent = B * H * 4 * T * D * D  # 4·D² per token and head
# the T × T scores and their product with V; then Q S_0 and Kᵀ V
flops_parallel = B * H * (4 * T * T * D + 4 * T * D * D)

print(f"T = {T}, H = {H} heads of D = {D}; "
      f"a 512×512 matrix product runs at {peak / 1e9:.0f} GFLOP/s")
print(f"{'form':>10s} {'flops':>14s} {'sequential steps':>17s} "
      f"{'time':>10s} {'GFLOP/s':>8s}")
for name, flops, steps, seconds in (("recurrent", flops_recurrent, T, t_recurrent),
                                    ("parallel", flops_parallel, 1, t_parallel)):
    print(f"{name:>10s} {flops:14,d} {steps:17,d} {seconds * 1e3:7.1f} ms "
          f"{flops / seconds / 1e9:8.2f}")
print(f"the parallel form does {flops_parallel / flops_recurrent:.0f}x the flops of "
      f"the recurrence (T/D + 1) and takes {t_parallel / t_recurrent:.1f}x its time")

# %% [markdown]
# The parallel form does $T/D + 1$ times the arithmetic of the recurrence (the last line) in
# only a few times its time: it runs at a good fraction of the matrix-product rate, the
# recurrence at a small one (the last column). We want the recurrence's flop count at the
# parallel form's rate. On a GPU the gap is wider: thousands of arithmetic units wait on each of
# the $T$ sequential steps.

# %% [markdown]
# ## The idea: attention inside a chunk, the state across chunks
#
# Unroll the recurrence from an initial state $S_0$ (zero, or the state a previous call left):
# number the tokens $t = 1, \dots, T$, so that
#
# $$
# o_t = q_t S_t = q_t \Big( S_0 + \sum_{j \le t} k_j^\top v_j \Big) .
# $$
#
# Cut the sequence into chunks of $C$ tokens: chunk $c = 0, 1, \dots$ holds tokens
# $cC + 1, \dots, (c+1)C$. For a token $t$ in chunk $c$, split the sum over $j \le t$ into the
# tokens of earlier chunks and the tokens of its own chunk:
#
# $$
# o_t = q_t \underbrace{\Big( S_0 + \sum_{j \le cC} k_j^\top v_j \Big)}_{S_{[c]}\;=\;S_{cC}}
#     \;+\; \sum_{j = cC + 1}^{t} (q_t \cdot k_j)\, v_j .
# $$
#
# The first term reads one matrix, the state at the start of the chunk, $S_{[c]}$ (the
# bracket marks a chunk index, as in Yang et al. 2024). The second is causal attention
# restricted to the chunk: chapter 3's parallel form on a $C \times C$ block. Stack the chunk's
# rows into $Q_{[c]}, K_{[c]} \in \mathbb{R}^{C \times D_k}$, $V_{[c]} \in \mathbb{R}^{C \times D_v}$,
# let $M$ now be the $C \times C$ lower-triangular matrix of ones, and both terms become matrix
# products; the state then moves on by the whole chunk at once:
#
# $$
# O_{[c]} = \underbrace{Q_{[c]}\, S_{[c]}}_{\text{earlier chunks}}
#         + \underbrace{\big(Q_{[c]} K_{[c]}^\top \odot M\big)\, V_{[c]}}_{\text{this chunk}},
# \qquad
# S_{[c+1]} = S_{[c]} + K_{[c]}^\top V_{[c]} .
# $$
#
# Inside a chunk the product is taken in *score order*, $(Q K^\top) V$, the order of attention,
# with the mask; across chunks in *state order*, $Q (K^\top V)$, the order of the recurrence,
# where no mask is needed because every earlier token is in the past of every token of the chunk
# (the post says the same with the brackets swapped: see the erratum below). The two limits are
# the forms we started from:
#
# - $C = 1$: each chunk is one token, $M = [1]$, and $o_t = q_t S_{t-1} + (q_t \cdot k_t) v_t
#   = q_t (S_{t-1} + k_t^\top v_t)$: the recurrence.
# - $C \ge T$: one chunk, $S_{[0]} = S_0$, and $O = Q S_0 + (Q K^\top \odot M) V$: the parallel form.
#
# **The papers' layout.** Yang et al. store the transposed state ($S^\top$ here, see the
# [notation page](../book/notation.md)); in their layout the same step reads
# $S_{[c+1]} = S_{[c]} + V_{[c]}^\top K_{[c]}$ and the first term $Q_{[c]} S_{[c]}^\top$.

# %% [markdown]
# (erratum-score-state-order)=
# ## Erratum: the post swaps the two orders
#
# The post describes its chunked listing in these words (verbatim):
#
# > Within a block, we do q(kᵀv). This is score first, the normal attention order with masking.
# > Across blocks, we follow (kᵀv)q, so we’re doing recurrent order, state first.
#
# The brackets are the wrong way round. Score first is $(q k^\top) v$: the scores $q_i \cdot k_j$
# are formed, masked, and then weight the values; that is what the listing does inside a block,
# `(q_c @ k_c.transpose(-1,-2)).tril() @ v_c`. State first is $q (k^\top v)$: the keys and values
# are summed into the state, which the query then reads, `q_c @ S`. And $(k^\top v) q$ is not a
# product at all in the row layout of the listing: $k^\top v$ is $D_k \times D_v$ and $q$ has
# $C$ rows of $D_k$. Checked on one chunk of $C = 4$ tokens with $D_k = D_v = 3$:

# %%
torch.manual_seed(5)
Qb, Kb, Vb = (torch.randn(4, 3, dtype=torch.float64) for _ in range(3))  # C = 4, D = 3
Mb = torch.ones(4, 4, dtype=torch.float64).tril()
listing_block = (Qb @ Kb.T).tril() @ Vb  # what the listing computes within a block
score_first = ((Qb @ Kb.T) * Mb) @ Vb  # (q kᵀ) v, masked
print(f"within a block: listing vs (q kᵀ ⊙ M) v: "
      f"{max_diff(listing_block, score_first):.0e}")
state_first = Qb @ (Kb.T @ Vb)  # q (kᵀ v): no scores to mask, so no causality
print(f"within a block: listing vs q (kᵀ v): "
      f"{max_diff(listing_block, state_first):.2f} "
      f"(every token reads the whole block)")
try:
    (Kb.T @ Vb) @ Qb  # the post's "(kᵀv)q"
except RuntimeError as err:
    print(f"(kᵀ v) q: RuntimeError: {err}")

# %% [markdown]
# The listing is right and only the sentence is wrong. A reader who implements the sentence gets,
# inside a block, outputs that read the whole block, later tokens included (the second line), and
# across blocks either a shape error or, when $C = D$, a product that runs and means nothing. This
# erratum is listed on the [errata page](../book/errata.md).

# %% [markdown]
# ## Build it: a loop over chunks
#
# The two equations above, one chunk per iteration, with the normaliser of chapter 3 as an
# option. The normaliser splits the same way: $z_{[c]} = z_0 + \sum_{j \le cC} k_j$ carries the
# earlier chunks, the row sums of the masked block add this chunk's part,
#
# $$
# q_t \cdot z_t = q_t \cdot z_{[c]} + \big[(Q_{[c]} K_{[c]}^\top \odot M)\,\mathbf{1}\big]_t ,
# \qquad z_{[c+1]} = z_{[c]} + \mathbf{1}^\top K_{[c]} .
# $$
#
# The last chunk may be short: slicing past the end of a tensor simply returns fewer rows, and
# the mask is built for the rows there are.

# %%
def chunked_loop(q, k, v, C, normalize=False, initial_state=None, eps=1e-6):
    """q, k: [B, H, T, Dk]; v: [B, H, T, Dv].

    Returns (o [B, H, T, Dv], final state S or (S, z))."""
    B, H, T, Dk = q.shape
    if initial_state is None:
        S, z = q.new_zeros(B, H, Dk, v.shape[-1]), q.new_zeros(B, H, Dk)  # S_[0], z_[0]
    else:
        S, z = initial_state if normalize else (initial_state, None)
    outs = []
    for start in range(0, T, C):  # ⌈T/C⌉ chunks; the last may hold fewer than C tokens
        # [B, H, n, D], n <= C
        Qc, Kc, Vc = (x[:, :, start : start + C] for x in (q, k, v))
        scores = (Qc @ Kc.transpose(-1, -2)).tril()  # Q_[c] K_[c]ᵀ ⊙ M   [B, H, n, n]
        # O_[c] = Q_[c] S_[c] + (Q_[c] K_[c]ᵀ ⊙ M) V_[c]   [B, H, n, Dv]
        o = Qc @ S + scores @ Vc
        if normalize:
            # q_t · z_t   [B, H, n, 1]
            denom = (Qc @ z.unsqueeze(-1)) + scores.sum(-1, keepdim=True)
            o = o / (denom + eps)
            z = z + Kc.sum(dim=2)  # z_[c+1] = z_[c] + 1ᵀ K_[c]
        S = S + Kc.transpose(-1, -2) @ Vc  # S_[c+1] = S_[c] + K_[c]ᵀ V_[c]
        outs.append(o)
    return torch.cat(outs, dim=2), ((S, z) if normalize else S)


torch.manual_seed(1)
q, k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 6)
o, S = chunked_loop(q, k, v, C=4)
bounds = [(s, min(s + 4, 10)) for s in range(0, 10, 4)]
print(f"T = 10, C = 4: chunks {bounds} (start, end)")
print(f"q, k {list(q.shape)}, v {list(v.shape)} -> "
      f"o {list(o.shape)}, S {list(S.shape)}")

# %% [markdown]
# ## Check: the two limits, and the lib
#
# First the limits, in float64: the loop at $C = 1$ against the recurrence and at $C = T$ against
# the parallel form, and the same for `tinyk3.ops.linear_attention.chunked`, the lib's version
# (same contract as `recurrent` and `parallel`: `chunk_size`, `normalize`, `initial_state`).

# %%
torch.manual_seed(2)
B, H, T, Dk, Dv = 2, 3, 24, 8, 6
# positive features
q = feature_maps.elu_plus_one(torch.randn(B, H, T, Dk, dtype=torch.float64))
k = feature_maps.elu_plus_one(torch.randn(B, H, T, Dk, dtype=torch.float64))
v = torch.randn(B, H, T, Dv, dtype=torch.float64)
o_rec, S_rec = la.recurrent(q, k, v)
o_par, S_par = la.parallel(q, k, v)
o_loop_1, o_lib_1 = chunked_loop(q, k, v, 1)[0], la.chunked(q, k, v, chunk_size=1)[0]
o_loop_T, o_lib_T = chunked_loop(q, k, v, T)[0], la.chunked(q, k, v, chunk_size=T)[0]
print(f"C = 1: max |loop - recurrent| = {max_diff(o_loop_1, o_rec):.1e}, "
      f"max |lib chunked - recurrent| = {max_diff(o_lib_1, o_rec):.1e}")
print(f"C = T: max |loop - parallel|  = {max_diff(o_loop_T, o_par):.1e}, "
      f"max |lib chunked - parallel|  = {max_diff(o_lib_T, o_par):.1e}")
print(f"(outputs up to {o_rec.abs().max().item():.0f}; "
      f"the parallel form against the recurrence: {max_diff(o_par, o_rec):.1e})")

# %% [markdown]
# Now every case the chapter needs, at $T = 50$ and chunk sizes $1, 3, 7, 16, 50, 64$ (so the
# last chunk is short for 3, 7 and 16, and $C > T$ for 64): without and with the normaliser, from
# a zero and from a non-zero initial state, in float64 and float32. Each line gives the largest
# distance over the six chunk sizes, for the outputs and for the final state, from the loop to the
# lib's `chunked` and from the loop to the recurrence, and that distance relative to the largest
# output.

# %%
torch.manual_seed(3)
B, H, T, Dk, Dv = 2, 2, 50, 8, 6
q64 = feature_maps.elu_plus_one(torch.randn(B, H, T, Dk, dtype=torch.float64))
k64 = feature_maps.elu_plus_one(torch.randn(B, H, T, Dk, dtype=torch.float64))
v64 = torch.randn(B, H, T, Dv, dtype=torch.float64)
S0 = torch.randn(B, H, Dk, Dv, dtype=torch.float64)  # a state left by an earlier call
# and its normaliser
z0 = feature_maps.elu_plus_one(torch.randn(B, H, Dk, dtype=torch.float64)) * 10

print(f"{'dtype':>8s} {'normalize':>9s} {'S_0':>8s} | {'loop - lib chunked':>22s} | "
      f"{'loop - recurrent':>22s} | {'relative':>8s}")
for dtype in (torch.float64, torch.float32):
    q, k, v = (x.to(dtype) for x in (q64, k64, v64))
    for normalize in (False, True):
        for nonzero in (False, True):
            init = None
            if nonzero:
                init = (S0.to(dtype), z0.to(dtype)) if normalize else S0.to(dtype)
            opts = dict(normalize=normalize, initial_state=init)
            o_ref, st_ref = la.recurrent(q, k, v, **opts)
            worst = {"lib o": 0.0, "lib S": 0.0, "rec o": 0.0, "rec S": 0.0}
            for C in (1, 3, 7, 16, 50, 64):
                o_mine, st_mine = chunked_loop(q, k, v, C, **opts)
                o_lib, st_lib = la.chunked(q, k, v, chunk_size=C, **opts)
                # the states S, without the normaliser z
                S_mine, S_lib, S_ref = (s[0] if normalize else s
                                        for s in (st_mine, st_lib, st_ref))
                dists = {"lib o": max_diff(o_mine, o_lib),
                         "lib S": max_diff(S_mine, S_lib),
                         "rec o": max_diff(o_mine, o_ref),
                         "rec S": max_diff(S_mine, S_ref)}
                for key, d in dists.items():
                    worst[key] = max(worst[key], d)
            rel = worst["rec o"] / o_ref.abs().max().item()
            dtype_name = str(dtype).replace("torch.", "")
            start_state = "random" if nonzero else "zero"
            print(f"{dtype_name:>8s} {normalize!s:>9s} {start_state:>8s} | "
                  f"o {worst['lib o']:8.1e}  S {worst['lib S']:8.1e} | "
                  f"o {worst['rec o']:8.1e}  S {worst['rec S']:8.1e} | {rel:8.1e}")

# %% [markdown]
# In float64 every distance is round-off (relative to the outputs, the last column, below
# $10^{-15}$); in float32 it is a few $10^{-7}$ relative, float32's precision. The three forms add
# the same terms in different orders, and that is all that separates them. From here on the
# chapter uses the lib's `chunked`.

# %% [markdown]
# ## How the lib computes every chunk at once
#
# The loop still runs its chunks one after another. It does not have to: the only thing chunk $c$
# needs from the chunks before it is $S_{[c]}$, and by the state equation that is a sum,
#
# $$
# S_{[c]} = S_0 + \sum_{c' < c} K_{[c']}^\top V_{[c']} ,
# $$
#
# an *exclusive prefix sum* (each chunk's own term left out) of the per-chunk products
# $K_{[c']}^\top V_{[c']}$. Those products do not depend on each other, so all of them are one batched
# matrix product; the prefix sum is $N$ additions of a $D_k \times D_v$ matrix, in place; and with
# every $S_{[c]}$ known, the outputs of all chunks are again batched products. Here is `la.chunked`
# and its scan:

# %%
tinyk3.notebook.show_source(la.chunked)
tinyk3.notebook.show_source(chunks.exclusive_scan_)

# %% [markdown]
# Step by step: `to_chunks` zero-pads the sequence to $N C$ tokens, $N = \lceil T / C \rceil$, and
# views it as `[B, H, N, C, D]` (padded rows have zero keys and values, so they add nothing to the
# state, and their outputs are cut off at the end); `states` first holds the $N$ products
# $K_{[c]}^\top V_{[c]}$, and the scan overwrites entry $c$ with $S_{[c]}$ and returns the final
# state; the outputs of all chunks then come from two batched products and the masked scores.
# The exclusive prefix sum, written here with `cumsum`, checked against the states the loop
# passes through (the state the loop holds when it reaches chunk $c$):

# %%
torch.manual_seed(4)
B, H, T, D, C = 1, 2, 20, 4, 6  # 4 chunks, the last of 2 tokens
q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
S0 = torch.randn(B, H, D, D, dtype=torch.float64)
# S_[c]: the state after the tokens before chunk c
loop_states = [S0] + [chunked_loop(q[:, :, :s], k[:, :, :s], v[:, :, :s], C,
                                   initial_state=S0)[1] for s in range(C, T, C)]
n = -(-T // C)
# zero-padded and cut into chunks   [B, H, N, C, D]
Kc = torch.cat([k, k.new_zeros(B, H, n * C - T, D)], dim=2).view(B, H, n, C, D)
Vc = torch.cat([v, v.new_zeros(B, H, n * C - T, D)], dim=2).view(B, H, n, C, D)
kv = Kc.transpose(-1, -2) @ Vc  # every K_[c]ᵀ V_[c] at once    [B, H, N, D, D]
exclusive = S0.unsqueeze(2) + kv.cumsum(dim=2) - kv  # S_0 + Σ_{c' < c} K_[c']ᵀ V_[c']
print(f"N = {n} chunks; max |prefix sum - states of the loop| = "
      f"{max(max_diff(exclusive[:, :, c], s) for c, s in enumerate(loop_states)):.1e}")

# %% [markdown]
# The lib does not call `cumsum` here; the timing experiment below shows why.
#
# **What remains sequential.** The recurrence has $T$ dependent steps. The chunked form has one
# dependent step per chunk, an addition of two $D_k \times D_v$ matrices in the scan, and
# everything else (the $N$ products $K_{[c]}^\top V_{[c]}$, the $N$ diagonal blocks, the $N$ reads
# $Q_{[c]} S_{[c]}$) is independent across chunks, heads and batch. A GPU kernel exploits exactly
# that split (chapter 9): one pass computes the chunk states in order, another all the outputs
# in parallel. The price is memory: the vectorised form holds every $S_{[c]}$, $N D_k D_v$
# numbers per head, where the loop holds one. At the timing experiment's sizes:

# %% tags=["nbval-check-output"]
inputs_mib = 3 * 4096 * 4 * 64 * 4 / 2**20  # q, k, v: T = 4096, 4 heads of 64, float32
for C in (1, 16, 64):
    n_states = -(-4096 // C) * 4 * 64 * 64  # N chunk states of 64 × 64, 4 heads
    print(f"T = 4096, 4 heads of D = 64, C = {C:3d}: every chunk's state, float32: "
          f"{n_states * 4 / 2**20:6.1f} MiB (the inputs q, k, v: {inputs_mib:.0f} MiB)")

# %% [markdown]
# At $C = 1$ the vectorised form stores every $S_t$, like chapter 3's cumsum form. The
# experiment below shows what that costs in time.

# %% [markdown]
# ## Which entries of the attention matrix each form computes
#
# Linear attention without the normaliser is $O = (QK^\top \odot M) V$ for a $T \times T$ matrix of
# scores $q_i \cdot k_j$, whatever form computes it. The forms differ in *how* each entry reaches the
# output. In the chunked form an entry $(i, j)$ with $j \le i$ is either
#
# - in a **diagonal block** (tokens $i$ and $j$ in the same chunk): the score $q_i \cdot k_j$ is
#   computed explicitly, in $Q_{[c]} K_{[c]}^\top$, and multiplied with $V_{[c]}$ (score order); the
#   block's upper triangle is computed too and then zeroed by $M$; or
# - **below the blocks** ($j$ in an earlier chunk): the score is never formed; $k_j^\top v_j$ went
#   into the state, and $q_i S_{[c]}$ reads all such terms at once (state order).
#
# The widget draws both for a $T \times T$ matrix, for every chunk size from 1 to $T$. The slider
# `view` chooses what is shown (both; the diagonal blocks; the entries reached through the state),
# the slider `C` the chunk size; the picture's title repeats $C$ and says how many chunks there
# are and how the entries split. Drawing all the pictures takes a few seconds.

# %%
# colours: computed in a block and used; computed, then masked; through the state
BLOCK, MASKED, STATE = (0.17, 0.42, 0.73), (0.80, 0.86, 0.94), (0.94, 0.55, 0.16)
VIEWS = ["both forms", "diagonal blocks (score order)",
         "through the state (state order)"]
VIEW_LABELS = ["both forms", "diagonal blocks", "through the state"]  # on the slider


def entries_png(T, C, view):
    i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")  # query i, key j
    same_chunk = (i // C) == (j // C)
    image = np.ones((T, T, 3))  # white: never needed (j > i, outside the blocks)
    if view in (0, 1):
        image[same_chunk & (j > i)] = MASKED  # in Q_[c] K_[c]ᵀ, then zeroed by M
        image[same_chunk & (j <= i)] = BLOCK  # computed and used
    if view in (0, 2):
        image[~same_chunk & (j < i)] = STATE  # reached through q_i S_[c]
    fig, ax = plt.subplots(figsize=(3.4, 3.6))
    ax.imshow(image, interpolation="nearest", extent=(-0.5, T - 0.5, T - 0.5, -0.5))
    for b in range(C, T, C):  # chunk boundaries
        ax.axhline(b - 0.5, color="k", lw=0.6)
        ax.axvline(b - 0.5, color="k", lw=0.6)
    sizes = [min(C, T - s) for s in range(0, T, C)]
    in_blocks = sum(n * (n + 1) // 2 for n in sizes)
    last = f", last {sizes[-1]}" if sizes[-1] != C else ""
    plural = "s" if len(sizes) > 1 else ""
    via_state = T * (T + 1) // 2 - in_blocks
    ax.set_title(f"C = {C}: {len(sizes)} chunk{plural}{last}\n"
                 f"{in_blocks} pairs in blocks, {via_state} through the state",
                 fontsize=9)
    ax.set_xlabel("key j", fontsize=8)
    ax.set_ylabel("query i", fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    fig.text(0.5, 0.0, VIEWS[view], ha="center", fontsize=8)
    return figure_png(fig, colors=16)


t0 = time.perf_counter()
C_VALUES = list(range(1, WIDGET_T + 1))
pngs = [[entries_png(WIDGET_T, C, view) for C in C_VALUES] for view in range(3)]
n_bytes = sum(len(p) for row in pngs for p in row)
print(f"{n_bytes / 1e3:.0f} kB of pictures in {time.perf_counter() - t0:.1f} s")
image_grid_explorer(pngs, "view", "C", row_labels=VIEW_LABELS, col_labels=C_VALUES,
                    title=f"The {WIDGET_T}×{WIDGET_T} attention matrix: "
                          "blue = score computed in a diagonal block "
                          "(pale: computed, then masked), "
                          "orange = reached through the state")

# %% [markdown]
# At $C = 1$ the blocks are the diagonal alone, the $1 \times 1$ scores $q_t \cdot k_t$, and
# everything else comes through the state: the recurrence. At $C = T$ there is one block, the whole
# lower triangle is computed as scores and nothing goes through the state: the parallel form,
# which also computes the upper triangle only to zero it. In between, the number of pairs in
# blocks grows with $C$ (about $T C / 2$) and the number reached through the state shrinks. When
# $C$ does not divide $T$ the last block is smaller: the pictures for such $C$ are the case the
# erratum below is about.

# %% [markdown]
# ## The cost: state work against diagonal blocks
#
# Count the four matrix products of one chunk, per head, with the rule $[m, k] \times [k, n]$ costs
# $2mkn$ flops:
#
# | product | shapes | flops |
# |---|---|---|
# | $Q_{[c]} S_{[c]}$ | $[C, D_k] \times [D_k, D_v]$ | $2 C D_k D_v$ |
# | $K_{[c]}^\top V_{[c]}$ | $[D_k, C] \times [C, D_v]$ | $2 C D_k D_v$ |
# | $Q_{[c]} K_{[c]}^\top$ | $[C, D_k] \times [D_k, C]$ | $2 C^2 D_k$ |
# | $(\cdot \odot M)\, V_{[c]}$ | $[C, C] \times [C, D_v]$ | $2 C^2 D_v$ |
#
# Over $T/C$ chunks, and for $D_k = D_v = D$:
#
# $$
# F(C) = \underbrace{4\,T D^2}_{\text{state work}} + \underbrace{4\,T C D}_{\text{diagonal blocks}}
# \qquad \text{(plus } T D^2 / C \text{ additions in the scan).}
# $$
#
# The state work does not depend on $C$; the diagonal blocks grow linearly in it, and the two are
# equal at $C = D$. The masked half of each block is counted, because a dense product computes
# it. At $C = 1$ the count is the recurrence's plus $4TD$; at $C = T$ it is the parallel form's.
# `tinyk3.cost` holds this count for the lib's `chunked` ($\lceil T/C \rceil$ padded chunks), and
# for the two limits:

# %%
tinyk3.notebook.show_source(cost.chunked_linear_attention_flops)

# %% [markdown]
# **Check the count against what runs.** PyTorch's `FlopCounterMode` intercepts every matrix
# product the code performs and counts $2mkn$ for each. Running `la.chunked` under it, for several
# $T$ and $C$ (including $T$ not a multiple of $C$), and `la.parallel`:

# %% tags=["nbval-check-output"]
def counted_flops(fn, *args, **kwargs):
    """Matmul flops PyTorch's flop counter sees while fn runs."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


B, H, D = 1, 2, 32
for T, C in ((1024, 64), (1000, 64), (1024, 1), (1024, 1024)):
    x = torch.zeros(B, H, T, D)
    measured = counted_flops(la.chunked, x, x, x, chunk_size=C)
    model = B * H * cost.chunked_linear_attention_flops(T, D, C).matmul
    print(f"chunked  T = {T:4d}, C = {C:4d}: PyTorch counts {measured:13,d}, "
          f"the model says {model:13,d}")
measured = counted_flops(la.parallel, x, x, x)
model = B * H * cost.parallel_linear_attention_flops(1024, D).matmul
print(f"parallel T = 1024:           PyTorch counts {measured:13,d}, "
      f"the model says {model:13,d}")

# %% [markdown]
# Exact agreement. The split and the limits, for one head at the timing experiment's size:

# %% tags=["nbval-check-output"]
T, D = 4096, 64
print(f"{'form':>16s} {'state work':>14s} {'diagonal':>14s} {'scan adds':>11s} "
      f"{'sequential steps':>17s}")
rows = [("recurrent", cost.recurrent_linear_attention_flops(T, D))]
rows += [(f"chunked C={C}", cost.chunked_linear_attention_flops(T, D, C))
         for C in (1, 16, 64, 256, 4096)]
rows += [("parallel", cost.parallel_linear_attention_flops(T, D))]
for name, f in rows:
    print(f"{name:>16s} {f.state:14,d} {f.diagonal:14,d} {f.scan:11,d} "
          f"{f.sequential_steps:17,d}")

# %% [markdown]
# **A note on the post's count.** The post gives the two terms as $2LD^2$ (state work) and $2LCD$
# (diagonal blocks), $L$ the sequence length. Their shape is right, a fixed term plus one linear in
# $C$, and so is its conclusion that $C = 1$ does the fewest operations. The constants are half of
# the flop counts above, in both terms:

# %% tags=["nbval-check-output"]
T, D, C = 4096, 64, 64
x = torch.zeros(1, 1, T, D)
posts = 2 * T * D * D + 2 * T * C * D
counted = counted_flops(la.chunked, x, x, x, chunk_size=C)
print(f"T = {T}, D = {D}, C = {C}, one head: the post's 2LD² + 2LCD = {posts:,}; "
      f"PyTorch counts {counted:,} ({counted / posts:.0f}x)")

# %% [markdown]
# The post counts one operation per multiply-add. That is a legitimate unit, but FLOP/s figures
# count the multiply and the add separately ($2mkn$ per product, as `bench.matmul_flops` and
# PyTorch's counter do), so a time predicted from the post's numbers is too short by half. The
# course uses flops throughout: $4TD^2 + 4TCD$ per head.

# %% [markdown]
# ## Experiment: time against the chunk size
#
# The flop count says the smaller $C$, the less work. Time says otherwise. On one CPU thread, for
# $T = 4096$ tokens and $H = 4$ heads of size $D = 64$, float32, and for every
# power of two $C$ from 1 to $T$, time two chunked forms:
#
# - **the lib's `chunked`**: every chunk at once, with the exclusive prefix sum, holding all $N$
#   chunk states;
# - **the chunk loop** built above: one Python iteration per chunk, holding one state.
#
# With them, the recurrence (the $C = 1$ limit) and the parallel form ($C = T$) from the first
# section. Each time is the median of several runs (`tinyk3.timing`); the table gives the
# quartiles, and where the two forms' quartile ranges overlap it says so instead of ranking them.
# The cell prints its time.

# %%
t0 = time.perf_counter()
B, H, T, D = 1, H_TIME, T_TIME, D_TIME


times = {"lib chunked": [], "chunk loop": []}
with torch.no_grad():
    for C in CHUNK_SIZES:
        lib_form = partial(la.chunked, q_time, k_time, v_time, chunk_size=C)
        loop_form = partial(chunked_loop, q_time, k_time, v_time, C)
        times["lib chunked"].append(time_fn(lib_form, **TIMING))
        times["chunk loop"].append(time_fn(loop_form, **TIMING))
flops = np.array([B * H * cost.chunked_linear_attention_flops(T, D, C).matmul
                  for C in CHUNK_SIZES], dtype=float)
n_chunk = np.array([cost.n_chunks(T, C) for C in CHUNK_SIZES], dtype=float)
print(bench.stamp())
print(f"{'C':>5s} {'chunks':>6s} {'GFLOP':>6s} | {'lib chunked (quartiles)':>25s} "
      f"| {'chunk loop (quartiles)':>25s} | faster")
verdicts = []
for idx, C in enumerate(CHUNK_SIZES):
    a, b = times["lib chunked"][idx], times["chunk loop"][idx]
    verdict = ("within the spread" if not distinguishable(a, b)
               else "lib chunked" if a < b else "chunk loop")
    verdicts.append(verdict)
    print(f"{C:5d} {int(n_chunk[idx]):6d} {flops[idx] / 1e9:6.2f} | "
          f"{a.ms() + ' ms':>25s} | {b.ms() + ' ms':>25s} | {verdict}")
print(f"recurrent {t_recurrent * 1e3:.1f} ms, parallel {t_parallel * 1e3:.1f} ms; "
      f"matmul rate {peak / 1e9:.0f} GFLOP/s ({time.perf_counter() - t0:.0f} s)")
for name, secs in times.items():
    best = int(np.argmin(secs))
    print(f"{name}: fastest at C = {CHUNK_SIZES[best]} ({secs[best] * 1e3:.1f} ms), "
          f"{t_recurrent / secs[best]:.0f}x faster than the recurrence and "
          f"{t_parallel / secs[best]:.0f}x faster than the parallel form")
print(", ".join(f"{name} faster at {verdicts.count(name)}" for name in times)
      + f", within the spread at {verdicts.count('within the spread')} "
      f"of the {len(CHUNK_SIZES)} chunk sizes")

# %% mystnb={"figure": {"caption": "Time (top) and flop rate (bottom) of the lib's vectorised chunked form and of the chunk loop against the chunk size $C$, next to the recurrence ($C = 1$), the parallel form ($C = T$) and the matrix-product rate: both forms trace a U, and at small $C$ the rate collapses although the flops barely change.", "name": "fig-chunked-time-rate-vs-c"}, "image": {"alt": "Two stacked line plots against chunk size on a log axis from 1 to T. Top: time in milliseconds on a log scale for the lib's chunked form and the chunk loop, both U-shaped with their lowest point between 16 and 128 tokens per chunk, a triangle for the recurrence at C = 1, one for the parallel form at C = T, and a dashed line below both for the time of the flops at the matrix-product rate, far below at small chunks and within a small factor at the largest. Bottom: GFLOP per second of both forms, near zero at small chunks, rising to a few tens from about 64 tokens per chunk on and falling again at the largest chunks, below a dashed line for the matrix-product rate."}}
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.8, 6.4), sharex=True)
for name, marker in (("lib chunked", "o-"), ("chunk loop", "s-")):
    ax1.plot(CHUNK_SIZES, np.array(times[name]) * 1e3, marker, ms=4, label=name)
    ax2.plot(CHUNK_SIZES, flops / np.array(times[name]) / 1e9, marker, ms=4, label=name)
ax1.plot([1], [t_recurrent * 1e3], "k^", ms=8, label="recurrent (C = 1)")
ax1.plot([T], [t_parallel * 1e3], "kv", ms=8, label="parallel (C = T)")
ax1.plot(CHUNK_SIZES, flops / peak * 1e3, "k--", lw=1, label="flops at the matmul rate")
ax1.set(yscale="log", ylabel="time (ms)",
        title=f"T = {T}, {H} heads of D = {D}, one thread")
ax2.axhline(peak / 1e9, color="k", ls="--", lw=1, label="512×512 matmul")
ax2.set(xlabel="chunk size C", ylabel="GFLOP/s (flops of the model)",
        title="Rate achieved")
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
ax1.legend(fontsize=8, ncol=2, loc="upper center")
ax2.legend(fontsize=8, loc="center left")
plt.tight_layout()
plt.show()

# %% [markdown]
# Both forms trace a U. On the right the diagonal blocks dominate: from $C = 512$ on, each
# doubling of $C$ about doubles the flops, and the time grows with them, at a rate that stays a
# sizeable fraction of the matrix-product rate (lower panel; the dashed line in the upper panel
# is the time the flops alone would take at that rate). On the left the flops barely change (the
# state work $4TD^2$ is the same at every $C$), yet the time at $C = 1$ is many times the time at
# the bottom of the U and the rate collapses: the cost there is per chunk, not per flop. The
# bottom of the U (the lines under the table give the fastest $C$) is at or near the sizes GPU
# kernels use too: 64 or 128, the size of a tensor-core tile.
#
# **A cost model with a per-chunk term.** If each chunk costs a fixed amount $b$ besides its
# flops, then
#
# $$
# \text{time}(C) \approx a \cdot F(C) + b \cdot \lceil T / C \rceil ,
# $$
#
# with $1/a$ the flop rate on the work itself. A least-squares fit of $a$ and $b$ to each form's
# measurements (relative errors, so the short times weigh as much as the long ones):

# %%
def fit_cost(seconds):
    """Least squares for seconds ≈ a·flops + b·chunks, on relative errors.

    Returns a, b and the prediction."""
    y = np.asarray(seconds)
    X = np.stack([flops, n_chunk], axis=1) / y[:, None]
    (a, b), *_ = np.linalg.lstsq(X, np.ones_like(y), rcond=None)
    return a, b, a * flops + b * n_chunk


fits = {name: fit_cost(secs) for name, secs in times.items()}
for name, (a, b, _) in fits.items():
    print(f"{name:12s}: 1/a = {1 / a / 1e9:5.1f} GFLOP/s "
          f"({1 / a / peak:.0%} of the matmul rate), b = {b * 1e6:6.1f} µs per chunk")
print(f"measured / model:\n{'C':>6s} {'lib chunked':>12s} {'chunk loop':>12s}")
for idx, C in enumerate(CHUNK_SIZES):
    ratios = [times[name][idx] / fit[2][idx] for name, fit in fits.items()]
    print(f"{C:6d} " + " ".join(f"{r:12.2f}" for r in ratios))

# %% mystnb={"figure": {"caption": "Measured time of the two chunked forms against the chunk size $C$ (dots) and the fitted model $a \\cdot F(C) + b \\cdot \\lceil T/C \\rceil$ (lines): two numbers per form, a flop rate and a cost per chunk, reproduce the U and where its bottom lies.", "name": "fig-chunked-cost-model-fit"}, "image": {"alt": "Log-log plot of time in milliseconds against chunk size from 1 to T: dots for the measured times of the lib's chunked form and the chunk loop, each with a fitted line of the same colour; all four trace a U with the lowest point between 16 and 128 tokens per chunk, the lines close to the dots in the middle, while the measured times lie above the lines at the largest chunk sizes."}}
fig, ax = plt.subplots(figsize=(6.8, 4))
for (name, (a, b, pred)), color in zip(fits.items(), ("C0", "C1")):
    ax.plot(CHUNK_SIZES, np.array(times[name]) * 1e3, "o", color=color, ms=4,
            label=f"{name}, measured")
    ax.plot(CHUNK_SIZES, pred * 1e3, "-", color=color, lw=1,
            label=f"model: F/({1 / a / 1e9:.0f} GFLOP/s) + {b * 1e6:.0f} µs × chunks")
ax.set(xscale="log", yscale="log", xlabel="chunk size C", ylabel="time (ms)",
       title="Time ≈ a·flops + b·chunks, fitted")
ax.set_xscale("log", base=2)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Two numbers per form reproduce the U: its shape, about where its bottom is, and most points to
# within a few tens of percent (the ratio table). Among the largest misses are the chunk loop's
# at the largest chunks, where the flop rate is not one number: it depends on the shapes of the
# products and on what fits in the caches (the $C \times C$ score blocks of the largest chunks do
# not). The per-chunk cost $b$ is what the flop count leaves out:
#
# - **The chunk loop** pays the interpreter and PyTorch's dispatch for the half-dozen operations
#   of each iteration, whatever their size. The recurrence pays the same per token, which is why
#   the loop at $C = 1$ and `la.recurrent` land within a small factor of each other.
# - **The lib's form** pays one small iteration per chunk in its scan, and it writes all $N$ chunk
#   states, $N D^2$ numbers per head, then reads them back: at $C = 1$ that is a trip to memory
#   for every token's state, which the loop, holding one state in cache, never makes.
#
# **Where the time of the vectorised form goes.** A first version of `la.chunked` computed the
# scan as `torch.cumsum(kv, dim=2)`, one line and no Python loop, and at $C = 1$ it was several
# times slower than the chunk loop. The states it moves at $C = 1$ (a few hundred MiB) would take
# a fraction of a second at the memory bandwidth chapter 3 measured, so the traffic alone did not
# explain it. Timing the scan on its own, three ways, on the same $N$ states of $D \times D$: that
# `cumsum` along the chunk axis (first column: at $C = 1$ it alone takes longer than the whole
# chunk loop in the table above); the same `cumsum` with the chunk axis innermost in memory
# (`[B, H, D, D, N]`); and the lib's in-place loop, next to the whole `la.chunked` call:

# %%
def cumsum_scan(kv, S_start):
    """The first edition's scan: cumsum along the chunk axis, S_0 put in front."""
    S_first = S_start.unsqueeze(2)  # [B, H, 1, D, D]
    return torch.cat([S_first, S_first + kv.cumsum(dim=2)], dim=2)


print(f"{'C':>3s} {'N':>5s} {'states':>9s} | {'cumsum, dim 2':>13s} "
      f"{'cumsum, innermost':>17s} {'in place':>9s} | {'la.chunked':>10s} "
      f"{'effective':>10s}")
for C in (1, 16, 64) if not SMOKE else (1, 16):
    N = cost.n_chunks(T, C)
    kv = torch.zeros(B, H, N, D, D)  # stand-in for the N products K_[c]ᵀ V_[c]
    kv_inner = torch.zeros(B, H, D, D, N)  # the same numbers, the chunk axis innermost
    S_start = torch.zeros(B, H, D, D)
    t_cumsum = time_fn(partial(cumsum_scan, kv, S_start), **TIMING)
    t_inner = time_fn(partial(kv_inner.cumsum, dim=-1), **TIMING)
    t_loop = time_fn(partial(chunks.exclusive_scan_, kv, S_start), **TIMING)
    whole = times["lib chunked"][CHUNK_SIZES.index(C)]
    state_bytes = kv.numel() * kv.element_size()
    # the states are written (K_[c]ᵀ V_[c]), read and written (scan), read (Q_[c] S_[c])
    rate = 4 * state_bytes / whole / 1e9
    print(f"{C:3d} {N:5d} {state_bytes / 2**20:5.1f} MiB | {t_cumsum * 1e3:10.1f} ms "
          f"{t_inner * 1e3:14.1f} ms {t_loop * 1e3:6.1f} ms | {whole * 1e3:7.1f} ms "
          f"{rate:6.1f} GB/s")

# %% [markdown]
# The cause is the one line, not the traffic. PyTorch's CPU `cumsum` along an axis that is not the
# innermost walks each of the $B H D^2$ columns on its own, one element at a time, with a whole
# state between consecutive steps: nearly every step is a cache miss (and, since a state spans
# more than a page, a TLB miss). The same sum with the chunk axis innermost is several times
# faster (second column), and the loop of $N$ in-place additions, each a contiguous
# $B \times H \times D \times D$ slab, is faster still at $C = 1$, by far (third column; at the
# larger $C$ both take a few milliseconds or less). The lib now runs that loop
# (`chunks.exclusive_scan_`, shown above); at $C = 1$ the whole call then moves its states at
# the rate in the last column, within a small factor of the memory bandwidth chapter 3
# measured, so what remains of its cost there is of the order of that traffic, which the loop
# avoids while paying the interpreter per chunk instead (by $C = 64$ the flops take over and
# that rate falls). On a GPU the trade-off differs: a Python loop launches a few small kernels
# per chunk, each leaving most of the chip idle, while fused kernels (chapter 9) keep the running
# state on chip and walk the chunks in order inside one kernel.
#
# The general lesson holds on both: the chunked form trades per-chunk costs (fixed overheads, and
# a $D_k \times D_v$ state to move per chunk and head) against the diagonal blocks' flops, which
# grow with $C$, and the best $C$ is where the two balance: 64 or 128 tokens in GPU kernels.

# (erratum-chunked-remainder)=
# ## Erratum: the post's chunk loop drops the last tokens
#
# The post's chunked listing loops over `range(t // C)` chunks. When $C$ divides $T$ that is every
# chunk. When it does not, the last $T \bmod C$ tokens are never visited: their outputs are missing
# (the output is shorter than the input) and their keys and values never reach the state that
# decoding would continue from. Nothing fails loudly (for $T \ge C$), and a check at a length that
# is a multiple of $C$ passes. Our own minimal version of that loop, without the normaliser as in
# the post:

# %%
def chunked_floor(q, k, v, C):
    """The post's logic: range(T // C) chunks.

    Right when C divides T; drops T mod C tokens otherwise."""
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    outs = []
    for c in range(T // C):  # ⌊T/C⌋ chunks
        Qc, Kc, Vc = (x[:, :, c * C : (c + 1) * C] for x in (q, k, v))
        outs.append(Qc @ S + (Qc @ Kc.transpose(-1, -2)).tril() @ Vc)
        S = S + Kc.transpose(-1, -2) @ Vc
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1])
    return o, S


B, H, D = 1, 2, 8
for T, C in ((12, 4), (10, 4), (3, 4)):
    torch.manual_seed(T)
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    o_ref, S_ref = la.recurrent(q, k, v)
    o, S = chunked_floor(q, k, v, C)
    kept = o.shape[2]
    err = max_diff(o, o_ref[:, :, :kept]) if kept else 0.0
    print(f"T = {T:2d}, C = {C}: output has {kept:2d} of {T} tokens "
          f"(max error on those {err:.0e}); "
          f"max |final state - recurrent's| = {max_diff(S, S_ref):.2f}")

# %% [markdown]
# With $T = 12$ everything is right. With $T = 10$ the two last tokens are gone and the state misses
# them; with $T = 3 < C$ the loop does nothing at all (as printed, the post's final `torch.cat` of
# the empty list of outputs would raise; our version returns an empty output). A model that adds
# the outputs to anything of length $T$, such as the residual stream, then fails with a shape
# error; worse, a decoder continues from the incomplete state and every later token is wrong.
#
# **The fix.** Visit $\lceil T/C \rceil$ chunks: step through the sequence with
# `range(0, T, C)` and let the last slice be short (the chunk loop above), or zero-pad the sequence
# to a multiple of $C$ and drop the padded outputs, as `la.chunked` does. Both, on the same cases:

# %%
for T, C in ((12, 4), (10, 4), (3, 4)):
    torch.manual_seed(T)
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    o_ref, S_ref = la.recurrent(q, k, v)
    o_loop, S_loop = chunked_loop(q, k, v, C)
    o_lib, S_lib = la.chunked(q, k, v, chunk_size=C)
    err_loop = max(max_diff(o_loop, o_ref), max_diff(S_loop, S_ref))
    err_lib = max(max_diff(o_lib, o_ref), max_diff(S_lib, S_ref))
    print(f"T = {T:2d}, C = {C}: loop over range(0, T, C): "
          f"{o_loop.shape[2]:2d} tokens, error {err_loop:.0e};  padded (la.chunked): "
          f"{o_lib.shape[2]:2d} tokens, error {err_lib:.0e}")

# %% [markdown]
# The lib's tests run every form at lengths that are not multiples of the chunk size for this
# reason. This erratum is listed on the [errata page](../book/errata.md).

# %% [markdown]
# ## Exercises
#
# ```{exercise} Chunked linear attention
# :label: ex-chunked-la
#
# Write `chunked_linear_attention(q, k, v, chunk_size)`: causal linear attention without the
# normaliser, from a zero state, computed chunk by chunk, $O_{[c]} = Q_{[c]} S_{[c]} +
# (Q_{[c]} K_{[c]}^\top \odot M) V_{[c]}$ and $S_{[c+1]} = S_{[c]} + K_{[c]}^\top V_{[c]}$. `q`, `k`
# are `[B, H, T, Dk]`, `v` is `[B, H, T, Dv]`; return `o`, `[B, H, T, Dv]`, in the inputs' dtype.
# Any $T$: the cases include $T$ not a multiple of the chunk size, $C = 1$ and $C > T$. A loop over
# chunks is fine; for more practice, write it without one (pad, reshape to chunks, prefix sum).
# ```

# %%
def chunked_linear_attention_mine(q, k, v, chunk_size):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("chunked.linear_attention", chunked_linear_attention_mine)

# %% [markdown]
# ```{solution-start} ex-chunked-la
# :class: dropdown
# ```

# %%
def chunked_linear_attention_solution(q, k, v, chunk_size):
    B, H, T, Dk = q.shape
    C, N = chunk_size, -(-T // chunk_size)  # N = ⌈T/C⌉ chunks
    pad = N * C - T
    # zero-padded to N·C tokens, then cut into chunks   [B, H, N, C, D]
    Qc, Kc, Vc = (torch.cat([x, x.new_zeros(B, H, pad, x.shape[-1])], dim=2)
                  .view(B, H, N, C, -1) for x in (q, k, v))
    kv = Kc.transpose(-1, -2) @ Vc  # K_[c]ᵀ V_[c] for every chunk   [B, H, N, Dk, Dv]
    S_start = kv.cumsum(dim=2) - kv  # exclusive: S_[c] = Σ_{c' < c} K_[c']ᵀ V_[c']
    scores = (Qc @ Kc.transpose(-1, -2)).tril()  # Q_[c] K_[c]ᵀ ⊙ M      [B, H, N, C, C]
    o = Qc @ S_start + scores @ Vc  # [B, H, N, C, Dv]
    return o.reshape(B, H, N * C, -1)[:, :, :T]  # drop the padding   [B, H, T, Dv]


ok = checks.run("chunked.linear_attention", chunked_linear_attention_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The flops of the chunked form
# :label: ex-chunked-flops
#
# Write `chunked_flops(T, D, C)`: the flops of the four matrix products of `la.chunked` for one
# head with $D_k = D_v = D$, counting $2mkn$ for a product $[m, k] \times [k, n]$. `la.chunked` pads
# the last chunk to $C$ rows and multiplies the padding too, so count $\lceil T/C \rceil$ full chunks.
# Leave out the scan's additions. Then use it: at $T = 4096$, $D = 128$, which chunk size makes the
# diagonal blocks cost as much as the state work?
# ```

# %%
def chunked_flops_mine(T, D, C):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("chunked.flops", chunked_flops_mine)

# %% [markdown]
# ```{solution-start} ex-chunked-flops
# :class: dropdown
# ```

# %%
def chunked_flops_solution(T, D, C):
    n_chunks = -(-T // C)  # ⌈T/C⌉, the last chunk padded to C rows
    state = 2 * C * D * D + 2 * D * C * D  # Q_[c] S_[c] and K_[c]ᵀ V_[c]
    diagonal = 2 * C * D * C + 2 * C * C * D  # Q_[c] K_[c]ᵀ and (… ⊙ M) V_[c]
    return n_chunks * (state + diagonal)


ok = checks.run("chunked.flops", chunked_flops_solution)
T, D = 4096, 128
state_work = 4 * T * D * D  # the same at every C
for C in (32, 64, 128, 256):
    total = chunked_flops_solution(T, D, C)
    print(f"T = {T}, D = {D}, C = {C:3d}: {total:14,d} flops per head, "
          f"{(total - state_work) / total:4.0%} of them in the diagonal blocks")

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Splitting the sum $o_t = q_t (S_0 + \sum_{j \le t} k_j^\top v_j)$ at the start of $t$'s chunk
#   gives the chunked form: $O_{[c]} = Q_{[c]} S_{[c]} + (Q_{[c]} K_{[c]}^\top \odot M) V_{[c]}$ and
#   $S_{[c+1]} = S_{[c]} + K_{[c]}^\top V_{[c]}$: score order inside a chunk, state order across
#   chunks. $C = 1$ is the recurrence and $C = T$ the parallel form, checked numerically.
# - The chunk loop, the lib's vectorised `chunked` and the recurrence agree to round-off in
#   float64 and float32, for any $T$, with and without the normaliser, from a zero or a given state.
# - Every chunk's starting state is an exclusive prefix sum of the per-chunk $K_{[c]}^\top V_{[c]}$, so
#   all chunks are computed at once; only that running sum, one step per chunk, is sequential.
# - Per head the work is $4TD^2$ of state work plus $4TCD$ in the diagonal blocks (flops, counted
#   $2mkn$ per product and checked against PyTorch's counter); the post's $2LD^2 + 2LCD$ has the
#   right shape and half the constants, since it counts multiply-adds.
# - Time does not follow the flops at small $C$: each chunk has a fixed cost (interpreter and
#   dispatch for the loop; the traffic of every chunk state for the vectorised form). A two-term
#   model, flops plus a cost per chunk, describes the measured U.
# - Measure before explaining: the vectorised form's slowness at $C = 1$ was one `cumsum` along a
#   non-innermost axis, not the memory traffic; an in-place scan over the chunks removed it.
# - The post swaps its two orders ("q(kᵀv)" is state first, not score first, and "(kᵀv)q" does
#   not type-check), and its chunk loop over `range(T // C)` drops the last $T \bmod C$ tokens.
#
# **Next.** The chunked form rests on one fact: the state after a chunk is the state before it plus
# a sum, $K_{[c]}^\top V_{[c]}$, that the chunk computes on its own. The delta rule breaks it. Each
# token's write depends on what the state holds at its key just before, $v^{\text{old}}_t = k_t
# S_{t-1}$, so inside a chunk the writes depend on each other, and the transition
# $\prod_t (I - \beta_t k_t^\top k_t)$ is a product of $C$ matrices of size $D_k \times D_k$. Chapter 7
# finds a compact form of that product, the WY representation, and the triangular solve that builds
# it (the UT transform); chapter 8 uses them to chunk DeltaNet the way this chapter chunked linear
# attention.
#
# **References.** A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret, "Transformers are RNNs: Fast
# Autoregressive Transformers with Linear Attention", ICML 2020. S. Yang, B. Wang, Y. Shen,
# R. Panda, Y. Kim, "Gated Linear Attention Transformers with Hardware-Efficient Training",
# ICML 2024. S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim, "Parallelizing Linear Transformers with
# the Delta Rule over Sequence Length", NeurIPS 2024.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
