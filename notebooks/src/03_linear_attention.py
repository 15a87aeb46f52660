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
# # Linear attention
#
# Chapter 2's KV cache left two costs that grow with every token: the cache itself, and the
# work of each decoding step, which reads all of it. Linear attention removes both. It
# replaces the exponential of softmax attention by a dot product of *feature maps*, and that
# one change folds all past keys and values into a state of fixed size: a $D \times D$ matrix
# per head, updated by one outer product per token.
#
# **In this chapter** you derive the fixed-size state, build the token loop and the masked
# parallel form, continue a prefill token by token, compare feature maps with softmax, fix two
# of the post's listings, and time prefill and decoding against softmax with a KV cache.
#
# **Cost.** Under a minute on one CPU core, most of it in the two timing experiments (the
# last cell prints the time). `SMOKE = True` runs in a few seconds.

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
import torch
import torch.nn.functional as F

from tinyk3 import checks
from tinyk3.attention import causal_attention
from tinyk3.bench import stamp
from tinyk3.ops import feature_maps
from tinyk3.ops import linear_attention as la
from tinyk3.timing import distinguishable, time_fn
from tinyk3.util import max_diff

FM_TOKENS = 64 if SMOKE else 256  # sequence length of the feature-map comparison
PREFILL_LENGTHS = ([128, 256, 512] if SMOKE
                   else [128, 256, 512, 1024, 2048, 4096, 8192, 16384])
DECODE_MAX = 512 if SMOKE else 8192  # longest KV cache in the decoding experiment
REPEATS = 3 if SMOKE else 25  # timed runs per point in the decoding experiment


# %% [markdown]
# ## The problem: every decoding step reads the whole cache
#
# With a KV cache, the step that produces token $t+1$ computes one query $q_{t+1}$ and, in
# every head, attends over all keys and values so far:
#
# $$
# o_{t+1} = \operatorname{softmax}\!\left(\frac{q_{t+1} K_{\le t+1}^\top}{\sqrt{D}}\right) V_{\le t+1},
# \qquad K_{\le t+1}, V_{\le t+1} \in \mathbb{R}^{(t+1) \times D}.
# $$
#
# So the step reads $2(t+1)D$ numbers per head and does about $4tD$ flops, both without
# bound. For one head of size $D = 64$ (GPT-2's), next to the $D \times D$ matrix plus a
# $D$-vector this chapter keeps instead:

# %% tags=["nbval-check-output"]
D = 64
for t in (1_024, 32_768, 1_048_576):
    print(f"t = {t:>9,}: a KV cache holds {2 * t * D:>11,} numbers per head")
print(f"the linear-attention state holds {D * D + D:,} numbers per head, at every t")

# %% [markdown]
# ## The idea: a kernel in place of the exponential
#
# Write causal softmax attention for one query as a weighted average, with a similarity
# $\operatorname{sim}(q, k) = \exp(q k^\top / \sqrt{D})$:
#
# $$
# o_t = \frac{\sum_{j \le t} \operatorname{sim}(q_t, k_j)\, v_j}{\sum_{j \le t} \operatorname{sim}(q_t, k_j)}.
# $$
#
# Nothing in this formula needs the exponential: any non-negative similarity gives a weighted
# average of the values. Katharopoulos et al. (2020, *Transformers are RNNs*) choose one that
# is a dot product of *features*, $\operatorname{sim}(q, k) = \phi(q)\, \phi(k)^\top$, with a
# feature map applied to queries and keys separately, for instance
# $\phi(x) = \operatorname{ELU}(x) + 1$ (positive everywhere). Then the sum can be rearranged.
# With rows as vectors ($\phi(q_t) \in \mathbb{R}^{1 \times D_k}$, $v_j \in \mathbb{R}^{1 \times D_v}$),
# step by step:
#
# 1. The weight $\phi(q_t)\phi(k_j)^\top$ is a $1 \times 1$ matrix, so the term is a product of
#    three matrices: $\big(\phi(q_t)\phi(k_j)^\top\big) v_j$.
# 2. Matrix products are associative: $\big(\phi(q_t)\phi(k_j)^\top\big) v_j = \phi(q_t)\big(\phi(k_j)^\top v_j\big)$,
#    where $\phi(k_j)^\top v_j \in \mathbb{R}^{D_k \times D_v}$ is an outer product.
# 3. $\phi(q_t)$ does not depend on $j$, so it comes out of the sum, in the numerator and in the
#    denominator:
#
# $$
# \begin{aligned}
# o_t &= \frac{\phi(q_t) \sum_{j \le t} \phi(k_j)^\top v_j}{\phi(q_t) \sum_{j \le t} \phi(k_j)^\top}
#      = \frac{\phi(q_t)\, S_t}{\phi(q_t) \cdot z_t}, \\
# S_t &= \sum_{j \le t} \phi(k_j)^\top v_j \in \mathbb{R}^{D_k \times D_v}, \qquad
# z_t = \sum_{j \le t} \phi(k_j) \in \mathbb{R}^{1 \times D_k}.
# \end{aligned}
# $$
#
# 4. Both sums grow by one term per token, so they are a recurrence with a fixed-size state:
#
# $$
# S_t = S_{t-1} + \phi(k_t)^\top v_t, \qquad z_t = z_{t-1} + \phi(k_t), \qquad
# o_t = \frac{\phi(q_t)\, S_t}{\phi(q_t) \cdot z_t}.
# $$
#
# That is the whole mechanism: the "cache" is $S_t$ and $z_t$, $D_k D_v + D_k$ numbers per head
# whatever $t$ is, and a decoding step costs $O(D_k D_v)$ instead of $O(tD)$. The exponential
# cannot be split this way with finitely many features ($e^{q \cdot k}$ has powers of
# $q \cdot k$ of every order), so the feature map changes the model, not just the arithmetic;
# the section on feature maps measures by how much.
#
# **Layout.** Tokens are rows and the state is $D_k \times D_v$, read by $o_t = q_t S_t$ (see the
# [notation page](../book/notation.md)); Katharopoulos et al.'s $\phi(K_j) V_j^\top$, in
# columns, is our $\phi(k_j)^\top v_j$. The DeltaNet papers of chapters 5 to 8 store the
# transpose, $S \in \mathbb{R}^{D_v \times D_k}$, read with $S_t q_t$; a check below shows the two
# layouts agree.
#
# From here on `q` and `k` in code are the features $\phi(q), \phi(k)$:
# `tinyk3.ops.linear_attention` takes them already mapped.

# %% [markdown]
# ## Build it: the token loop
#
# The recurrence, one token at a time. `eps` guards the division against a normaliser of
# zero:
#
# $$
# S_t = S_{t-1} + k_t^\top v_t, \qquad z_t = z_{t-1} + k_t, \qquad
# o_t = \frac{q_t S_t}{q_t \cdot z_t + \varepsilon}.
# $$

