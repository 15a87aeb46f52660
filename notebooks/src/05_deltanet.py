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
# # DeltaNet: the delta rule, a fast-weight programmer
#
# Chapter 4 measured the state of linear attention as an associative memory and ended on its
# two blind spots: the additive write $S \mathrel{+}= k^\top v$ can neither overwrite nor forget.
# Writing a new value under a key that is already stored adds it to the old one, and every pair
# stays in the sum for good, so the crosstalk only grows. DeltaNet changes one line. Before it
# writes, a token *reads* what the state holds at its key, and writes back only the difference
# between the value it brings and the value already there, scaled by a learned write strength
# $\beta_t$. That is Widrow and Hoff's delta rule, applied to a matrix of *fast weights* that the
# network programs as it reads.
#
# **In this chapter** you build the delta rule as a token loop and check it equal to `tinyk3`'s
# two forms of it (the loop and a one-block triangular solve); prove that each write is one step
# of gradient descent on $\tfrac12\|k S - v\|^2$; find the eigenvalues of the write, and with
# them why the keys must be normalised; overwrite a memory with the delta rule and with the
# additive rule and compare what comes back; train softmax attention, linear attention and
# DeltaNet on multi-query associative recall; and find and fix an error in the post's DeltaNet
# listing (a prefill that reads the state once for all its tokens).
#
# **Cost.** Two to two and a half minutes on one CPU core at full size, almost all of it in the
# training experiment (the last cell prints the time); `SMOKE = True` runs in a few seconds.

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

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from tinyk3 import checks, memory
from tinyk3.data import mqar, mqar_seq_len, recall_accuracy
from tinyk3.models import MixerConfig, MixerLM
from tinyk3.ops import delta_rule
from tinyk3.train import train_batches

DIMS = [8, 16] if SMOKE else [16, 32, 64]  # memory sizes D in the overwrite experiment
LOADS = [0.125, 0.25, 0.5, 1, 2, 4] if not SMOKE else [0.25, 1, 4]  # N/D
PAIRS_PER_POINT = 256 if SMOKE else 2048  # stored pairs averaged over per point
NORM_STEPS = 60 if SMOKE else 300  # writes in the stability experiment
TIMING_REPEATS = 2 if SMOKE else 5


def max_diff(a, b):
    return (a - b).abs().max().item()


# %% [markdown]
# ## The problem: a memory that can only add
#
# Store four pairs in an additive memory with orthonormal keys (so there is no crosstalk at
# all, chapter 4), then store four *new* values under the same four keys, and read the keys:

# %%
D = 8
g = torch.Generator().manual_seed(0)
keys = memory.orthonormal_keys(4, D, generator=g, dtype=torch.float64)  # [4, D]
v_old = torch.randn(4, D, generator=g, dtype=torch.float64)
v_new = torch.randn(4, D, generator=g, dtype=torch.float64)

# the old pairs, then the new values under the same keys
S = memory.write(torch.cat([keys, keys]), torch.cat([v_old, v_new]))
reads = memory.read(S, keys)  # [4, D]
print(f"max |read - (v_old + v_new)| = {max_diff(reads, v_old + v_new):.1e}")
print(f"max |read - v_new|           = {max_diff(reads, v_new):.2f}")

# %% [markdown]
# Each key returns the sum of everything ever written under it. Nothing in
# $S \mathrel{+}= k^\top v$ can remove a stored value: the only way to change what a key reads
# is to add something more. Schlag, Irie and Schmidhuber (2021) put the consequence plainly:
# once a sequence holds more associations than the state can store, a purely additive memory
# keeps piling them up, while what it needs is to decide which associations to keep and which to
# replace.

# %% [markdown]
# ## The idea: read what is there, write the difference
#
# Let token $t$ first read the state at its own key,
#
# $$
# v^{\text{old}}_t = k_t S_{t-1} \qquad (1 \times D_v),
# $$
#
# and then write not $v_t$ but the *correction* $v_t - v^{\text{old}}_t$, scaled by a write
# strength $\beta_t \in (0, 1)$:
#
# $$
# S_t = S_{t-1} + k_t^\top\, \beta_t \big(v_t - k_t S_{t-1}\big)
#     = \big(I - \beta_t\, k_t^\top k_t\big)\, S_{t-1} + \beta_t\, k_t^\top v_t ,
# \qquad o_t = q_t S_t .
# $$
#
# With a unit key, $\|k_t\| = 1$, reading the new state at $k_t$ gives
# $k_t S_t = (1 - \beta_t)\, v^{\text{old}}_t + \beta_t v_t$: the stored value moves a fraction
# $\beta_t$ of the way to the new one, and with $\beta_t = 1$ it *is* the new one. The second
# form says the same as a transition matrix: $I - \beta_t k_t^\top k_t$ shrinks the state along
# $k_t$ only (erase), and $\beta_t k_t^\top v_t$ is chapter 3's write.
#
# This is the *delta rule* of Widrow and Hoff (1960), the least-mean-squares update of a linear
# map, applied to a matrix that changes at every token. A network whose outputs program such a
# matrix is Schmidhuber's (1992) *fast weight programmer*: the slow weights (the projections to
# $q, k, v, \beta$) are trained by gradient descent, and they write the fast weights $S$ while
# the sequence is read. Schlag, Irie and Schmidhuber (2021) showed that linear attention is the
# additive special case and put the delta rule in its place, in a layer they called DeltaNet;
# Yang et al. (2024, *Parallelizing Linear Transformers with the Delta Rule over Sequence
# Length*) found how to train it in parallel over the sequence, and at scale. In their layer:
#
# - $q_t$ and $k_t$ are projections of $x_t$ passed through SiLU and **L2-normalised** per head
#   (a section below shows why the normalisation is not optional);
# - $\beta_t = \operatorname{sigmoid}(w_\beta \cdot x_t)$ per head and token, so the network
#   decides how hard each token writes;
# - there is no normaliser $q_t \cdot z_t$ as in chapter 3: $o_t = q_t S_t$.
#
# **The papers' layout.** Yang et al. write column vectors and a state $S \in
# \mathbb{R}^{D_v \times D_k}$: $S_t = S_{t-1}\big(I - \beta_t k_t k_t^\top\big) + \beta_t v_t
# k_t^\top$, $o_t = S_t q_t$. Their $S$ is our $S^\top$ (see the
# [notation page](../book/notation.md)); a check below computes both.

# %% [markdown]
# ## Build it: the token loop
#
# One step per token, exactly the two equations above: read $v^{\text{old}}_t = k_t S_{t-1}$,
# form $u_t = \beta_t (v_t - v^{\text{old}}_t)$, write $S_t = S_{t-1} + k_t^\top u_t$, read out
# $o_t = q_t S_t$. Rows are kept as `[..., 1, D]` matrices so every product is a `@`.

# %%
def delta_rule_loop(q, k, v, beta):
    """q, k: [B, H, T, Dk]; v: [B, H, T, Dv]; beta: [B, H, T]. From S_0 = 0.

    Returns (o, S_T).
    """
    B, H, T, Dk = k.shape
    S = k.new_zeros(B, H, Dk, v.shape[-1])  # [B, H, Dk, Dv]
    outs = []
    for t in range(T):
        k_t = k[:, :, t].unsqueeze(-2)  # a row  [B, H, 1, Dk]
        v_old = k_t @ S  # what S holds at k_t  [B, H, 1, Dv]
        v_t = v[:, :, t].unsqueeze(-2)  # [B, H, 1, Dv]
        u_t = beta[:, :, t, None, None] * (v_t - v_old)  # β_t (v_t − v_old)
        S = S + k_t.transpose(-1, -2) @ u_t  # S_t = S_{t-1} + k_tᵀ u_t  [B, H, Dk, Dv]
        outs.append(q[:, :, t].unsqueeze(-2) @ S)  # o_t = q_t S_t  [B, H, 1, Dv]
    return torch.cat(outs, dim=2), S  # [B, H, T, Dv], [B, H, Dk, Dv]


# %% [markdown]
# First the overwrite from above, as a sequence of eight tokens (the four old pairs, then the
# four new values under the same keys), with $\beta = 1$, reading each key at the end:

# %%
seq_k = torch.cat([keys, keys])[None, None]  # [1, 1, 8, D]
seq_v = torch.cat([v_old, v_new])[None, None]  # [1, 1, 8, D]
ones = torch.ones(1, 1, 8, dtype=torch.float64)  # β_t = 1
_, S = delta_rule_loop(seq_k, seq_k, seq_v, ones)
reads = memory.read(S[0, 0], keys)
print(f"delta rule: max |read - v_new| = {max_diff(reads, v_new):.1e}")

# %% [markdown]
# Every key now returns its new value and nothing of the old one. The loop against
# `tinyk3.ops.delta_rule.recurrent` (the same loop, with the state accumulated in float32 or
# float64), for random unit keys and queries and random write strengths, in both precisions:

# %%
torch.manual_seed(1)
B, H, T, Dk, Dv = 2, 3, 24, 8, 6
q = F.normalize(torch.randn(B, H, T, Dk, dtype=torch.float64), dim=-1)
k = F.normalize(torch.randn(B, H, T, Dk, dtype=torch.float64), dim=-1)
v = torch.randn(B, H, T, Dv, dtype=torch.float64)
beta = torch.rand(B, H, T, dtype=torch.float64)

for dtype in (torch.float64, torch.float32):
    args = [x.to(dtype) for x in (q, k, v, beta)]
    o_mine, S_mine = delta_rule_loop(*args)
    o_lib, S_lib = delta_rule.recurrent(*args)
    print(f"{str(dtype):14s} max |mine - recurrent|: "
          f"outputs {max_diff(o_mine, o_lib):.1e}, "
          f"final state {max_diff(S_mine, S_lib):.1e}")

# %% [markdown]
# Identical, in both precisions: the lib's loop does the same operations in the same order
# (written with `einsum` instead of `@`). Here it is; from now on the chapter uses it.

# %%
tinyk3.notebook.show_source(delta_rule.recurrent)

# %% [markdown]
# ### The same contract, solved as one triangular system
#
# The loop is exact but slow to train: one Python step per token, and autograd records every
# one of them. `tinyk3.ops.delta_rule.parallel` has the same contract and computes the same
# numbers without a loop over tokens. Unrolling the recurrence, $S_{t-1} = S_0 + \sum_{j<t}
# k_j^\top u_j$, so the corrections $u_t = \beta_t (v_t - k_t S_{t-1})$ satisfy
#
# $$
# u_t + \beta_t \sum_{j<t} (k_t \cdot k_j)\, u_j = \beta_t \big(v_t - k_t S_0\big)
# \quad\Longleftrightarrow\quad
# \big(I + \operatorname{diag}(\beta)\,\operatorname{tril}(K K^\top, -1)\big)\, U
#   = \operatorname{diag}(\beta)\,(V - K S_0),
# $$
#
# a lower-triangular system with ones on the diagonal, solved in one call. Then
# $O = Q S_0 + (Q K^\top \odot M)\, U$ (masked as in chapter 3) and $S_T = S_0 + K^\top U$.
# It costs $O(T^2 D + T^3)$, fine for the short sequences of this chapter; chapters 7 and 8
# derive it properly and make it the inside of a chunk. The check, and the speed of both for a
# training step (forward and backward) of two heads over 64 tokens:

# %%
for dtype in (torch.float64, torch.float32):
    args = [x.to(dtype) for x in (q, k, v, beta)]
    o_rec, S_rec = delta_rule.recurrent(*args)
    o_par, S_par = delta_rule.parallel(*args)
    o_mine, _ = delta_rule_loop(*args)
    print(f"{str(dtype):14s} max |parallel - recurrent|: "
          f"outputs {max_diff(o_par, o_rec):.1e}, "
          f"final state {max_diff(S_par, S_rec):.1e};"
          f"  max |parallel - my loop| {max_diff(o_par, o_mine):.1e}")


def fwd_bwd_time(op, B=32, H=2, T=64, D=32, repeats=TIMING_REPEATS):
    q, k = (F.normalize(torch.randn(B, H, T, D), dim=-1).requires_grad_()
            for _ in range(2))
    v = torch.randn(B, H, T, D, requires_grad=True)
    beta = torch.rand(B, H, T, requires_grad=True)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        o, _ = op(q, k, v, beta)
        o.sum().backward()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]  # median, after one warm-up


t_rec, t_par = fwd_bwd_time(delta_rule.recurrent), fwd_bwd_time(delta_rule.parallel)
print(f"forward + backward, B=32, H=2, T=64, D=32: recurrent {t_rec * 1e3:.0f} ms, "
      f"parallel {t_par * 1e3:.0f} ms ({t_rec / t_par:.0f}x faster)")

# %% [markdown]
# **The papers' layout**, computed directly: a state $S^{\text{paper}} \in \mathbb{R}^{D_v \times
# D_k}$ updated by $S \leftarrow S (I - \beta_t k_t k_t^\top) + \beta_t v_t k_t^\top$ with column
# vectors, read by $S q_t$. Its outputs are ours, and its state is our state transposed:

# %%
S_paper, outs = torch.zeros(B, H, Dv, Dk, dtype=torch.float64), []
eye = torch.eye(Dk, dtype=torch.float64)
for t in range(T):
    # token t's key, value and query as columns  [B, H, D, 1]
    k_col, v_col, q_col = k[:, :, t, :, None], v[:, :, t, :, None], q[:, :, t, :, None]
    b_t = beta[:, :, t, None, None]
    # [B, H, Dv, Dk]
    S_paper = S_paper @ (eye - b_t * k_col @ k_col.mT) + b_t * v_col @ k_col.mT
    outs.append((S_paper @ q_col).squeeze(-1))  # S_t q_t  [B, H, Dv]
o_ours, S_ours = delta_rule.recurrent(q, k, v, beta)
print(f"max |outputs, papers' layout - ours|       = "
      f"{max_diff(torch.stack(outs, dim=2), o_ours):.1e}")
print(f"max |final S^paper - our S transposed|     = "
      f"{max_diff(S_paper, S_ours.mT):.1e}")


# %% [markdown]
# ## Each write is one step of gradient descent
#
# Ask the state to map the key $k_t$ to the value $v_t$, with the squared error as the loss:
#
# $$
# \mathcal{L}_t(S) = \tfrac12\, \big\|k_t S - v_t\big\|^2,
# \qquad
# \nabla_S \mathcal{L}_t = k_t^\top \big(k_t S - v_t\big) \quad (D_k \times D_v).
# $$
#
# One gradient step from $S_{t-1}$ with learning rate $\beta_t$ is
# $S_{t-1} - \beta_t k_t^\top (k_t S_{t-1} - v_t) = S_{t-1} + k_t^\top \beta_t (v_t - k_t S_{t-1})$:
# the delta rule, for any key. So DeltaNet's state is trained *online*, one gradient step per
# token, on a regression from keys to values, and the state after $t$ tokens is the result of
# that training. (Linear attention's write $k_t^\top v_t$ is the same step for the loss
# $-k_t S v_t^\top$, which has no minimum: it only ever pushes.) Autograd agrees, for a unit key
# and for a key of length 3:

# %%
def delta_write(S, k, v, beta):
    """One token through tinyk3's delta rule.

    S [Dk, Dv], k [Dk], v [Dv], beta a number.
    """
    b = torch.tensor(beta, dtype=S.dtype).view(1, 1, 1)
    k1, v1 = k.view(1, 1, 1, -1), v.view(1, 1, 1, -1)  # one token  [1, 1, 1, D]
    _, S_new = delta_rule.recurrent(k1, k1, v1, b, initial_state=S.view(1, 1, *S.shape))
    return S_new[0, 0]