# %%
def linear_attention_loop(q, k, v, normalize=True, eps=1e-6):
    """q, k: features [B, H, T, Dk]; v: [B, H, T, Dv]. Returns o [B, H, T, Dv]."""
    B, H, T, Dk = q.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1])  # [B, H, Dk, Dv]
    z = q.new_zeros(B, H, Dk)  # [B, H, Dk]
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]  # [B, H, D]
        # k_tᵀ v_t, an outer product  [B, H, Dk, Dv]
        S = S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        z = z + k_t
        o_t = (q_t.unsqueeze(-2) @ S).squeeze(-2)  # q_t S_t  [B, H, Dv]
        if normalize:
            o_t = o_t / ((q_t * z).sum(-1, keepdim=True) + eps)  # ÷ (q_t · z_t + ε)
        outs.append(o_t)
    return torch.stack(outs, dim=2)  # [B, H, T, Dv]


torch.manual_seed(0)
x_q, x_k = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
v = torch.randn(2, 3, 10, 6)
# φ(q), φ(k): positive
q, k = feature_maps.elu_plus_one(x_q), feature_maps.elu_plus_one(x_k)
o = linear_attention_loop(q, k, v)
print(f"q, k {list(q.shape)}, v {list(v.shape)} -> o {list(o.shape)}; "
      f"smallest feature {min(q.min(), k.min()).item():.3f} (ELU+1 is positive)")

# %% [markdown]
# `tinyk3.ops.linear_attention.recurrent` is the same loop; it also accepts an initial state
# and returns the final one, which decoding needs. The two, in both precisions, with and
# without the normaliser:

# %%
for dtype in (torch.float64, torch.float32):
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    for normalize in (True, False):
        mine = linear_attention_loop(qd, kd, vd, normalize=normalize)
        lib, _ = la.recurrent(qd, kd, vd, normalize=normalize)
        print(f"{str(dtype):14s} normalize={normalize!s:5s}  "
              f"max |mine - lib| = {max_diff(mine, lib):.1e}")

# %% [markdown]
# Distance zero: the lib's loop performs the same operations in the same order. Its source,
# which the chapter uses from now on:

# %%
tinyk3.notebook.show_source(la.recurrent)

# %% [markdown]
# ## The parallel form
#
# For a whole sequence at once (a prefill, or training) the sums over $j \le t$ are matrix
# products, like softmax attention without the softmax. With the rows stacked into $Q, K, V$
# and $M$ the lower-triangular matrix of ones ($M_{tj} = 1$ for $j \le t$):
#
# $$
# \begin{gathered}
# O = \frac{(Q K^\top \odot M)\, V}{(Q K^\top \odot M)\, \mathbf{1}} \quad \text{(row by row)}, \\
# \big[(Q K^\top \odot M)\mathbf{1}\big]_t = \sum_{j \le t} q_t \cdot k_j = q_t \cdot z_t.
# \end{gathered}
# $$
#
# This form costs $O(T^2 D)$ and a $T \times T$ matrix, like softmax attention; the loop
# $O(T D_k D_v)$. Without the mask the parentheses could move, $Q (K^\top V)$, for $O(T D^2)$:
# the non-causal version, and the trap of the first erratum below.

# %%
def linear_attention_masked(q, k, v, normalize=True, eps=1e-6):
    """The same maths with a [T, T] score matrix. q, k: features."""
    T = q.shape[2]
    M = torch.ones(T, T, dtype=q.dtype).tril()  # 1 where key j <= query t
    scores = (q @ k.transpose(-1, -2)) * M  # Q Kᵀ ⊙ M  [B, H, T, T]
    o = scores @ v  # [B, H, T, Dv]
    if normalize:
        o = o / (scores.sum(-1, keepdim=True) + eps)  # row sums: q_t · z_t
    return o


for dtype in (torch.float64, torch.float32):
    qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
    for normalize in (True, False):
        mine = linear_attention_masked(qd, kd, vd, normalize=normalize)
        lib, _ = la.parallel(qd, kd, vd, normalize=normalize)
        rec, _ = la.recurrent(qd, kd, vd, normalize=normalize)
        print(f"{str(dtype):14s} normalize={normalize!s:5s}  "
              f"max |mine - lib.parallel| = {max_diff(mine, lib):.1e}   "
              f"max |lib.parallel - lib.recurrent| = {max_diff(lib, rec):.1e}"
              f"  (outputs up to {lib.abs().max().item():.1f})")

# %% [markdown]
# The masked form is `la.parallel` exactly, and it agrees with the token loop to round-off,
# since the two add the same terms in a different order: divided by the size of the outputs
# (printed last; the unnormalised ones are large), the differences are near each precision's
# epsilon.

# %% [markdown]
# ## Check: decode from a prefill, with a state that does not grow
#
# A server runs the prompt in one parallel pass (the *prefill*), then decodes token by token.
# With linear attention the prefill hands over only its final state $(S_T, z_T)$; both forms
# take `initial_state` and return the final state. The check: prefill 100 tokens in parallel,
# decode 28 one at a time, and compare with one pass over all 128.

# %%
torch.manual_seed(1)
B, H, T, Dk, Dv = 2, 4, 128, 16, 16
q = feature_maps.elu_plus_one(torch.randn(B, H, T, Dk, dtype=torch.float64))
k = feature_maps.elu_plus_one(torch.randn(B, H, T, Dk, dtype=torch.float64))
v = torch.randn(B, H, T, Dv, dtype=torch.float64)

one_pass, _ = la.recurrent(q, k, v, normalize=True)
o_prefill, state = la.parallel(q[:, :, :100], k[:, :, :100], v[:, :, :100],
                               normalize=True)
print(f"after the prefill of 100 tokens: "
      f"S {list(state[0].shape)}, z {list(state[1].shape)}")
decoded = []
for t in range(100, T):
    q_t, k_t, v_t = q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]
    o_t, state = la.recurrent(q_t, k_t, v_t, normalize=True, initial_state=state)
    decoded.append(o_t)
print(f"after {T} tokens:                  "
      f"S {list(state[0].shape)}, z {list(state[1].shape)}")
print(f"max |one pass - (prefill + decode)|  = "
      f"{max_diff(one_pass, torch.cat([o_prefill] + decoded, dim=2)):.1e} (float64)")
prefill_state = la.parallel(q[:, :, :100], k[:, :, :100], v[:, :, :100],
                            normalize=True)[1]
o_block, _ = la.parallel(q[:, :, 100:], k[:, :, 100:], v[:, :, 100:], normalize=True,
                         initial_state=prefill_state)
print(f"max |one pass - (prefill + a block of 28)| = "
      f"{max_diff(one_pass[:, :, 100:], o_block):.1e}")

# %% [markdown]
# The state has the same shape after 100 tokens and after 128, and would after a million.
#
# **The papers' layout.** The same outputs in the DeltaNet papers' column form,
# $S^{\text{paper}}_t = \sum_{j \le t} v_j k_j^\top \in \mathbb{R}^{D_v \times D_k}$ read by
# $S^{\text{paper}}_t q_t$ (in rows: $\sum_{j \le t} v_j^\top k_j$ and $S^{\text{paper}}_t q_t^\top$),
# whose state is our $S^\top$:

# %%
# S_t^paper for every t  [B, H, T, Dv, Dk]
S_paper = torch.einsum("bhtv,bhtk->bhtvk", v, k).cumsum(dim=2)
# S_t q_t (q_t a column)  [B, H, T, Dv]
o_paper = (S_paper @ q.unsqueeze(-1)).squeeze(-1)
o_ours, S_ours = la.recurrent(q, k, v)  # unnormalised, our layout
print(f"max |outputs, papers' layout - ours| = {max_diff(o_paper, o_ours):.1e}")
S_err = max_diff(S_paper[:, :, -1], S_ours.transpose(-1, -2))
print(f"max |final S^paper - our S transposed| = {S_err:.1e}")

# %% [markdown]
# (erratum-linear-prefill)=
# ## Erratum: a prefill that is not causal
#
# The post's linear-attention layer applies ELU+1 to q and k, transposes k, and updates its
# state with the whole block of new tokens at once, $S \leftarrow S + K^\top V$ and
# $z \leftarrow z + K^\top$, *before* any token reads it with $Q S / (Q z)$. For decoding one token
# at a time that is the recurrence above. For a prefill of $T > 1$ tokens it has two faults:
#
# - the normaliser $z$ is never summed over the tokens: $K^\top$ is $[D, T]$, so $Q z$ is a
#   $[T, T]$ matrix, and dividing $[T, D]$ outputs by it fails unless $T = D$ (when it silently
#   divides by the wrong numbers);
# - with $z$ summed, it runs, but every token reads the state of the *whole* block, including
#   the tokens after it: $Q (K^\top V)$ is the non-causal form.
#
# The same logic, in our own minimal version (`sum_z=True` repairs the first fault only):

# %%
def linear_attention_block_update(x_q, x_k, v, state=None, sum_z=False):
    """The post's logic: fold the whole block into (S, z), then read.

    Not causal for T > 1.
    """
    q, k = feature_maps.elu_plus_one(x_q), feature_maps.elu_plus_one(x_k)
    kT = k.transpose(-1, -2)  # [B, H, D, T]
    S, z = state if state is not None else (0.0, 0.0)
    S = S + kT @ v  # all T tokens at once  [B, H, D, Dv]
    z = z + (kT.sum(-1, keepdim=True) if sum_z else kT)  # as printed: [B, H, D, T]
    o = (q @ S) / (q @ z)  # [B, H, T, Dv] / [B, H, T, T or 1]
    return o, (S, z)


def causal_reference(x_q, x_k, v):
    """The recurrence (tinyk3), with the same features and no eps."""
    q, k = feature_maps.elu_plus_one(x_q), feature_maps.elu_plus_one(x_k)
    return la.recurrent(q, k, v, normalize=True, eps=0.0)[0]


torch.manual_seed(2)
D = 8
x_q, x_k, v = (torch.randn(1, 2, 12, D, dtype=torch.float64) for _ in range(3))

state, outs = None, []
for t in range(12):  # decoding from an empty state, one token per call
    x_q_t, x_k_t, v_t = x_q[:, :, t : t + 1], x_k[:, :, t : t + 1], v[:, :, t : t + 1]
    o_t, state = linear_attention_block_update(x_q_t, x_k_t, v_t, state)
    outs.append(o_t)
err = max_diff(torch.cat(outs, 2), causal_reference(x_q, x_k, v))
print(f"one token per call: max error vs the recurrence {err:.1e}")
for T in (5, D):  # a prefill, as printed
    try:
        o, _ = linear_attention_block_update(x_q[:, :, :T], x_k[:, :, :T], v[:, :, :T])
        err = max_diff(o, causal_reference(x_q[:, :, :T], x_k[:, :, :T], v[:, :, :T]))
        print(f"prefill of T={T}: runs, max error vs the recurrence {err:.2f}")
    except RuntimeError as e:
        print(f"prefill of T={T}: RuntimeError: {e}")

# %% [markdown]
# One token per call is exact. A prefill of 5 tokens fails with a shape error; one of exactly
# $T = D$ tokens runs and is wrong. With $z$ summed over the block (the evident intention), it
# runs for every $T$, and the error is in the *earlier* tokens: token $t$ reads $S_T$ instead
# of $S_t$, so only the last token is right. A probe shows the leak: change only the last
# token's value and see whether the first token's output moves.

# %%
T = 12
o_block, state_block = linear_attention_block_update(x_q, x_k, v, sum_z=True)
# the largest error at each position  [T]
per_position = (o_block - causal_reference(x_q, x_k, v)).abs().amax(dim=(0, 1, 3))
print("max error at each position: "
      + " ".join(f"{e:.2f}" for e in per_position.tolist()))

v_changed = v.clone()
v_changed[:, :, -1] += 1.0
o_changed, _ = linear_attention_block_update(x_q, x_k, v_changed, sum_z=True)
moved = max_diff(o_changed[:, :, 0], o_block[:, :, 0])
q_f, k_f = feature_maps.elu_plus_one(x_q), feature_maps.elu_plus_one(x_k)
moved_causal = max_diff(la.parallel(q_f, k_f, v_changed, normalize=True)[0][:, :, 0],
                        la.parallel(q_f, k_f, v, normalize=True)[0][:, :, 0])
print(f"first token's output moved by {moved:.3f} when the last token's value changed "
      f"(causal parallel form: {moved_causal:.1f})")

# %% [markdown]
# Of the state the block hands to decoding, $S_T$ is right as printed (a sum does not depend
# on the order of its terms); $z$ only once it is summed, since as printed it stays the
# $[D, T]$ block of keys. With that one repair, decoding *after* such a prefill is correct, and
# so is the prefill's last token: the bug is easy to miss in a one-layer demo. In a real
# model the earlier tokens' wrong outputs feed the next layer, and in training every position
# would see the answer it must predict.

# %%
S_causal, z_causal = la.parallel(q_f, k_f, v, normalize=True)[1]
# S is computed the same way with and without sum_z; z as printed is z + Kᵀ
z_printed = k_f.transpose(-1, -2)  # [B, H, D, T]
dS = max_diff(state_block[0], S_causal)
dz = max_diff(state_block[1].squeeze(-1), z_causal)
print(f"S after the block vs the causal S_T: max |ΔS| = {dS:.1e}")
print(f"z as printed: shape {list(z_printed.shape)}, the causal z_T: "
      f"{list(z_causal.shape)}; with z summed, max |Δz| = {dz:.1e}")

# %% [markdown]
# **The fix.** Compute a prefill with the causal forms: the masked parallel form
# (`la.parallel`, $(QK^\top \odot M)V$ and its row sums) or the token loop (`la.recurrent`);
# both return the final state for decoding. Chapter 6's chunked form is causal and $O(TD^2)$.
# This entry is on the [errata page](../book/errata.md).

# %% [markdown]
# (erratum-linear-loop)=
# ## Erratum: a token loop that does not run
#
# In its chunked-attention section the post gives a token loop as the direct (sequential)
# linear-attention prefill. As printed it cannot run. Each fault, reproduced on its own in our
# own minimal code ($T = 5$ tokens, 2 heads of size 8, $d_{\text{model}} = 16$):
#
# 1. the state update reads a variable `S_old` that is never defined;
# 2. it multiplies the one-token key and value slices, $[1, D] \times [1, D]$, without
#    transposing the key, where the outer product $k_t^\top v_t$ is needed;
# 3. it reshapes one token's output to $[B, T, d_{\text{model}}]$ with the full block length $T$;
# 4. it rebinds `q`, `k`, `v` to their $i$-th slice inside the loop, so from the second
#    iteration on it slices a one-token tensor at position $i \ge 1$ and gets nothing;
# 5. it concatenates the per-token outputs, $[B, 1, d_{\text{model}}]$ each, along dimension 2,
#    the channels, instead of dimension 1, the tokens.
#
# It also normalises the output with a layer instead of dividing by $q_t \cdot z_t$: a design
# choice later models make, not an error.