g = torch.Generator().manual_seed(2)
D = 16
S0 = torch.randn(D, D, generator=g, dtype=torch.float64)
v_t = torch.randn(D, generator=g, dtype=torch.float64)
unit_key = F.normalize(torch.randn(D, generator=g, dtype=torch.float64), dim=0)
for name, k_t in (("unit key", unit_key), ("key of length 3", 3 * unit_key)):
    for b in (0.3, 1.0):
        S = S0.clone().requires_grad_()
        loss = 0.5 * (k_t @ S - v_t).pow(2).sum()  # ½‖k S − v‖²
        (grad,) = torch.autograd.grad(loss, S)
        sgd_step = S0 - b * grad
        S_new = delta_write(S0, k_t, v_t, b)
        # the residual after the write / before it
        shrink = (k_t @ S_new - v_t).norm() / (k_t @ S0 - v_t).norm()
        factor = 1 - b * k_t.dot(k_t)
        print(f"{name:15s} β = {b}: max |delta rule - gradient step| = "
              f"{max_diff(S_new, sgd_step):.1e};"
              f"  ‖k S − v‖ after / before = {shrink:.3f} (1 − β‖k‖² = {factor:+.3f})")

# %% [markdown]
# The ratio in the last column is the whole story of this section. Along $k_t$ the residual after the step
# is $k_t S_t - v_t = (1 - \beta_t \|k_t\|^2)(k_t S_{t-1} - v_t)$. With a unit key the step moves a
# fraction $\beta_t$ of the way to the target, and with $\beta_t = 1$ it lands on it exactly: the
# learning rate is the write strength. With $\|k_t\| = 3$ the same $\beta_t$ overshoots: at
# $\beta_t = 0.3$ the residual flips sign and comes back larger, at $\beta_t = 1$ eight times
# larger. The next section makes that precise.

# %% [markdown]
# ## The eigenvalues of a write, and why keys are normalised
#
# Without the write term, a step maps $S \mapsto A_t S$ with $A_t = I - \beta_t k_t^\top k_t$, a
# symmetric $D_k \times D_k$ matrix. Any vector $x$ orthogonal to $k_t$ has $x A_t = x$, and
# $k_t A_t = k_t - \beta_t \|k_t\|^2 k_t$, so its eigenvalues are
#
# $$
# \underbrace{1, \dots, 1}_{D_k - 1 \text{ times}}, \qquad 1 - \beta_t \|k_t\|^2 \ \ \text{(along } k_t\text{)}.
# $$
#
# The state is left untouched in every direction but $k_t$'s, and along $k_t$ it is multiplied
# by $1 - \beta_t\|k_t\|^2$. Numerically, for a unit key and for an unnormalised Gaussian key in
# $D_k = 16$, with $\beta = 0.5$:

# %%
D, b = 16, 0.5
g = torch.Generator().manual_seed(3)
raw_key = torch.randn(D, generator=g, dtype=torch.float64)
unit_key = F.normalize(raw_key, dim=0)
for name, k_t in (("unit key", unit_key), ("raw Gaussian key", raw_key)):
    A = torch.eye(D, dtype=torch.float64) - b * torch.outer(k_t, k_t)  # I − β kᵀk
    eig = torch.linalg.eigvals(A)
    ones_ = (eig - 1).abs() < 1e-10
    other = eig[~ones_].real
    print(f"{name:17s} ‖k‖² = {k_t.dot(k_t):6.2f}: "
          f"{int(ones_.sum())} eigenvalues equal to 1 "
          f"(max imaginary part {eig.imag.abs().max():.0e}); "
          f"the other: {other.item():+.4f}, 1 − β‖k‖² = {1 - b * k_t.dot(k_t):+.4f}")

# %% [markdown]
# With $\|k_t\| = 1$ and $\beta_t \in [0, 1]$ the special eigenvalue lies in $[0, 1]$: every write
# is non-expansive, $\|x A_t\| \le \|x\|$, and $\beta_t = 1$ makes $A_t$ the orthogonal projection
# that removes the $k_t$ component. Without normalisation nothing bounds $\beta_t\|k_t\|^2$, and
# once $\|k_t\|^2 > 2/\beta_t$ the factor $|1 - \beta_t\|k_t\|^2|$ exceeds 1: every write *amplifies*
# what the state holds along its key (with a sign flip). A random unit direction carries on
# average $1/D$ of the state's squared norm, so for keys of one length and random directions the
# squared norm grows, in expectation, by the factor $1 + \big((1-\beta\|k\|^2)^2 - 1\big)/D$ per
# write, and the norm by its square root: geometrically.
#
# The experiment: $D = 16$, $\beta = 0.5$, Gaussian values, random key directions; key lengths
# with $\beta\|k\|^2 = 0.5$ (unit keys), $1.9$, $2.5$ and $3$, and raw Gaussian keys
# ($\|k\|^2 \approx D$, so $\beta\|k\|^2 \approx 8$). A fraction of a second.

# %% mystnb={"figure": {"caption": "Frobenius norm of a delta-rule state over 300 writes ($D = 16$, $\\beta = 0.5$), for keys of fixed lengths and for raw Gaussian keys, log scale. With $\\beta\\|k\\|^2 < 2$ the norm levels off; beyond it grows geometrically, and raw Gaussian keys grow fastest of all.", "name": "fig-deltanet-state-norm"}, "image": {"alt": "Line plot of the state norm against the number of writes on a logarithmic y axis: the lines for beta times squared key length 0.5 and 1.9 level off low down, those for 2.5 and 3.0 climb steadily, and the raw Gaussian key line climbs far above them, beyond 10 to the 60"}}
def state_norms(keys, values, beta):
    """‖S_t‖_F after each write of a delta-rule memory that starts empty.

    keys [T, D], values [T, Dv].
    """
    S = torch.zeros(keys.shape[1], values.shape[1], dtype=keys.dtype)
    norms = []
    for k_t, v_t in zip(keys, values):
        S = delta_write(S, k_t, v_t, beta)
        norms.append(S.norm().item())
    return torch.tensor(norms, dtype=torch.float64)


D, b, T = 16, 0.5, NORM_STEPS
g = torch.Generator().manual_seed(4)
directions = F.normalize(torch.randn(T, D, generator=g, dtype=torch.float64), dim=-1)
values = torch.randn(T, D, generator=g, dtype=torch.float64)
runs = {f"β‖k‖² = {bk}": directions * math.sqrt(bk / b) for bk in (0.5, 1.9, 2.5, 3.0)}
runs["raw Gaussian keys"] = torch.randn(T, D, generator=g, dtype=torch.float64)
norms = {name: state_norms(keys_, values, b) for name, keys_ in runs.items()}

fig, ax = plt.subplots(figsize=(6.8, 3.8))
for name, n in norms.items():
    ax.plot(range(1, T + 1), n, label=name)
ax.set(yscale="log", xlabel="writes t", ylabel="‖S_t‖ (Frobenius)",
       title=f"Delta-rule state norm, D = {D}, β = {b}")
ax.legend(fontsize=8)
plt.show()

print(f"{'keys':>20s} {'‖S‖ at the end':>17s} {'growth of ‖S‖ per write':>24s} "
      f"{'predicted':>10s}")
for name, n in norms.items():
    finite = n[torch.isfinite(n)]
    half = len(finite) // 2
    # growth per write over the second half of the run
    log_growth = (finite[-1] / finite[half]).log().item()
    measured = math.exp(log_growth / (len(finite) - 1 - half))
    end = f"{n[-1]:.3g}" if torch.isfinite(n[-1]) else f"inf from t = {len(finite) + 1}"
    predicted = "-"
    if name.startswith("β"):
        # keys of one length: c = 1 − β‖k‖², growth √(1 + (c² − 1)/D)
        c = 1 - b * runs[name][0].pow(2).sum().item()
        predicted = f"{math.sqrt(1 + (c * c - 1) / D):.4f}"
    print(f"{name:>20s} {end:>17s} {measured:24.4f} {predicted:>10s}")
float32_max = torch.finfo(torch.float32).max
too_big = norms["raw Gaussian keys"] > float32_max
when = int(too_big.nonzero()[0]) + 1 if too_big.any() else "never, in this run"
print(f"raw Gaussian keys: ‖S‖ passes float32's largest number ({float32_max:.1e}) "
      f"at write {when}")