# %% tags=["nbval-check-output"]
torch.manual_seed(3)
B, H, T, D = 1, 2, 5, 8
q_e, k_e, v_e = (torch.randn(B, H, T, D) for _ in range(3))
S0 = torch.zeros(B, H, D, D)


def attempt(name, fn):
    try:
        out = fn()
        print(f"{name}: runs, output {list(out.shape)}")
    except Exception as e:  # every fault is printed, none stops the notebook
        print(f"{name}: {type(e).__name__}: {e}")


def fault_undefined_name():
    k_i, v_i = k_e[:, :, 0:1], v_e[:, :, 0:1]
    return S_old + k_i.transpose(-1, -2) @ v_i  # noqa: F821 - never defined


def fault_no_transpose():
    k_i, v_i = k_e[:, :, 0:1], v_e[:, :, 0:1]  # [B, H, 1, D] each
    return S0 + k_i @ v_i  # needs k_iᵀ v_i: [B, H, D, 1] @ [B, H, 1, D]


def fault_reshape_with_full_T():
    o_i = q_e[:, :, 0:1] @ S0  # one token's output  [B, H, 1, D]
    return o_i.transpose(1, 2).contiguous().view(B, T, H * D)  # as if it held T tokens


slice_lengths = []


def fault_rebinding():
    q, k, v, S, outs = q_e, k_e, v_e, S0, []
    for i in range(T):
        # rebinds q, k, v
        q, k, v = q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1]
        slice_lengths.append(q.shape[2])
        S = S + k.transpose(-1, -2) @ v
        outs.append(q @ S)
    return torch.cat(outs, dim=2)


def fault_cat_on_channels():
    # each token's output after o_proj
    outs = [torch.randn(B, 1, H * D) for _ in range(T)]
    return torch.cat(outs, dim=2)  # tokens are dimension 1 of [B, T, n_embd]


attempt("1. S_old", fault_undefined_name)
attempt("2. k @ v, no transpose", fault_no_transpose)
attempt("3. view(B, T, n_embd) of one token", fault_reshape_with_full_T)
attempt("4. rebinding q, k, v", fault_rebinding)
print(f"   (tokens in the slices at i = 0..{T - 1}: {slice_lengths})")
attempt("5. cat along dim=2", fault_cat_on_channels)
print(f"expected: outputs {[B, H, T, D]} per head, "
      f"or {[B, T, H * D]} after merging the heads")

# %% [markdown]
# The first three raise; the last two run and silently return the wrong shape (one token out
# of five; five tokens' channels side by side). The working loop slices a fresh
# `q_t, k_t, v_t` each iteration, updates `S` from its previous value with $k_t^\top v_t$, and
# stacks the outputs along the token axis: `la.recurrent`, shown above:

# %%
o_loop, _ = la.recurrent(q_e, k_e, v_e)
print(f"la.recurrent: output {list(o_loop.shape)}, max |recurrent - parallel| = "
      f"{max_diff(o_loop, la.parallel(q_e, k_e, v_e)[0]):.1e}")

# %% [markdown]
# This entry is on the [errata page](../book/errata.md).

# %% [markdown]
# ## Feature maps: what the kernel gives up
#
# `tinyk3.ops.feature_maps` holds five choices of $\phi$. Four act on each number:
# ELU+1, ReLU, softplus and the identity (no map at all). The fifth, `taylor2`, maps
# $x \in \mathbb{R}^D$ to $[1,\; x,\; \operatorname{vec}(x^\top x)/\sqrt{2}] \in \mathbb{R}^{1 + D + D^2}$, chosen so that
#
# $$
# \phi(q)\,\phi(k)^\top = 1 + q \cdot k + \tfrac{1}{2}(q \cdot k)^2 \approx e^{q \cdot k},
# $$
#
# the exponential's second-order Taylor series (the map of Based, Arora et al. 2024). With $q$
# and $k$ scaled by $D^{-1/4}$ each, `taylor2` imitates softmax's $\exp(q \cdot k / \sqrt{D})$;
# the others are not meant to.

# %% mystnb={"figure": {"caption": "Left: the four element-wise feature maps $\\phi$. Right: the exponential against its second-order Taylor series, the similarity that `taylor2` reproduces; the two agree near $s = 0$ and part for $|s| > 1$.", "name": "fig-la-feature-maps"}, "image": {"alt": "Two line plots. Left: ELU plus one, ReLU, softplus and the identity for x from -3 to 3; all but the identity stay non-negative. Right: exp(s) and 1 + s + s squared over 2 for s from -3 to 3, touching near zero, the exponential far above at s = 3"}}
xs = torch.linspace(-3, 3, 121)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.8, 3.4))
for name in ("elu+1", "relu", "softplus", "identity"):
    ax1.plot(xs, feature_maps.get(name)(xs), label=name)
ax1.set(xlabel="x", ylabel="φ(x)", title="Element-wise feature maps")
ax1.legend()
ax2.plot(xs, xs.exp(), label="exp(s)")
ax2.plot(xs, 1 + xs + xs**2 / 2, label="1 + s + s²/2 (taylor2)")
ax2.set(xlabel="s = q·k", ylabel="similarity", title="exp(s) and its 2nd-order series")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# **How well does each imitate softmax?** Take random $q, k, v$ ($D = 16$), and scale $q, k$ so
# that the softmax logits $q \cdot k / \sqrt{D}$ have standard deviation $\sigma$: small
# $\sigma$ means nearly uniform softmax weights, large $\sigma$ means sharp ones. Compute causal
# softmax attention, and normalised linear attention with $\phi(q D^{-1/4})$, $\phi(k D^{-1/4})$
# for each map, and report the relative error
# $\lVert O_{\text{linear}} - O_{\text{softmax}} \rVert / \lVert O_{\text{softmax}} \rVert$.
# As a yardstick, a constant $\phi$ gives every past token the same weight: the plain running
# average of the values, which is what softmax becomes as $\sigma \to 0$.

# %%
torch.manual_seed(4)
D, T = 16, FM_TOKENS
base_q = torch.randn(4, 4, T, D, dtype=torch.float64)
base_k = torch.randn(4, 4, T, D, dtype=torch.float64)
v = torch.randn(4, 4, T, D, dtype=torch.float64)
sigmas = [0.25, 0.5, 1.0, 2.0, 4.0]
maps = dict(feature_maps.FEATURE_MAPS)
maps["constant (plain average)"] = lambda x: torch.ones_like(x[..., :1])