# %% [markdown]
# Both stable settings level off where erasing balances writing (measured growth close to 1
# over the second half of the run; a predicted factor below 1 is only how fast the *initial*
# state would be forgotten, the level itself is set by the writes). The unstable ones grow
# geometrically, at close to the predicted rate once the state is large. Raw Gaussian keys
# grow fastest of all, past the largest float32 number within the run (last line), which in a
# model would mean infinities and then NaNs. This is why DeltaNet normalises $k$ (and $q$, so
# that the read-out $q_t S_t$ has the scale of the stored values), and why $\beta_t$ is a
# sigmoid.

# %% [markdown]
# ## Experiment 1: overwriting a memory
#
# Now the test of the opening, at scale and without training: for a memory of size $D$, write
# $N$ pairs $(k_i, v^{\text{old}}_i)$, then write each key again with a new value
# $v^{\text{new}}_i$ (same order), and read every key. The same $2N$ tokens go into an additive
# memory (chapter 4's `memory.write`) and a delta-rule memory with $\beta = 1$ (the final state
# of `delta_rule.parallel`). Keys are unit vectors: random ones for every $N$, orthonormal ones
# where $N \le D$. Three measurements, averaged over about 2,000 pairs per point:
#
# - the **relative error against the new values**, $\sqrt{\sum_i \|k_i S - v^{\text{new}}_i\|^2 / \sum_i
#   \|v^{\text{new}}_i\|^2}$;
# - **which value comes back**: the fraction of keys whose read is closer (by cosine) to the new
#   value than to the old one: one half is a coin flip;
# - **how much of each**: the least-squares coefficients $a, b$ in
#   $k_i S \approx a\, v^{\text{old}}_i + b\, v^{\text{new}}_i + \text{noise}$ (the values are
#   independent, so
#   $b = \sum_i \langle k_i S, v^{\text{new}}_i\rangle / \sum_i \|v^{\text{new}}_i\|^2$
#   and likewise $a$).
#
# What to expect. The additive memory holds $\sum_i k_i^\top (v^{\text{old}}_i + v^{\text{new}}_i)$,
# so $a = b = 1$: it returns the old and the new value in equal parts, plus chapter 4's
# crosstalk. The delta rule with orthonormal keys replaces each value exactly. With random keys
# it replaces too, but each later write at $k_j$ also erases the part of the state along $k_j$,
# and with it a fraction $(k_i\cdot k_j)^2$, on average $1/D$, of key $i$'s new value. A value
# followed by $m$ writes keeps about $(1 - 1/D)^m$ of itself: the memory forgets the oldest
# first. Averaged over the $N$ rewritten keys ($m = 0, \dots, N-1$):
#
# $$
# b \approx \frac{1}{N}\sum_{m=0}^{N-1}\Big(1 - \frac1D\Big)^m = \frac{D}{N}\Big(1 - \big(1 - \tfrac1D\big)^N\Big)
# \approx \frac{1 - e^{-N/D}}{N/D} .
# $$
#
# A few seconds at full size.

# %%
def overwrite_test(make_keys, D, N, M, g):
    """M memories of N pairs in D dims: written, rewritten with new values, read."""
    keys = make_keys(M, N, D, g)  # [M, N, D]
    old = torch.randn(M, N, D, generator=g, dtype=torch.float64)  # [M, N, D]
    new = torch.randn(M, N, D, generator=g, dtype=torch.float64)  # [M, N, D]
    # the 2N tokens, in order
    k2, v2 = torch.cat([keys, keys], dim=1), torch.cat([old, new], dim=1)
    ones = torch.ones(M, 1, 2 * N, dtype=torch.float64)  # β = 1
    S_delta = delta_rule.parallel(k2[:, None], k2[:, None], v2[:, None], ones)[1]
    states = {"additive": memory.write(k2, v2),  # Σ kᵀ v   [M, D, D]
              "delta rule": S_delta[:, 0]}
    out = {}
    for name, S in states.items():
        r = memory.read(S, keys)  # [M, N, D]
        cos_new = F.cosine_similarity(r, new, dim=-1)
        cos_old = F.cosine_similarity(r, old, dim=-1)
        error = ((r - new).pow(2).sum() / new.pow(2).sum()).sqrt().item()
        out[name] = dict(error=error,
                         newer=(cos_new > cos_old).double().mean().item(),
                         a=((r * old).sum() / old.pow(2).sum()).item(),
                         b=((r * new).sum() / new.pow(2).sum()).item())
    return out


def random_keys(M, N, D, g):
    keys = memory.random_unit_keys(M * N, D, generator=g, dtype=torch.float64)
    return keys.view(M, N, D)


def orthonormal_keys(M, N, D, g):
    return torch.stack([memory.orthonormal_keys(N, D, generator=g, dtype=torch.float64)
                        for _ in range(M)])


t0 = time.perf_counter()
overwrite = {}  # (keys, D, N) -> {"additive": {...}, "delta rule": {...}}
for D in DIMS:
    g = torch.Generator().manual_seed(D)
    for load in LOADS:
        N = max(1, round(load * D))
        M = max(1, PAIRS_PER_POINT // N)
        overwrite["random", D, N] = overwrite_test(random_keys, D, N, M, g)
        if N <= D:
            point = overwrite_test(orthonormal_keys, D, N, M, g)
            overwrite["orthonormal", D, N] = point
print(f"{len(overwrite)} points in {time.perf_counter() - t0:.1f} s")

# %% mystnb={"figure": {"caption": "Overwriting $N$ pairs with new values, additive memory (solid) against the delta rule with $\\beta = 1$ (dashed), random unit keys. Top: error against the new values (crosses and pluses: orthonormal keys). Bottom left: how often the read is closer to the new value than to the old. Bottom right: the coefficients of the new and the old value in the read; the delta rule's coefficient of the new value follows $(1 - e^{-N/D})/(N/D)$.", "name": "fig-deltanet-overwrite"}, "image": {"alt": "Three line plots against the load N over D from 1/8 to 4, one colour per memory size. Top: the additive error rises from about 1 to 3 and the delta rule's from about 0.3 to 1.2, with orthonormal-key markers at 1 and at 0. Bottom left: the additive memory stays at one half while the delta rule starts near 1 and falls to between 0.7 and 0.8 at load 4. Bottom right: the additive coefficients stay near 1, the delta rule's new-value coefficient falls along a black curve to about 0.25 and its old-value coefficient stays at or below about 0.1"}}
colors = dict(zip(DIMS, plt.cm.viridis(torch.linspace(0, 0.85, len(DIMS)).tolist())))
fig, axes = plt.subplot_mosaic([["error", "error"], ["newer", "coefficients"]],
                               figsize=(6.8, 6.8))
ax1, ax2, ax3 = axes["error"], axes["newer"], axes["coefficients"]
for D in DIMS:
    Ns = [N for kind, d, N in overwrite if kind == "random" and d == D]
    load = [N / D for N in Ns]
    for name, style in (("additive", "o-"), ("delta rule", "s--")):
        pts = [overwrite["random", D, N][name] for N in Ns]
        label = f"{name}, D = {D}"
        ax1.plot(load, [p["error"] for p in pts], style, ms=4, color=colors[D],
                 label=label)
        ax2.plot(load, [p["newer"] for p in pts], style, ms=4, color=colors[D],
                 label=label)
        ax3.plot(load, [p["b"] for p in pts], style, ms=4, color=colors[D])
        ax3.plot(load, [p["a"] for p in pts], style, ms=4, color=colors[D], alpha=0.35)
    ortho = [N for kind, d, N in overwrite if kind == "orthonormal" and d == D]
    for name, marker in (("additive", "x"), ("delta rule", "+")):
        ortho_errors = [overwrite["orthonormal", D, N][name]["error"] for N in ortho]
        ax1.plot([N / D for N in ortho], ortho_errors, marker, ms=8, color=colors[D])
r = torch.logspace(math.log10(min(LOADS)), math.log10(max(LOADS)), 100,
                   dtype=torch.float64)
ax3.plot(r, (1 - torch.exp(-r)) / r, "k-", lw=1, label="(1 − e^(−N/D)) / (N/D)")
ax1.set(xscale="log", xlabel="load N/D", ylabel="relative error vs the new values",
        title="Error (x: additive, +: delta; orthonormal keys)")
ax2.set(xscale="log", xlabel="load N/D",
        ylabel="fraction of reads closer\nto the new value", ylim=(0.4, 1.02))
ax2.set_title("Which value comes back", fontsize=11)
ax2.axhline(0.5, color="gray", lw=1, ls=":")
ax3.set(xscale="log", xlabel="load N/D", ylabel="coefficient in the read")
ax3.set_title("How much of each:\nnew (dark), old (light)", fontsize=11)
for ax in (ax1, ax2, ax3):
    ax.set_xticks(LOADS, [f"1/{round(1 / r)}" if r < 1 else str(r) for r in LOADS])
    ax.minorticks_off()
ax1.legend(fontsize=8, ncols=2, loc="upper left")
# between the new-value curves (top) and the old-value ones (bottom)
ax3.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 0.14))
plt.tight_layout()
plt.show()

# %% [markdown]
# The numbers behind the plot for one size, $D = 32$ (or the largest size in a small run):

# %%
D = 32 if 32 in DIMS else DIMS[-1]
print(f"D = {D}, random unit keys      additive                      "
      "delta rule (β = 1)")
print(f"{'N':>5s} {'N/D':>5s}   {'error':>6s} {'newer':>6s} {'a':>5s} {'b':>5s}    "
      f"{'error':>6s} {'newer':>6s} {'a':>5s} {'b':>5s}  {'b predicted':>11s}")
for kind, d, N in overwrite:
    if kind == "random" and d == D:
        add, dr = overwrite[kind, d, N]["additive"], overwrite[kind, d, N]["delta rule"]
        cols = [f"{p['error']:6.3f} {p['newer']:6.3f} {p['a']:5.2f} {p['b']:5.2f}"
                for p in (add, dr)]
        b_predicted = D / N * (1 - (1 - 1 / D) ** N)
        print(f"{N:5d} {N / D:5.2f}   {cols[0]}    {cols[1]}  {b_predicted:11.2f}")
ortho_points = [overwrite[key] for key in overwrite if key[0] == "orthonormal"]
worst = max(p["delta rule"]["error"] for p in ortho_points)
additive_errors = [p["additive"]["error"] for p in ortho_points]
print(f"orthonormal keys, every D and N ≤ D: delta rule's largest error {worst:.1e}; "
      f"additive's errors {min(additive_errors):.3f} to {max(additive_errors):.3f}")

# %% [markdown]
# What the run shows:
#
# - **The additive memory returns a mix.** Its coefficients are $a \approx b \approx 1$ at every
#   load: each key reads the old and the new value in equal parts, so whether the read is closer
#   to the new value is a coin flip (about one half, lower left panel). Its error against the new
#   values is about 1 even with orthonormal keys (last line of the output: there the error *is*
#   the old value), and grows with the crosstalk for random keys.
# - **The delta rule replaces.** With orthonormal keys the new values come back exactly (the
#   `+` marks at zero error). With random keys the old value is nearly gone ($a$ is 0.1 at
#   most in the table) and up to $N = D$ the read is closer to the new value than to the old for
#   95% of the keys or more at $D = 32$.
# - **What it keeps fades with later writes.** The coefficient of the new value follows
#   $(1 - e^{-N/D})/(N/D)$ for every $D$ (last column of the table, and the black curve): the
#   memory forgets in order of age, not all at once, and at $N \gg D$ only the recent pairs
#   survive. That is the overcapacity behaviour Schlag et al. asked for, with one limitation that
#   stays: the error against the new values is not small for random keys even below $N = D$,
#   because one pass of the delta rule is one gradient step per pair, not the least-squares
#   solution of chapter 4. Which pairs to keep is left to the keys and to $\beta_t$, and that is
#   what training is for.

# %% [markdown]
# ## Experiment 2: recall after training (MQAR)
#
# Everything so far used keys we chose. In a model the keys, values, queries and write strengths
# are projections of the residual stream, learned by gradient descent (the *slow* weights). The
# standard probe of whether a model can use its state as a memory is multi-query associative
# recall (MQAR; Arora et al., 2024, *Zoology*), `tinyk3.data.mqar`: a context of $P$ key-value
# token pairs, then the $P$ keys again in random order, and at each of them the model must
# predict the value that followed it in the context. Keys come from the lower half of the
# vocabulary, values from the upper half. We use the form without answers in the input
# (`show_answers=False`), so a model that has learned to answer with *some* value from the
# context but not the right one scores $1/P$. One example with $P = 4$, vocabulary 64:

# %% tags=["nbval-check-output"]
VOCAB = 64
x, y = mqar(1, 4, VOCAB, seed=0, show_answers=False)
print("input: ", " ".join(f"{t:2d}" for t in x[0].tolist()))
print("target:", " ".join(" ·" if t < 0 else f"{t:2d}" for t in y[0].tolist()))

# %% [markdown]
# **The design.** Three models of one family (`tinyk3.models.MixerLM`): 2 layers, width 64,
# 2 heads of size $D = 32$, GPT-2's blocks, the same initialisation, and only the mixer
# different: softmax attention (chapters 1 and 2), linear attention with ELU+1 (chapter 3) and
# DeltaNet (this chapter; the layer runs a prompt through `delta_rule.parallel`). Two settings,
# the same for all three:
#
# - **No position embeddings** (`pos_emb=False`), so a model trained on short sequences can be
#   run on longer ones. We train on a mixture of pair counts, $P$ drawn uniformly from 1 to 8
#   for each batch, and evaluate at $P$ from 1 to 32: up to 8 the question is whether a model
#   learned to recall; beyond, whether its memory holds more pairs than it was trained on.
# - **A short causal convolution** on $q$, $k$ and $v$ (`conv_size=4`: each channel of each
#   projection becomes a learned mix of its own values at the current and the three previous
#   tokens, followed by a SiLU, as in fla's DeltaNet layer and in Kimi Linear; chapter 12 returns
#   to it). A value token must be stored under the key *before* it: with the convolution, $k_t$
#   at a value token can be computed from the previous token and $v_t$ from the current one.
#   Without it, a 2-layer model first has to learn to copy the previous token into each
#   position (an induction circuit) before recall can begin: in calibration runs for this
#   chapter (this design, without the convolution) all three models stayed at chance, $1/P$,
#   for the whole budget.
#
# Training: AdamW at learning rate $10^{-2}$ with `tinyk3.train.train_batches` (its warm-up and
# cosine schedule), batches of 64, the same number of steps and the same data for each model.
# Each run takes well under a minute at full size on one core (the times are printed), DeltaNet
# the longest: its triangular solve costs more than the fused softmax kernel.

# %%
PAIRS_TRAIN = 8  # P ~ U{1, ..., 8} per batch
EVAL_PAIRS = [1, 2, 4, 8] if SMOKE else [1, 2, 4, 8, 12, 16, 24, 32]
MQAR_STEPS = 20 if SMOKE else 800
MQAR_BATCH = 64
N_EVAL = 64 if SMOKE else 256  # held-out examples per pair count
MIXERS = ["softmax", "linear", "deltanet"]


def build(mixer):
    torch.manual_seed(0)
    # the length of a sequence at the largest P
    longest = mqar_seq_len(max(EVAL_PAIRS), show_answers=False)
    config = MixerConfig(vocab_size=VOCAB, block_size=longest, n_layer=2, n_head=2,
                         n_embd=64, mixer=mixer, conv_size=4, pos_emb=False)
    return MixerLM(config)


def batch_fn(g):
    # one pair count per batch
    P = int(torch.randint(1, PAIRS_TRAIN + 1, (1,), generator=g))
    return mqar(MQAR_BATCH, P, VOCAB, generator=g, show_answers=False)


held_out = {P: mqar(N_EVAL, P, VOCAB, seed=1000 + P, show_answers=False)
            for P in EVAL_PAIRS}