errors = {name: [] for name in maps}
for sigma in sigmas:
    # q·k/√D has std ≈ σ
    q_s, k_s = base_q * math.sqrt(sigma), base_k * math.sqrt(sigma)
    target = causal_attention(q_s, k_s, v)
    for name, phi in maps.items():
        o, _ = la.parallel(phi(q_s * D**-0.25), phi(k_s * D**-0.25), v, normalize=True)
        errors[name].append(((o - target).norm() / target.norm()).item())

print(f"{'relative error':>24s} " + " ".join(f"σ={s:<5}" for s in sigmas))
for name, errs in errors.items():
    print(f"{name:>24s} " + " ".join(f"{e:7.3f}" for e in errs))

# %% mystnb={"figure": {"caption": "Relative error of normalised linear attention against causal softmax attention, for each feature map, as the softmax logits' spread $\\sigma$ grows. ELU+1 (circles) and softplus (crosses) lie on the plain running average (the wide gray band); `taylor2` is closest at small $\\sigma$; no map comes close once softmax is sharp.", "name": "fig-la-feature-map-error"}, "image": {"alt": "Line plot of relative output error against sigma on a log axis from 0.25 to 4, one line per feature map with its own marker and line style, and a wide gray band for the plain running average on which the ELU+1 circles and softplus crosses sit; the errors rise towards 1 as sigma grows (ReLU's only after a level start), taylor2 lowest throughout and ReLU highest at small sigma"}}
# ELU+1, softplus and the plain average nearly coincide: distinct markers and line
# styles, drawn from the widest to the thinnest, keep every line visible
styles = {"constant (plain average)": dict(color="gray", ls="-", lw=6, alpha=0.35),
          "elu+1": dict(marker="o", ms=9, mfc="none", mew=1.5, ls="-", lw=2),
          "softplus": dict(marker="x", ms=7, ls="--"),
          "relu": dict(marker="^", ls="-."),
          "taylor2": dict(marker="D", ms=5, ls="-")}
fig, ax = plt.subplots()
for name, style in styles.items():  # the identity is off the scale: see the table
    ax.plot(sigmas, errors[name], label=name, **style)
ax.set(xscale="log", xlabel="σ, standard deviation of the softmax logits q·k/√D",
       ylabel="relative error of the output",
       title="Linear attention vs softmax attention")
ax.set_xticks(sigmas, [str(s) for s in sigmas])
ax.minorticks_off()
ax.legend()
plt.show()

# %% [markdown]
# `taylor2` is by far the closest when the logits are small, and its error grows with $\sigma$
# as the second-order series falls behind the exponential. ELU+1 and softplus are barely
# better than the plain running average at any $\sigma$: near zero they are about $1 + x$ and
# $\log 2 + x/2$, whose dot products are dominated by a constant. ReLU is worse than the
# average when softmax is nearly uniform (it zeroes every negative feature, which makes the
# weights uneven where they should be even) and a little better at large $\sigma$. None of the
# element-wise maps makes the weights as *sharp* as softmax's. One query's weights show it
# ($\sigma = 2$, the last position, over all $T$ keys):

# %% mystnb={"figure": {"caption": "How one query (the last position, $\\sigma = 2$) spreads its weight over the keys, on a log axis: softmax's weights span many orders of magnitude, with a few keys far above the uniform $1/T$ (dotted); the kernels' weights stay much closer to it.", "name": "fig-la-query-weights"}, "image": {"alt": "Line plot of attention weight on a logarithmic axis against key position: the softmax line swings over several orders of magnitude, with a few spikes far above a dotted line at the uniform weight 1 over T, while the taylor2, ReLU and ELU plus one lines stay much closer to the dotted line, ELU plus one closest"}}
sigma = 2.0
# one head  [T, D]
q_s, k_s = base_q[0, 0] * math.sqrt(sigma), base_k[0, 0] * math.sqrt(sigma)
weights = {"softmax": (q_s[-1] @ k_s.T / math.sqrt(D)).softmax(-1)}
for name in ("taylor2", "relu", "elu+1"):
    phi = feature_maps.get(name)
    # the last query attends to every key
    w = phi(q_s[-1] * D**-0.25) @ phi(k_s * D**-0.25).T
    weights[name] = w / w.sum()
fig, ax = plt.subplots()
for name, w in weights.items():
    ax.plot(w, label=name, lw=1)
ax.axhline(1 / T, color="k", ls=":", label="uniform, 1/T")
ax.set(xlabel="key position j", ylabel="weight (log scale)", yscale="log",
       title=f"Weights of the last query, σ = {sigma}")
smallest = min(w.min().item() for w in weights.values())
ax.set_ylim(bottom=max(1e-6, smallest / 2))  # softmax's smallest may lie further down
# below the axes: inside, it would cover the lines
ax.legend(fontsize=8, ncols=5, loc="upper center", bbox_to_anchor=(0.5, -0.2))
plt.show()
largest = ", ".join(f"{n} {w.max().item():.3f}" for n, w in weights.items())
print(f"largest weight: {largest} (uniform: {1 / T:.4f})")

# %% [markdown]
# That is the price of linear attention: the softmax concentrates its weight on a few keys,
# and these kernels spread it out (the largest weights are in the line above). A trained
# model compensates by learning its projections *for* the kernel (nothing here is trained),
# and later chapters add mechanisms (the delta rule, gates) that make the state itself more
# selective.
#
# **The identity is not an option** (its row in the table is off by orders of magnitude). With
# $\phi(x) = x$ the scores have either sign, so the normaliser $q_t \cdot z_t$ can be negative
# or close to zero, and dividing by it blows the output up:

# %%
q_id, k_id = base_q * D**-0.25, base_k * D**-0.25  # σ = 1, identity features
denominators = (q_id * k_id.cumsum(dim=2)).sum(-1)  # q_t · z_t  [B, H, T]
o_id, _ = la.parallel(q_id, k_id, v, normalize=True)
negative = (denominators < 0).double().mean().item()
print(f"identity: {negative:.0%} of the normalisers are negative, "
      f"the smallest |q·z| is {denominators.abs().min().item():.1e}, "
      f"the largest |output| {o_id.abs().max().item():.0f} (the values are of size 1)")
q_e1, k_e1 = feature_maps.elu_plus_one(q_id), feature_maps.elu_plus_one(k_id)
smallest = (q_e1 * k_e1.cumsum(dim=2)).sum(-1).min().item()
print(f"ELU+1:    the smallest normaliser is {smallest:.2f}")

# %% [markdown]
# A positive map keeps every weight $\ge 0$, so the output stays a weighted average of the
# values. ReLU is non-negative but can be zero in every feature; then only `eps` prevents a
# division by zero. A closer imitation costs size: `taylor2` turns $D_k = 16$ into
# $1 + 16 + 256 = 273$ features, and the state grows to $273 \times D_v$.

# %% [markdown]
# ## Experiment 1: prefill time against sequence length
#
# A prefill of $N$ tokens, one layer's heads ($H = 8$, $D = 64$), on one CPU thread, in four
# forms:
#
# - softmax attention with PyTorch's fused `scaled_dot_product_attention` (causal): $O(N^2 D)$;
# - linear attention, masked parallel form (`la.parallel`): $O(N^2 D)$ and an $N \times N$ matrix;
# - linear attention, token loop (`la.recurrent`): $O(N D^2)$, one small update per token;
# - linear attention by cumulative sums (below): every $S_t$ at once with `cumsum`,
#   $O(N D^2)$ work and $O(N D^2)$ memory.
#
# The masked parallel and cumsum forms stop at shorter lengths (`limits` in the cell), where
# their $N \times N$ matrices and $N$ stored states grow large. Each time is the median of 3
# runs after a warm-up run, and a single run beyond $N = 2048$ (`tinyk3.timing`). Under half a
# minute (the cell prints its time).

# %%
def linear_attention_cumsum(q, k, v):
    """Unnormalised causal linear attention with every state S_t materialised."""
    # S_1..S_N  [B, H, N, Dk, Dv]
    S_all = (k.unsqueeze(-1) * v.unsqueeze(-2)).cumsum(dim=2)
    return (q.unsqueeze(-2) @ S_all).squeeze(-2)  # q_t S_t  [B, H, N, Dv]


H, D = 8, 64
q_c, k_c = (feature_maps.elu_plus_one(torch.randn(1, H, 256, D)) for _ in range(2))
v_c = torch.randn(1, H, 256, D)
o_ref = la.parallel(q_c, k_c, v_c)[0]
o_cumsum = linear_attention_cumsum(q_c, k_c, v_c)
print(f"cumsum form vs la.parallel (float32): max difference "
      f"{max_diff(o_cumsum, o_ref):.1e} (outputs up to {o_ref.abs().max().item():.0f})")

# %%
t0 = time.perf_counter()
limits = {"softmax (SDPA)": 16384, "linear, parallel": 2048,
          "linear, token loop": 16384, "linear, cumsum": 1024}
prefill = {name: [] for name in limits}
for N in PREFILL_LENGTHS:
    x_q, x_k, v_n = (torch.randn(1, H, N, D) for _ in range(3))
    q_n, k_n = feature_maps.elu_plus_one(x_q), feature_maps.elu_plus_one(x_k)
    forms = {  # each a call with its arguments bound
        "softmax (SDPA)": partial(F.scaled_dot_product_attention, x_q, x_k, v_n,
                                  is_causal=True),
        "linear, parallel": partial(la.parallel, q_n, k_n, v_n, normalize=True),
        "linear, token loop": partial(la.recurrent, q_n, k_n, v_n, normalize=True),
        "linear, cumsum": partial(linear_attention_cumsum, q_n, k_n, v_n),
    }
    for name, fn in forms.items():
        repeats = 3 if N <= 2048 else 1
        seconds = (time_fn(fn, repeats=repeats, warmup=1 if repeats > 1 else 0)
                   if N <= limits[name] else float("nan"))
        prefill[name].append(seconds)
print(f"{'N':>6s} " + " ".join(f"{name:>19s}" for name in prefill))
for i, N in enumerate(PREFILL_LENGTHS):
    print(f"{N:6d} "
          + " ".join(f"{prefill[name][i] * 1e3:16.1f} ms" for name in prefill))
print(f"({time.perf_counter() - t0:.0f} s; {stamp()})")

# %% mystnb={"figure": {"caption": "Prefill time of the four forms against the sequence length $N$, log-log. The two quadratic forms climb roughly as $N^2$, the token loop about as $N$ (the cell prints the fitted exponents), so the loop starts far behind and reaches the fused softmax kernel only at the longest prefills (the cell prints where).", "name": "fig-la-prefill-time"}, "image": {"alt": "Log-log line plot of time in milliseconds against prefill length N: softmax with SDPA, linear attention in parallel and cumsum forms, and the token loop; the cumsum line lies above all others, and the token loop line is the flattest, far above the steeper softmax line at short lengths and crossing it only at the longest ones, where it ends below it"}}
Ns = torch.tensor(PREFILL_LENGTHS, dtype=torch.float64)
fig, ax = plt.subplots()
for name, secs in prefill.items():
    ax.plot(PREFILL_LENGTHS, [s * 1e3 for s in secs], "o-", label=name)
ax.set(xscale="log", yscale="log", xlabel="prefill length N", ylabel="time (ms)",
       title=f"Prefill, H = {H} heads of D = {D}, one thread")
ax.legend()
plt.show()
for name, secs in prefill.items():  # slope of log(time) against log(N), from N = 256 on
    t = torch.tensor(secs, dtype=torch.float64)
    ok = ~t.isnan() & (Ns >= 256)
    if ok.sum() >= 2:
        log_N = Ns[ok].log()
        X = torch.stack([log_N, torch.ones_like(log_N)], 1)
        slope = torch.linalg.lstsq(X, t[ok].log()[:, None]).solution[0, 0].item()
        print(f"{name:20s} time grows as N^{slope:.2f} "
              f"(fit from N = 256 to {int(Ns[ok][-1])})")
loop, sdpa = prefill["linear, token loop"], prefill["softmax (SDPA)"]
faster = [N for N, a, b in zip(PREFILL_LENGTHS, loop, sdpa)
          if a < b and distinguishable(a, b)]
close = [N for N, a, b in zip(PREFILL_LENGTHS, loop, sdpa) if not distinguishable(a, b)]
print(f"token loop faster than SDPA at N = {faster or 'none of the lengths measured'}; "
      f"within the spread of each other at N = {close or 'none'}")
a = torch.randn(512, 512)
# flops per second, one core
flop_rate = 2 * 512**3 / time_fn(partial(torch.matmul, a, a), repeats=5)
loop_flops = 4 * H * D * D  # per token
print(f"token loop: {loop[-1] / PREFILL_LENGTHS[-1] * 1e6:.0f} µs per token "
      f"for 4·H·D² = {loop_flops:,} flops; "
      f"a 512×512 matrix product runs at {flop_rate / 1e9:.0f} GFLOP/s, "
      f"at which those flops take {loop_flops / flop_rate * 1e6:.1f} µs")

# %% [markdown]
# The fitted exponents give the asymptotics: the quadratic forms grow roughly as $N^2$ (the
# masked linear form, which writes an $N \times N$ matrix, a little faster) and the token loop
# close to $N$. The constants decide where they cross. The fused softmax kernel is fast, while
# the token loop pays a fixed cost for each of the many small tensor operations it runs per
# token, far more than its arithmetic would take at the rate a large matrix product
# reaches on the same core (the last line above). So the loop catches up only at the longest
# prefills, if at all (the line before says where). The cumsum form avoids the Python loop
# but writes $N D^2$ numbers per head, $D$ times the size of each input, and that memory
# traffic makes it the slowest of all.
#
# By flops alone ($2N^2D$ per head for causal attention that skips the masked half, $4ND^2$ for
# the recurrence) the crossover would be near $N \approx 2D$. What closes the gap in practice
# is doing the linear-time work as matrix products over blocks of tokens: inside a block the
# masked parallel form, between blocks the state. That is the chunked form of chapter 6.