def accuracy_at(model, P):
    x, y = held_out[P]
    with torch.no_grad():
        return recall_accuracy(model(x), y)


mqar_runs = {}
for mixer in MIXERS:
    model = build(mixer)
    result = train_batches(model, batch_fn, steps=MQAR_STEPS, lr=1e-2,
                           warmup=min(50, MQAR_STEPS // 10),
                           eval_every=max(1, MQAR_STEPS // 16), progress=False,
                           eval_fn=lambda m: accuracy_at(m, PAIRS_TRAIN))
    mqar_runs[mixer] = dict(model=model, result=result,
                            accuracy={P: accuracy_at(model, P) for P in EVAL_PAIRS})
    print(f"{mixer:8s}: {model.num_parameters():,} parameters, "
          f"{MQAR_STEPS} steps in {result.seconds:.0f} s, "
          f"final training loss {result.train_loss[-1]:.3f}")

# %% [markdown]
# Before reading the results, the check promised above: the trained DeltaNet gives the same
# logits with the token loop in place of the triangular solve (any function with the contract
# can be passed to the layer as `op`).

# %%
model = mqar_runs["deltanet"]["model"]
x, _ = held_out[PAIRS_TRAIN]
with torch.no_grad():
    logits_parallel = model(x[:32])
    for block in model.transformer.h:
        block.attn.op = delta_rule.recurrent  # force the token loop
    logits_loop = model(x[:32])
    for block in model.transformer.h:
        block.attn.op = None  # back to the layer's default: parallel for a prompt
print(f"trained DeltaNet, {x.shape[1]} tokens: "
      f"max |logits(parallel) - logits(token loop)| = "
      f"{max_diff(logits_parallel, logits_loop):.1e} "
      f"(logits up to {logits_loop.abs().max():.0f})")

# %% mystnb={"figure": {"caption": "Multi-query associative recall with softmax attention, linear attention and DeltaNet, 2 layers of width 64, trained on $P \\le 8$ pairs. Top: held-out accuracy at $P = 8$ during training. Bottom: accuracy after training against the number of pairs $P$ in the context (shaded: the trained range; dotted: chance).", "name": "fig-deltanet-mqar"}, "image": {"alt": "Two line plots of recall accuracy. Top, against training step: softmax jumps to 1 by step 200, DeltaNet climbs to nearly 1 by step 800, linear attention rises slowly to about 0.45. Bottom, against pairs P from 1 to 32 on a log axis: softmax stays at 1, DeltaNet stays near 1 up to 8 and falls to about 0.5 at 32, linear attention falls from 1 to about 0.1, all above a dotted chance curve"}}
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.8, 6.4))
for mixer, color in zip(MIXERS, ("C0", "C1", "C2")):
    run = mqar_runs[mixer]
    ax1.plot(run["result"].val_steps, run["result"].val_metric, "o-", ms=3, color=color,
             label=mixer)
    accuracies = [run["accuracy"][P] for P in EVAL_PAIRS]
    ax2.plot(EVAL_PAIRS, accuracies, "o-", color=color, label=mixer)
p = torch.tensor(EVAL_PAIRS, dtype=torch.float64)
ax2.plot(p, 1 / p, "k:", lw=1, label="chance, 1/P")
ax2.axvspan(0.9, PAIRS_TRAIN, color="gray", alpha=0.12, lw=0)
ax2.text(1.05, 0.5, "trained on\nP ≤ 8", fontsize=8, color="gray")
ax1.set(xlabel="training step", ylabel=f"recall accuracy at P = {PAIRS_TRAIN}",
        title="Learning to recall (held-out examples)", ylim=(-0.02, 1.02))
ax2.set(xscale="log", xlabel="key-value pairs P in the context",
        ylabel="recall accuracy", title="Recall against the number of pairs",
        ylim=(-0.02, 1.02))
ax2.set_xticks(EVAL_PAIRS, [str(P) for P in EVAL_PAIRS])
ax2.minorticks_off()
ax1.legend()
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()

print(f"{'mixer':>8s} {'steps':>6s} {'time':>6s}  "
      + " ".join(f"{'P=' + str(P):>6s}" for P in EVAL_PAIRS))
for mixer in MIXERS:
    run = mqar_runs[mixer]
    print(f"{mixer:>8s} {MQAR_STEPS:6d} {run['result'].seconds:5.0f}s  "
          + " ".join(f"{run['accuracy'][P]:6.3f}" for P in EVAL_PAIRS))
print(f"{'chance':>8s} {'':>6s} {'':>6s}  "
      + " ".join(f"{1 / P:6.3f}" for P in EVAL_PAIRS))

# what each layer keeps after reading one example
for P in sorted({PAIRS_TRAIN, max(EVAL_PAIRS)}):
    x, _ = held_out[P]
    sizes = []
    for mixer in MIXERS:
        model, cache = mqar_runs[mixer]["model"], mqar_runs[mixer]["model"].new_cache()
        with torch.no_grad():
            model(x[:1], cache=cache)
        sizes.append(f"{mixer} {cache.nbytes() / cache.n_layer / 1024:.2f} KiB")
    print(f"state per layer after P = {P:2d} pairs ({x.shape[1]} tokens): "
          + ", ".join(sizes))

# %% [markdown]
# What the run shows (single runs, one seed each):
#
# - **Softmax attention recalls everything.** It learns first (top panel) and is perfect at
#   every pair count, up to four times more pairs than it was trained on. Its state is the KV
#   cache, which grows with the context: about 50 KiB per layer at 32 pairs against about
#   10 KiB for the fixed states (last lines of the output, convolution state included).
# - **DeltaNet learns the trained range and loses pairs beyond it.** It is close to perfect up
#   to 8 pairs, then declines steadily; at 32 pairs it recalls about half of them.
# - **Linear attention had not finished learning** when the budget ended: its training loss is
#   still high and its accuracy at 8 pairs still rising (top panel). It is the lowest at every
#   pair count above 1, though above chance.
#
# **Which pairs are lost.** At the largest pair count, the accuracy of each model by the age of
# the queried pair: how many pairs were written into the context after it (0 for the last pair).
# If the delta rule's erasure is at work, as in experiment 1, the old pairs go first.