# %% [markdown]
# ## Experiment 2: one decoding step against the position
#
# Decoding is where the fixed state pays. One step at position $t$, for a batch of 4
# sequences and all heads of a layer of width $d_{\text{model}} = H \cdot D = 1024$:
#
# - **KV cache, softmax**: write $k_t, v_t$ into a preallocated cache, as a server does
#   (chapter 2's `KVCache` concatenates), then one query attends over $t$ keys with
#   `scaled_dot_product_attention`. Work $\approx 4tD$ per head, reads $2tD$ numbers.
# - **Linear attention state**: $S \mathrel{+}= k_t^\top v_t$, $z \mathrel{+}= k_t$, then
#   $q_t S / (q_t \cdot z)$. Work $\approx 4D^2$ per head, reads and writes $D^2 + D$ numbers.
#
# Per head the work is equal at $t \approx D$, the memory at $t = (D + 1)/2$. The state step is
# the lib's one-token recurrence without its input checks (checked against it first). Both are
# timed at three head sizes, width fixed, each point the median of its runs after a warm-up
# run (`tinyk3.timing`); a few seconds (the cell prints its time).

# %%
def state_step(q_t, k_t, v_t, S, z, eps=1e-6):
    """One decoding step, in place.

    q_t, k_t: features [B, H, 1, Dk]; v_t [B, H, 1, Dv].
    """
    S += k_t.transpose(-1, -2) @ v_t  # S_t = S_{t-1} + k_tᵀ v_t  [B, H, Dk, Dv]
    z += k_t.squeeze(-2)  # z_t = z_{t-1} + k_t  [B, H, Dk]
    # q_t · z_t  [B, H, 1, 1]
    normalizer = (q_t.squeeze(-2) * z).sum(-1)[..., None, None]
    return (q_t @ S) / (normalizer + eps)  # [B, H, 1, Dv]


def kv_step(q_t, k_t, v_t, K, V, t):
    """One softmax decoding step over a preallocated cache K, V: [B, H, T_max, D]."""
    K[:, :, t : t + 1], V[:, :, t : t + 1] = k_t, v_t
    return F.scaled_dot_product_attention(q_t, K[:, :, : t + 1], V[:, :, : t + 1])


q_f, k_f = (feature_maps.elu_plus_one(torch.randn(2, 4, 20, 16)) for _ in range(2))
x_q, x_k, v_f = (torch.randn(2, 4, 20, 16) for _ in range(3))
S, z = torch.zeros(2, 4, 16, 16), torch.zeros(2, 4, 16)
steps = torch.cat([state_step(q_f[:, :, t : t + 1], k_f[:, :, t : t + 1],
                              v_f[:, :, t : t + 1], S, z) for t in range(20)], dim=2)
print(f"state_step, 20 steps vs la.recurrent:       max difference "
      f"{max_diff(steps, la.recurrent(q_f, k_f, v_f, normalize=True)[0]):.1e}")
K, V = torch.zeros(2, 4, 20, 16), torch.zeros(2, 4, 20, 16)
steps = torch.cat([kv_step(x_q[:, :, t : t + 1], x_k[:, :, t : t + 1],
                           v_f[:, :, t : t + 1], K, V, t) for t in range(20)], dim=2)
print(f"kv_step, 20 steps vs causal softmax attention: max difference "
      f"{max_diff(steps, causal_attention(x_q, x_k, v_f)):.1e}")

# %%
t0 = time.perf_counter()
Bd, d_model = 4, 1024  # sequences decoded together, layer width
# two positions per doubling, from 16 to DECODE_MAX
exponents = range(8, 2 * int(math.log2(DECODE_MAX)) + 1)
positions = sorted({round(2 ** (e / 2)) for e in exponents})
positions[-1] = DECODE_MAX - 1  # the last slot of the preallocated cache
decode = {}
for D in (32, 64, 128):
    H = d_model // D
    K, V = torch.randn(Bd, H, DECODE_MAX, D), torch.randn(Bd, H, DECODE_MAX, D)
    q_t, k_t, v_t = (torch.randn(Bd, H, 1, D) for _ in range(3))
    k_t = feature_maps.elu_plus_one(k_t)
    S, z = torch.zeros(Bd, H, D, D), torch.zeros(Bd, H, D)
    kv = [time_fn(partial(kv_step, q_t, k_t, v_t, K, V, t),
                  repeats=REPEATS if t <= 1024 else 7) for t in positions]
    st = [time_fn(partial(state_step, q_t, k_t, v_t, S, z), repeats=REPEATS)
          for t in positions]
    decode[D] = (torch.tensor(kv), torch.tensor(st))
del K, V
print(f"({time.perf_counter() - t0:.0f} s)")

# %% mystnb={"figure": {"caption": "Time of one decoding step against the position $t$, log-log, at three head sizes $D$ with the layer width fixed. The state step (dashed) stays roughly level at every position; the KV-cache step (solid) grows with $t$, about linearly at long contexts, and overtakes it within the measured range (the table below gives where).", "name": "fig-la-decode-step"}, "image": {"alt": "Log-log line plot of time per step in microseconds against position t: three roughly level dashed lines for the state step, one per head size, and three solid lines with markers for the KV cache that start near or below them, rise to a hundred times their starting time and more at the last position, about linearly at long contexts, and cross their dashed lines, the later the larger the head size"}}
fig, ax = plt.subplots(figsize=(6.8, 4))
for (D, (kv, st)), color in zip(decode.items(), ("C0", "C1", "C2")):
    ax.plot(positions, kv * 1e6, "o-", color=color, ms=3,
            label=f"KV cache, D = {D} (H = {d_model // D})")
    ax.plot(positions, st * 1e6, "--", color=color, label=f"state, D = {D}")
ax.set(xscale="log", yscale="log", xlabel="position t (tokens in the cache)",
       ylabel="time per step (µs)",
       title=f"One decoding step: batch {Bd}, all heads of a width-{d_model} layer")
ax.legend(fontsize=8, ncol=2)
plt.show()

# %% [markdown]
# The same measurements as numbers: the state step's time (median over positions), the first
# measured position at which the KV step is slower, and the rate at which the KV step reads
# its cache, early and at the end.

# %%
mid = min(positions, key=lambda t: abs(t - 1024))
crossovers = []
print(f"{'D':>4s} {'H':>3s} {'state step':>11s} {'KV slower from t':>17s} "
      f"{'t / D':>6s} {'KV step at t=' + str(mid):>18s} "
      f"{'t=' + str(positions[-1]):>9s} "
      f"{'cache read at t=' + str(mid):>20s} {'t=' + str(positions[-1]):>9s}")
for D, (kv, st) in decode.items():
    slower = next((t for t, a in zip(positions, kv) if a > st.median()), None)
    ratio = f"{slower / D:6.1f}" if slower else f"{'-':>6s}"
    # GB/s: the bytes of the keys and values read, over the step's time
    rate = {t: 2 * Bd * (t + 1) * d_model * 4 / kv[positions.index(t)].item() / 1e9
            for t in (mid, positions[-1])}
    print(f"{D:4d} {d_model // D:3d} {st.median() * 1e6:8.0f} µs {slower!s:>17s} "
          f"{ratio} {kv[positions.index(mid)] * 1e6:15.0f} µs {kv[-1] * 1e6:6.0f} µs "
          f"{rate[mid]:15.1f} GB/s {rate[positions[-1]]:4.1f} GB/s")
    crossovers.append(slower)