# %% mystnb={"figure": {"caption": "Recall accuracy at $P = 32$ pairs by the age of the queried pair (how many pairs the context wrote after it). DeltaNet recalls the newest pairs best and the oldest worst; softmax and linear attention do not depend on age.", "name": "fig-deltanet-recall-by-age"}, "image": {"alt": "Line plot of recall accuracy against the age of the queried pair, pooled in groups of four ages from 0 to 31: softmax flat at 1, DeltaNet falling from about 0.8 for the newest pairs to under 0.3 for the oldest, linear attention flat near 0.1"}}
P = max(EVAL_PAIRS)
x, y = held_out[P]
context_keys, queries = x[:, 0 : 2 * P : 2], x[:, 2 * P :]  # [N, P] each
# the index of the pair each query asks for
index = (queries[:, :, None] == context_keys[:, None, :]).int().argmax(dim=-1)
age = P - 1 - index  # pairs written after the queried one  [N, P]
group = max(1, P // 8)  # ages pooled in groups
fig, ax = plt.subplots(figsize=(6.8, 3.6))
for mixer, color in zip(MIXERS, ("C0", "C1", "C2")):
    with torch.no_grad():
        prediction = mqar_runs[mixer]["model"](x).argmax(-1)  # [N, T]
    hit = (prediction[:, 2 * P :] == y[:, 2 * P :]).double()  # [N, P]
    ages = age.flatten()
    hits = torch.zeros(P, dtype=torch.float64).index_add_(0, ages, hit.flatten())
    by_age = hits / torch.bincount(ages, minlength=P).double()  # accuracy at each age
    pooled = by_age.view(-1, group).mean(-1)  # [P / group]
    centres = torch.arange(len(pooled)) * group + (group - 1) / 2  # mean age of a group
    ax.plot(centres, pooled, "o-", color=color, label=mixer)
    print(f"{mixer:8s} accuracy by age at P = {P} (newest first, groups of {group}): "
          + " ".join(f"{a:.2f}" for a in pooled.tolist()))
ax.set(xlabel="age of the queried pair (pairs written after it)",
       ylabel="recall accuracy", title=f"Recall by age, P = {P} pairs",
       ylim=(-0.02, 1.02))
ax.legend(loc="center right")
plt.show()

# %% [markdown]
# **How hard the trained DeltaNet writes.** Its write strengths $\beta_t$ on the same examples,
# in both layers, averaged by the kind of token: key tokens and queries bring no new pair to
# store, while each value token completes one.

# %%
model, P = mqar_runs["deltanet"]["model"], max(EVAL_PAIRS)
x, _ = held_out[P]
betas = []


def keep_beta(module, inputs, output):
    """Forward hook on W_β: keep β_t = sigmoid(W_β x_t)  [B, T, H]."""
    betas.append(output.sigmoid())


hooks = [block.attn.b_proj.register_forward_hook(keep_beta)
         for block in model.transformer.h]
with torch.no_grad():
    model(x)
for h in hooks:
    h.remove()
for layer, beta_ in enumerate(betas, start=1):
    b = beta_.mean(dim=(0, 2))  # averaged over examples and heads  [T]
    print(f"layer {layer}: mean β at key tokens {b[0 : 2 * P : 2].mean():.2f}, "
          f"value tokens {b[1 : 2 * P : 2].mean():.2f}, "
          f"queries {b[2 * P :].mean():.2f}")

# %% [markdown]
# Putting these together:
#
# - **DeltaNet forgets in order of age**, as the delta-rule memory of experiment 1 did: at 32
#   pairs the newest pairs are recalled most often and the oldest least (the age plot and its
#   printed line), while the other two models' accuracies are about the same at every age.
# - **It writes at every token.** Its first layer has learned where the pairs are ($\beta_t$ is
#   larger at the value tokens than at the key tokens and queries) but has not learned to switch
#   the other writes off, and its second layer writes very little anywhere (printed above).
#   Every write erases a little of the state along its key, so a pair early in a context of
#   $2P$ tokens pays for all the writes after it. Within the trained range the loss is small; at
#   32 pairs it is not.
# - **MQAR never asks for an overwrite.** All keys of a sequence are distinct, so the one thing
#   the delta rule is built for, replacing a stored value, is never needed here, and beyond the
#   trained range what shows is its price: forgetting.
# - **Linear attention's slow start** has a likely reason in chapter 4: its features are
#   positive, so all keys share a large common part. Here the features are ELU+1 of the
#   convolution's SiLU output, and each coordinate is at least (next cell):

# %%
grid = torch.linspace(-10, 10, 200_001, dtype=torch.float64)
floor = F.elu(F.silu(grid)).add(1).min()
print(f"smallest ELU+1 feature of a SiLU output: {floor:.3f} "
      f"(= exp(min SiLU) = exp({F.silu(grid).min():.4f}))")

# %% [markdown]
# No key can have a coordinate near zero, so the model must learn to make the coordinates that
# tell keys apart large against that floor. In calibration runs for this chapter with a
# convolution initialised as the identity and without the SiLU, linear attention learned faster
# than DeltaNet and lost fewer pairs beyond the trained range: at this scale the order of the
# two fixed-state models depends on such details, so read it as a property of these small
# models and this budget, not of the mechanisms. The softmax model's lead, and DeltaNet's
# forgetting of the oldest pairs first, were the same in those runs.
#
# Yang et al. (2024) note that the delta rule has been found more effective than the additive
# update at associative recall, for models far larger and trained far longer than these; two
# minutes of CPU cannot check that. What this experiment does show is the trade every
# fixed-size state makes: something must be dropped, and the delta rule drops the oldest first.
# Chapter 10 adds a learned decay that makes forgetting a decision of the model, and chapter 15
# keeps a few softmax-attention layers next to the linear ones for the recall a fixed state
# cannot hold.

# %% [markdown]
# (erratum-deltanet-prefill)=
# ## Erratum: a DeltaNet prefill that reads the state once
#
# The post's DeltaNet layer (its "DeltaNet (Fast weight programmers)" section) computes, for all
# the new tokens of a call at once, $V^{\text{old}} = K S$ with the state $S$ from before the call,
# $U = \beta \odot (V - V^{\text{old}})$, one write $S \leftarrow S + K^\top U$, and then every
# output $Q S$. For decoding, one token per call, this is exactly the recurrence. For a prefill of
# $T > 1$ tokens it has two faults:
#
# - every token's correction is computed against the state from *before the block*: token $t$
#   does not see what tokens $1, \dots, t-1$ of the same block wrote, so a key written twice in
#   the prompt is written twice *additively*. Unlike chapter 3's erratum, the final state is
#   wrong too, and decoding after the prefill inherits the error;
# - every token reads the state *after the block*, $o_t = q_t S_T$: the outputs are not causal
#   (the same fault as chapter 3's linear-attention prefill).
#
# (As printed it also starts from `S = 0.0`, a Python float, when there is no cache, and
# `k @ 0.0` raises a `TypeError`; a zero tensor is clearly what is meant.) Our own minimal
# version of that logic, against the recurrence:

# %%
def deltanet_block_update(q, k, v, beta, S):
    """The post's logic, for a whole block at once.

    One read of S, one write, then every read.
    """
    v_old = k @ S  # every token reads the state from before the block  [B, H, T, Dv]
    u = beta.unsqueeze(-1) * (v - v_old)  # [B, H, T, Dv]
    S = S + k.transpose(-1, -2) @ u  # one write for the whole block  [B, H, Dk, Dv]
    return q @ S, S  # every token reads the state after the block


torch.manual_seed(5)
B, H, T, D = 1, 2, 12, 8
q, k = (F.normalize(torch.randn(B, H, T, D, dtype=torch.float64), dim=-1)
        for _ in range(2))
v = torch.randn(B, H, T, D, dtype=torch.float64)
beta = torch.rand(B, H, T, dtype=torch.float64)
o_ref, S_ref = delta_rule.recurrent(q, k, v, beta)

try:
    deltanet_block_update(q, k, v, beta, 0.0)  # as printed, without a cache
except TypeError as e:
    print(f"with S = 0.0: TypeError: {e}")

S, outs = torch.zeros(B, H, D, D, dtype=torch.float64), []
for t in range(T):  # decoding: one token per call
    o_t, S = deltanet_block_update(q[:, :, t : t + 1], k[:, :, t : t + 1],
                                   v[:, :, t : t + 1], beta[:, :, t : t + 1], S)
    outs.append(o_t)
print(f"one token per call: max error vs the recurrence: "
      f"outputs {max_diff(torch.cat(outs, 2), o_ref):.1e}, "
      f"final state {max_diff(S, S_ref):.1e}")

zeros = torch.zeros(B, H, D, D, dtype=torch.float64)
o_block, S_block = deltanet_block_update(q, k, v, beta, zeros)  # a prefill of T tokens
per_position = (o_block - o_ref).abs().amax(dim=(0, 1, 3))  # [T]
print(f"prefill of {T} tokens: max error at each position: "
      + " ".join(f"{e:.2f}" for e in per_position.tolist()))
print(f"prefill of {T} tokens: final state error {max_diff(S_block, S_ref):.2f} "
      f"(the state itself is {S_ref.abs().max():.2f} at most)")

# %% [markdown]
# One token per call agrees with the recurrence (distance zero here); a block of 12 is wrong at every
# position, the last one included, because the state it hands on is wrong. The two faults can
# be told apart. The first one is exactly the triangular system of the parallel form with its
# strictly lower part dropped: the post solves $U = \operatorname{diag}(\beta)(V - K S_0)$, where
# the recurrence needs $\big(I + \operatorname{diag}(\beta)\operatorname{tril}(K K^\top, -1)\big)U =
# \operatorname{diag}(\beta)(V - K S_0)$. The dropped part is $\beta_t (k_t\cdot k_j)$ for $j < t$,
# so with keys orthogonal to each other inside the block, the corrections and the final state are
# right, and only the non-causal read remains:

# %%
# T ≤ D orthonormal keys
k_orth = memory.orthonormal_keys(T, 16, generator=torch.Generator().manual_seed(6),
                                 dtype=torch.float64).expand(B, H, T, 16)
q16 = F.normalize(torch.randn(B, H, T, 16, dtype=torch.float64), dim=-1)
zeros16 = torch.zeros(B, H, 16, D, dtype=torch.float64)
o_ref16, S_ref16 = delta_rule.recurrent(q16, k_orth, v, beta)
o_blk16, S_blk16 = deltanet_block_update(q16, k_orth, v, beta, zeros16)
overlaps = (k_orth @ k_orth.mT).tril(-1).abs().max()
print(f"orthonormal keys in the block: max |tril(K Kᵀ, -1)| = {overlaps:.1e}; "
      f"final state error {max_diff(S_blk16, S_ref16):.1e}; "
      f"output error {max_diff(o_blk16, o_ref16):.2f} "
      f"(last position {max_diff(o_blk16[:, :, -1], o_ref16[:, :, -1]):.1e})")

# %% [markdown]
# **The fix.** Run a prefill as the recurrence, token by token (`delta_rule.recurrent`), or as
# the same recurrence solved for the whole block (`delta_rule.parallel`, or chapter 8's chunked
# form for long prompts), continuing from the cached state in both cases. Prefilling the first 8
# tokens and then the remaining 4 as a second block, from the first block's state:

# %%
for name, op in (("recurrent", delta_rule.recurrent),
                 ("parallel", delta_rule.parallel)):
    o_1, S_1 = op(q[:, :, :8], k[:, :, :8], v[:, :, :8], beta[:, :, :8])
    o_2, S_2 = op(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], beta[:, :, 8:],
                  initial_state=S_1)
    print(f"{name:9s} in two blocks: max error vs one pass: outputs "
          f"{max_diff(torch.cat([o_1, o_2], dim=2), o_ref):.1e}, "
          f"final state {max_diff(S_2, S_ref):.1e}")