print(stamp())
cache_mib = 2 * Bd * DECODE_MAX * d_model * 4 / 2**20
print(f"the cache of the layer at t = {positions[-1]}: {cache_mib:.0f} MiB (float32); "
      f"the states: {Bd * d_model * 32 * 4 / 2**10:.0f} KiB (D = 32) "
      f"to {Bd * d_model * 128 * 4 / 2**10:.0f} KiB (D = 128)")
pairs = zip(crossovers, crossovers[1:])
steady = None not in crossovers and all(a < b for a, b in pairs)
verdict = ("moves right with every doubling of D, as the count predicts" if steady
           else "does not move right with every doubling of D")
print(f"the crossover {verdict}")

# %% [markdown]
# The state step's time does not grow with $t$ (it only fluctuates); the KV step's grows about
# linearly once past its fixed cost. At a fixed width the state step's work is proportional to
# $H D^2 = d_{\text{model}} D$ and the KV step's to $t\,d_{\text{model}}$, so the count predicts
# a crossover that moves right as $D$ grows; the last line above says whether the measurement
# follows. The crossover lies within a small factor of $D$ (column `t / D`), not at $t = D$,
# because each step also pays a fixed cost for launching its operations, which the count
# ignores.
#
# At long contexts the KV step's time is set by reading the cache (the last two columns give
# the rate, in GB/s on one core). That is the post's memory-traffic argument: every step
# streams the whole cache through the processor, while the state is read and written once.
#
# **Memory.** Per head, the cache grows by $2D$ numbers per token, the state stays at
# $D^2 + D$. At the head size of Kimi Linear's KDA layers ($D = 128$) and a million tokens:

# %% tags=["nbval-check-output"]
D, t = 128, 1_048_576
print(f"KV cache, one head, bfloat16, {t:,} tokens: {2 * t * D * 2 / 2**20:,.0f} MiB")
print("state S and z, one head, float32:            "
      f"{(D * D + D) * 4 / 2**10:,.1f} KiB")
print(f"the cache is larger than the state from t = {(D + 1) // 2 + 1} tokens on")

# %% [markdown]
# What the fixed state costs is the subject of the next chapter: $D^2$ numbers cannot hold
# an arbitrary number of key-value pairs, and a query's read $q_t S_t$ returns a sum over
# every stored value, weighted by key overlaps, not the one value it asks for.

# %% [markdown]
# ## Exercises
#
# ```{exercise} Causal linear attention, parallel form
# :label: ex-la-parallel
#
# Write `linear_attention_parallel(q, k, v)`: causal linear attention without the normaliser,
# $o_t = \sum_{j \le t} (q_t \cdot k_j)\, v_j$, for a whole sequence at once. `q` and `k` are
# features already ($\phi$ applied), `[B, H, T, Dk]`; `v` is `[B, H, T, Dv]`; return
# `[B, H, T, Dv]` in the inputs' dtype. A loop is fine too; the check includes float64 inputs
# and a single token.
# ```

# %%
def linear_attention_parallel_mine(q, k, v):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("linear_attention.parallel", linear_attention_parallel_mine)

# %% [markdown]
# ```{solution-start} ex-la-parallel
# :class: dropdown
# ```

# %%
def linear_attention_parallel_solution(q, k, v):
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2)  # q_t · k_j  [B, H, T, T]
    keep = torch.ones(T, T, dtype=torch.bool).tril()  # j <= t
    scores = scores.masked_fill(~keep, 0.0)
    return scores @ v  # [B, H, T, Dv]


ok = checks.run("linear_attention.parallel", linear_attention_parallel_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} With the normaliser
# :label: ex-la-normalized
#
# Write `linear_attention_normalized(q, k, v)`: $o_t = q_t S_t / (q_t \cdot z_t + \varepsilon)$
# with $S_t = \sum_{j \le t} k_j^\top v_j$, $z_t = \sum_{j \le t} k_j$ and $\varepsilon = 10^{-6}$
# (as `tinyk3` does; the tolerance also accepts no $\varepsilon$). Same shapes as above; `q` and
# `k` are positive features. Write it as a token loop or vectorised, as you like.
# ```

# %%
def linear_attention_normalized_mine(q, k, v):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("linear_attention.normalized", linear_attention_normalized_mine)

# %% [markdown]
# ```{solution-start} ex-la-normalized
# :class: dropdown
# ```

# %%
def linear_attention_normalized_solution(q, k, v, eps=1e-6):
    # Σ_{j≤t} (q_t·k_j) v_j  [B, H, T, Dv]
    numerator = (q @ k.transpose(-1, -2)).tril() @ v
    z = k.cumsum(dim=2)  # z_t = Σ_{j≤t} k_j, one per position  [B, H, T, Dk]
    return numerator / ((q * z).sum(-1, keepdim=True) + eps)  # ÷ (q_t · z_t + ε)


ok = checks.run("linear_attention.normalized", linear_attention_normalized_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} Where the cache outgrows the state
# :label: ex-la-crossover
#
# One head keeps either a KV cache of $t$ tokens ($2tD$ numbers) or a linear-attention state
# ($S$ and $z$: $D^2 + D$ numbers). Write `crossover_length(head_dim)`: the smallest whole
# number of tokens $t$ for which the cache holds strictly more numbers than the state.
# ```

# %%
def crossover_length_mine(head_dim):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("linear_attention.crossover_length", crossover_length_mine)

# %% [markdown]
# ```{solution-start} ex-la-crossover
# :class: dropdown
# ```

# %%
def crossover_length_solution(head_dim):
    D = head_dim
    # 2·t·D > D·D + D  <=>  t > (D + 1) / 2; the smallest such whole t:
    return (D + 1) // 2 + 1


ok = checks.run("linear_attention.crossover_length", crossover_length_solution)
print(f"GPT-2 (D = 64): the cache is larger from t = {crossover_length_solution(64)}; "
      f"Kimi Linear's KDA heads (D = 128): from t = {crossover_length_solution(128)}")

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Replacing $\exp(q \cdot k)$ by a kernel $\phi(q)\phi(k)^\top$ lets $\phi(q_t)$ come out of the
#   attention sum: $o_t = \phi(q_t) S_t / (\phi(q_t) \cdot z_t)$ with a state
#   $S_t = S_{t-1} + \phi(k_t)^\top v_t$, $z_t = z_{t-1} + \phi(k_t)$ of fixed size $D_k D_v + D_k$.
# - The token loop and the masked parallel form $(QK^\top \odot M)V$ agree to round-off, and
#   a prefill's final state continues token by token exactly.
# - The post's block update is right for one token and not causal for a block (nor is its
#   normaliser summed); its token loop does not run as printed.
# - The kernel gives up softmax's sharpness: untrained ELU+1 weights are close to a plain
#   running average; `taylor2` imitates softmax for small logits with $1 + D + D^2$ features.
# - A state step costs about the same at every position, a KV-cache step grows with $t$; a Python
#   token loop is slow at prefill for reasons of overhead, not arithmetic.
#
# **Next.** The fixed state must hold everything. Chapter 4 treats it as an associative memory
# and measures how recall degrades as the number of stored pairs approaches $D$.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