# %% [markdown]
# This erratum is listed on the [errata page](../book/errata.md). The layer `tinyk3.layers.DeltaNet`
# does it the fixed way: a prompt goes through `delta_rule.parallel` from the cached state, and
# a single decoded token through one step of `delta_rule.recurrent`.

# %% [markdown]
# ## Exercises
#
# ```{exercise} One delta-rule step
# :label: ex-delta-step
#
# Write `delta_step(S, k, v, beta)`: one token's write into a batch of states. `S` is
# `[B, H, Dk, Dv]`, `k` is `[B, H, Dk]`, `v` is `[B, H, Dv]`, `beta` is `[B, H]`; return the new
# state $S + k^\top \beta\,(v - k S)$, `[B, H, Dk, Dv]`, in the inputs' dtype. Use `k` as given
# (do not normalise it).
# ```

# %%
def delta_step_mine(S, k, v, beta):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("delta_rule.step", delta_step_mine)

# %% [markdown]
# ```{solution-start} ex-delta-step
# :class: dropdown
# ```

# %%
def delta_step_solution(S, k, v, beta):
    # k S: what S holds at k   [B, H, Dv]
    v_old = torch.einsum("bhk,bhkv->bhv", k, S)
    # β (v − k S)   [B, H, Dv]
    u = beta.unsqueeze(-1) * (v - v_old)
    # S + kᵀ u, an outer product   [B, H, Dk, Dv]
    return S + k.unsqueeze(-1) * u.unsqueeze(-2)


ok = checks.run("delta_rule.step", delta_step_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} A block of tokens after a cached state
# :label: ex-delta-loop
#
# Write `delta_rule_loop(q, k, v, beta, initial_state)`: the delta rule over a block of $T$
# tokens that continues from a cached state. `q`, `k` are `[B, H, T, Dk]`, `v` is
# `[B, H, T, Dv]`, `beta` is `[B, H, T]`, `initial_state` is `[B, H, Dk, Dv]`. Return
# `(o, S_T)`: the outputs $o_t = q_t S_t$, `[B, H, T, Dv]`, and the state after the last token.
# The cases include a single token, where the post's block update is right, and blocks, where
# it is not.
# ```

# %%
def delta_rule_loop_mine(q, k, v, beta, initial_state):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("delta_rule.loop", delta_rule_loop_mine)

# %% [markdown]
# ```{solution-start} ex-delta-loop
# :class: dropdown
# ```

# %%
def delta_rule_loop_solution(q, k, v, beta, initial_state):
    S, outs = initial_state, []
    for t in range(q.shape[2]):
        # S_t from S_{t-1}
        S = delta_step_solution(S, k[:, :, t], v[:, :, t], beta[:, :, t])
        # o_t = q_t S_t  [B, H, Dv]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(outs, dim=2), S


ok = checks.run("delta_rule.loop", delta_rule_loop_solution)

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - The delta rule reads before it writes: $v^{\text{old}}_t = k_t S_{t-1}$, then
#   $S_t = S_{t-1} + k_t^\top \beta_t (v_t - v^{\text{old}}_t) = (I - \beta_t k_t^\top k_t) S_{t-1} +
#   \beta_t k_t^\top v_t$, and $o_t = q_t S_t$. Papers write the transpose,
#   $S_t = S_{t-1}(I - \beta_t k_t k_t^\top) + \beta_t v_t k_t^\top$.
# - Each write is one gradient-descent step on $\tfrac12\|k_t S - v_t\|^2$ with learning rate
#   $\beta_t$: the state is a fast weight matrix trained online, one step per token, by the
#   slow weights that produce $k_t, v_t, \beta_t$.
# - The write's transition $I - \beta_t k_t^\top k_t$ has eigenvalues 1 ($D_k - 1$ times) and
#   $1 - \beta_t\|k_t\|^2$. With unit keys and $\beta_t \in (0, 1)$ every write is non-expansive;
#   without normalisation, $\|k_t\|^2 > 2/\beta_t$ makes the state grow geometrically, as measured.
# - Overwriting: the additive memory returns old and new values in equal parts; the delta rule
#   replaces them (exactly, for orthonormal keys), and with random keys forgets the oldest pairs
#   first, keeping $\approx (1 - e^{-N/D})/(N/D)$ of each value on average.
# - On MQAR at this scale (2 layers, width 64, under a minute of CPU per model), softmax
#   attention, whose cache grows, recalls every pair; DeltaNet recalls the trained pair counts
#   and beyond them forgets the oldest pairs first, because it writes at every token and MQAR
#   never needs a value replaced; linear attention had not finished learning. The order of the
#   two fixed-state models is fragile at this scale.
# - The post's DeltaNet listing reads the state once for a whole block: exact for one token per
#   call, wrong for a prefill (final state included). A token loop or the triangular-solve form
#   fixes it.
#
# **Next.** The delta rule is inherently sequential as written: each token's correction depends
# on the state left by the one before. `delta_rule.parallel` removed the Python loop by solving
# for all the corrections of a sequence at once, at a cost that grows as $T^3$. Part III makes
# the delta rule fast on long sequences and on GPUs: chapter 6 splits a sequence into chunks
# for linear attention, chapter 7 finds the compact (WY) form of a product of delta-rule
# transitions and the triangular solve (the UT transform) that computes it, and chapter 8 puts
# them together as chunkwise DeltaNet. The parallel form used here is its one-chunk case.
#
# **References.** B. Widrow, M. E. Hoff, "Adaptive switching circuits", IRE WESCON Convention
# Record, 1960. J. Schmidhuber, "Learning to control fast-weight memories: an alternative to
# dynamic recurrent networks", *Neural Computation* 4, 1992. I. Schlag, K. Irie, J. Schmidhuber,
# "Linear Transformers Are Secretly Fast Weight Programmers", ICML 2021. S. Yang, B. Wang,
# Y. Zhang, Y. Shen, Y. Kim, "Parallelizing Linear Transformers with the Delta Rule over Sequence
# Length", NeurIPS 2024. S. Arora et al., "Zoology: Measuring and Improving Recall in Efficient
# Language Models", ICLR 2024.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
