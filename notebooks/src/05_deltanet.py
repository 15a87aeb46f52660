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
# Chapter 4 ended on the two blind spots of linear attention's memory: the additive write
# $S \mathrel{+}= k^\top v$ can neither overwrite nor forget. A new value written under a stored
# key adds to the old one, and every pair stays in the sum for good. DeltaNet changes one line:
# before it writes, a token *reads* what the state holds at its key and writes back only the
# difference between its value and that one, scaled by a learned write strength $\beta_t$. That
# is Widrow and Hoff's delta rule, applied to a matrix of *fast weights* that the network
# programs as it reads.
#
# **In this chapter** you build the delta rule as a token loop and check it against `tinyk3`'s
# loop and one-block triangular solve; show that each write is a gradient step; find the
# eigenvalues of a write and why keys are normalised; overwrite a memory with both rules;
# train three mixers on associative recall; and fix the post's DeltaNet prefill.
#
# **Cost.** A couple of minutes on one CPU core, almost all of it in the training experiment
# (the last cell prints the time); `SMOKE = True` runs in seconds.

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
from tinyk3.bench import stamp
from tinyk3.data import MQARHeldOut, mqar, mqar_sampler, mqar_seq_len
from tinyk3.models import MixerConfig, MixerLM
from tinyk3.ops import delta_rule, feature_maps
from tinyk3.timing import time_fn
from tinyk3.train import train_batches
from tinyk3.util import max_diff

DIMS = [8, 16] if SMOKE else [16, 32, 64]  # memory sizes D in the overwrite experiment
LOADS = [0.125, 0.25, 0.5, 1, 2, 4] if not SMOKE else [0.25, 1, 4]  # N/D
PAIRS_PER_POINT = 256 if SMOKE else 2048  # stored pairs averaged over per point
NORM_STEPS = 60 if SMOKE else 300  # writes in the stability experiment
TIMING_REPEATS = 2 if SMOKE else 5

# %% [markdown]
# ## The problem: a memory that can only add
#
# Store four pairs in an additive memory with orthonormal keys (no crosstalk, chapter 4), then
# four *new* values under the same keys, and read the keys:

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
# Each key returns the sum of everything written under it: $S \mathrel{+}= k^\top v$ can only
# add. Schlag, Irie and Schmidhuber (2021) put the consequence plainly: once a sequence holds
# more associations than the state can store, an additive memory keeps piling them up, where
# it should decide which to keep and which to replace.

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
# $\beta_t$ of the way to the new one, and with $\beta_t = 1$ it *is* the new one. In the second
# form the transition $F_t = I - \beta_t k_t^\top k_t$ shrinks the state along $k_t$ only
# (erase), and $\beta_t k_t^\top v_t$ is chapter 3's write.
#
# This is the *delta rule* of Widrow and Hoff (1960), the least-mean-squares update of a linear
# map, applied to a matrix that changes at every token. A network whose outputs program such a
# matrix is Schmidhuber's (1992) *fast weight programmer*: the slow weights (the projections to
# $q, k, v, \beta$), trained by gradient descent, write the fast weights $S$ as the sequence is
# read. Schlag et al. (2021) showed linear attention to be the additive special case and put
# the delta rule in its place (DeltaNet); Yang et al. (2024) parallelised it over the sequence.
# In their layer:
#
# - $q_t$ and $k_t$ are projections of $x_t$ passed through SiLU and **L2-normalised** per head
#   (a section below shows why);
# - $\beta_t = \operatorname{sigmoid}(w_\beta \cdot x_t)$ per head and token: the network
#   decides how hard each token writes;
# - there is no normaliser $q_t \cdot z_t$ as in chapter 3: $o_t = q_t S_t$.
#
# **The papers' layout.** Yang et al. write column vectors and $S \in
# \mathbb{R}^{D_v \times D_k}$: $S_t = S_{t-1}\big(I - \beta_t k_t k_t^\top\big) + \beta_t v_t
# k_t^\top$, $o_t = S_t q_t$. Their $S$ is our $S^\top$
# ([notation page](../book/notation.md)); a check below computes both.

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
# The overwrite from above as eight tokens (the four old pairs, then the four new values),
# with $\beta = 1$, reading each key at the end:

# %%
seq_k = torch.cat([keys, keys])[None, None]  # [1, 1, 8, D]
seq_v = torch.cat([v_old, v_new])[None, None]  # [1, 1, 8, D]
ones = torch.ones(1, 1, 8, dtype=torch.float64)  # β_t = 1
_, S = delta_rule_loop(seq_k, seq_k, seq_v, ones)
reads = memory.read(S[0, 0], keys)
print(f"delta rule: max |read - v_new| = {max_diff(reads, v_new):.1e}")

# %% [markdown]
# Every key now returns its new value and nothing of the old one. The loop against
# `tinyk3.ops.delta_rule.recurrent`, for random unit keys and queries and random write
# strengths, in both precisions:

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
# Identical in both precisions: the lib's loop does the same operations in the same order,
# with `einsum` for `@`. From now on the chapter uses it:

# %%
tinyk3.notebook.show_source(delta_rule.recurrent)

# %% [markdown]
# ### The same contract, solved as one triangular system
#
# The loop is slow to train: one Python step per token, each recorded by autograd.
# `tinyk3.ops.delta_rule.parallel` has the same contract and no loop over tokens. Unrolled,
# $S_{t-1} = S_0 + \sum_{j<t} k_j^\top u_j$, so the corrections
# $u_t = \beta_t (v_t - k_t S_{t-1})$ satisfy
#
# $$
# \begin{gathered}
# u_t + \beta_t \sum_{j<t} (k_t \cdot k_j)\, u_j = \beta_t \big(v_t - k_t S_0\big) \\
# \Longleftrightarrow\; \big(I + \operatorname{diag}(\beta)\,\operatorname{tril}(K K^\top, -1)\big)\, U = \operatorname{diag}(\beta)\,(V - K S_0),
# \end{gathered}
# $$
#
# a unit lower-triangular system, solved in one call. Then
# $O = Q S_0 + (Q K^\top \odot M)\, U$ ($M$ the causal mask with its diagonal, chapter 3)
# and $S_T = S_0 + K^\top U$. Forming $K K^\top$ and $Q K^\top$ costs $O(T^2 D)$, and so does
# the triangular solve: substitution with $D_v$ right-hand sides, no $T^3$ inverse. That is
# fine for this chapter's short sequences; chapters 7 and 8 make it the inside of a chunk.
# The check, and a training step (forward and backward) of both forms, two heads over 64
# tokens, median of several runs (`tinyk3.timing`; quartiles in brackets):

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


def fwd_bwd_time(op, B=32, H=2, T=64, D=32):
    q, k = (F.normalize(torch.randn(B, H, T, D), dim=-1).requires_grad_()
            for _ in range(2))
    v = torch.randn(B, H, T, D, requires_grad=True)
    beta = torch.rand(B, H, T, requires_grad=True)
    return time_fn(lambda: op(q, k, v, beta)[0].sum().backward(),
                   repeats=TIMING_REPEATS)


t_rec, t_par = fwd_bwd_time(delta_rule.recurrent), fwd_bwd_time(delta_rule.parallel)
print(f"forward + backward, B=32, H=2, T=64, D=32: "
      f"recurrent {t_rec.ms(0)} ms, parallel {t_par.ms(0)} ms: "
      f"{t_rec / t_par:.0f}x faster")
print(stamp())

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
# the delta rule, for any key. DeltaNet's state is trained *online*, one gradient step per
# token, on a regression from keys to values. Linear attention's write $k_t^\top v_t$ is the
# same step for the loss $-k_t S v_t^\top$, which has no minimum. Autograd agrees, for a unit
# key and for a key of length 3:

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
# The ratio in the last column is the point of this section. Along $k_t$ the residual after
# the step is $k_t S_t - v_t = (1 - \beta_t \|k_t\|^2)(k_t S_{t-1} - v_t)$. With a unit key the
# step moves a fraction $\beta_t$ of the way to the target and lands on it at $\beta_t = 1$:
# the learning rate is the write strength. With $\|k_t\| = 3$ the same $\beta_t$ overshoots,
# and the residual flips sign and grows (last two lines).

# %% [markdown]
# ## The eigenvalues of a write, and why keys are normalised
#
# Without the write term, a step maps $S \mapsto F_t S$ with $F_t = I - \beta_t k_t^\top k_t$, a
# symmetric $D_k \times D_k$ matrix. Any vector $x$ orthogonal to $k_t$ has $x F_t = x$, and
# $k_t F_t = k_t - \beta_t \|k_t\|^2 k_t$, so its eigenvalues are
#
# $$
# \underbrace{1, \dots, 1}_{D_k - 1 \text{ times}}, \qquad 1 - \beta_t \|k_t\|^2 \ \ \text{(along } k_t\text{)}.
# $$
#
# The state is untouched in every direction but $k_t$'s, and along $k_t$ multiplied by
# $1 - \beta_t\|k_t\|^2$. Numerically, for a unit key and an unnormalised Gaussian key,
# $D_k = 16$, $\beta = 0.5$:

# %%
D, b = 16, 0.5
g = torch.Generator().manual_seed(3)
raw_key = torch.randn(D, generator=g, dtype=torch.float64)
unit_key = F.normalize(raw_key, dim=0)
for name, k_t in (("unit key", unit_key), ("raw Gaussian key", raw_key)):
    F_t = torch.eye(D, dtype=torch.float64) - b * torch.outer(k_t, k_t)  # I − β kᵀk
    eig = torch.linalg.eigvals(F_t)
    ones_ = (eig - 1).abs() < 1e-10
    other = eig[~ones_].real
    print(f"{name:17s} ‖k‖² = {k_t.dot(k_t):6.2f}: "
          f"{int(ones_.sum())} eigenvalues equal to 1 "
          f"(max imaginary part {eig.imag.abs().max():.0e}); "
          f"the other: {other.item():+.4f}, 1 − β‖k‖² = {1 - b * k_t.dot(k_t):+.4f}")

# %% [markdown]
# With $\|k_t\| = 1$ and $\beta_t \in [0, 1]$ the special eigenvalue lies in $[0, 1]$: every write
# is non-expansive, $\|x F_t\| \le \|x\|$, and $\beta_t = 1$ makes $F_t$ the orthogonal projection
# that removes the $k_t$ component. Without normalisation nothing bounds $\beta_t\|k_t\|^2$, and
# once $\|k_t\|^2 > 2/\beta_t$ the factor $|1 - \beta_t\|k_t\|^2|$ exceeds 1: every write
# *amplifies* what the state holds along its key. A random unit direction carries on average
# $1/D$ of the state's squared norm, so for keys of one length and random directions the squared
# norm grows in expectation by $1 + \big((1-\beta\|k\|^2)^2 - 1\big)/D$ per write:
# geometrically.
#
# The experiment: $D = 16$, $\beta = 0.5$, Gaussian values, random key directions, key lengths
# with $\beta\|k\|^2 = 0.5$ (unit keys), $1.9$, $2.5$ and $3$, and raw Gaussian keys
# ($\beta\|k\|^2 \approx \beta D = 8$).

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
when = f"at write {int(too_big.nonzero()[0]) + 1}" if too_big.any() else "never"
print(f"raw Gaussian keys: ‖S‖ passes float32's largest number ({float32_max:.1e}): "
      f"{when}")

# %% [markdown]
# Both stable settings level off where erasing balances writing: measured growth close to 1
# over the second half of the run (a predicted factor below 1 only says how fast the *initial*
# state is forgotten). The unstable ones grow geometrically, close to the predicted rate once
# the state is large, and raw Gaussian keys grow fastest (last line): in a model, infinities
# and then NaNs. This is why DeltaNet normalises $k$ (and $q$, so that $q_t S_t$ has the scale
# of the stored values), and why $\beta_t$ is a sigmoid.

# %% [markdown]
# ## Experiment 1: overwriting a memory
#
# The opening's test at scale, without training: in a memory of size $D$ write $N$ pairs
# $(k_i, v^{\text{old}}_i)$, then each key again with a new value $v^{\text{new}}_i$, and read
# every key; once additively (`memory.write`) and once with the delta rule at $\beta = 1$
# (`delta_rule.parallel`'s final state). Keys are unit vectors: random for every $N$,
# orthonormal where $N \le D$. Three measurements per point, averaged over many pairs (the
# count is printed):
#
# - the **relative error against the new values**, $\sqrt{\sum_i \|k_i S - v^{\text{new}}_i\|^2 / \sum_i
#   \|v^{\text{new}}_i\|^2}$;
# - **which value comes back**: the fraction of keys whose read is closer (by cosine) to the new
#   value than to the old one; one half is a coin flip;
# - **how much of each**: the least-squares coefficients $a, b$ in
#   $k_i S \approx a\, v^{\text{old}}_i + b\, v^{\text{new}}_i + \text{noise}$; for independent
#   values $b = \sum_i \langle k_i S, v^{\text{new}}_i\rangle / \sum_i \|v^{\text{new}}_i\|^2$,
#   and likewise $a$.
#
# What to expect. The additive memory holds $\sum_i k_i^\top (v^{\text{old}}_i + v^{\text{new}}_i)$,
# so $a = b = 1$ plus chapter 4's crosstalk. The delta rule with orthonormal keys replaces each
# value exactly. With random keys each later write at $k_j$ also erases a fraction
# $(k_i\cdot k_j)^2$, on average $1/D$, of key $i$'s new value, so a value followed by $m$
# writes keeps about $(1 - 1/D)^m$ of itself: the oldest go first. Averaged over the $N$
# rewritten keys ($m = 0, \dots, N-1$):
#
# $$
# b \approx \frac{1}{N}\sum_{m=0}^{N-1}\Big(1 - \frac1D\Big)^m = \frac{D}{N}\Big(1 - \big(1 - \tfrac1D\big)^N\Big)
# \approx \frac{1 - e^{-N/D}}{N/D} .
# $$

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
    return memory.random_unit_keys(N, D, batch=M, generator=g, dtype=torch.float64)


def orthonormal_keys(M, N, D, g):
    return memory.orthonormal_keys(N, D, batch=M, generator=g, dtype=torch.float64)


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
print(f"{len(overwrite)} points of about {PAIRS_PER_POINT} pairs each, "
      f"in {time.perf_counter() - t0:.1f} s")

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
# The numbers behind the plot for $D = 32$ (the largest size under `SMOKE`):

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
# - **The additive memory returns a mix.** $a \approx b \approx 1$ at every load: each key reads
#   the old and the new value in equal parts, and which is closer is a coin flip (lower left).
#   Its error is about 1 even with orthonormal keys (last line: there the error *is* the old
#   value), and grows with the crosstalk for random keys.
# - **The delta rule replaces.** With orthonormal keys the new values come back exactly (the
#   `+` marks at zero). With random keys the old value is nearly gone (column $a$) and up to
#   $N = D$ nearly every read is closer to the new value (column "newer").
# - **What it keeps fades with later writes.** The coefficient of the new value follows
#   $(1 - e^{-N/D})/(N/D)$ for every $D$ (last column, black curve): the memory forgets in order
#   of age, and at $N \gg D$ only recent pairs survive: the overcapacity behaviour Schlag et
#   al. asked for. The error stays well above zero for random keys even below $N = D$: one
#   pass of the delta rule is one gradient step per pair, not chapter 4's least-squares
#   solution.

# %% [markdown]
# ## Experiment 2: recall after training (MQAR)
#
# So far we chose the keys. In a model, keys, values, queries and write strengths are learned
# projections of the residual stream. The standard probe of whether a model can use its state
# as a memory is multi-query associative recall (MQAR; Arora et al., 2024), `tinyk3.data.mqar`:
# a context of $P$ key-value token pairs, then the $P$ keys again in random order, and at each
# query the model must predict the value that followed that key. Keys come from the lower
# half of the vocabulary, values from the upper half, distinct within an example, and the
# answers are not shown in the input (`show_answers=False`). One example, $P = 4$,
# vocabulary 64:

# %% tags=["nbval-check-output"]
VOCAB = 64
x, y = mqar(1, 4, VOCAB, seed=0, show_answers=False)
print("input: ", " ".join(f"{t:2d}" for t in x[0].tolist()))
print("target:", " ".join(" ·" if t < 0 else f"{t:2d}" for t in y[0].tolist()))

# %% [markdown]
# **The design.** Three models of one family (`tinyk3.models.MixerLM`): 2 layers,
# $d_{\text{model}} = 64$, 2 heads of size $D = 32$, GPT-2's blocks, the same initialisation,
# and only the mixer different: softmax attention (chapters 1 and 2), linear attention with
# ELU+1 (chapter 3) and DeltaNet (this chapter; a prompt runs through `delta_rule.parallel`).
# The same two settings for all three:
#
# - **No position embeddings** (`pos_emb=False`), so a model trained on short sequences runs
#   on longer ones. Each batch has $P$ drawn uniformly from 1 to 8; evaluation goes to
#   $P = 32$: up to 8 it asks whether a model learned to recall, beyond whether its memory
#   holds more pairs than it was trained on.
# - **A short causal convolution** on $q$, $k$ and $v$ (`conv_size=4`): each channel becomes a
#   learned mix of its values at the current and three previous tokens, then a SiLU, as in
#   fla's DeltaNet layer and Kimi Linear (chapter 12). A value must be stored under the key
#   *before* it, and with the convolution $k_t$ at a value token can be computed from the
#   previous token; without it a 2-layer model would first have to learn to copy the previous
#   token into each position (an induction circuit).
#
# Training: AdamW at learning rate $10^{-2}$ with `tinyk3.train.train_batches` (warm-up, cosine
# schedule), batches of 64, the same steps and data for each model. Seed 0 trains all three;
# the two fixed-state models, whose comparison is the one in doubt, are trained again from
# another seed (initialisation and data both change) to show the spread.

# %%
PAIRS_TRAIN = 8  # P ~ U{1, ..., 8} per batch
EVAL_PAIRS = [1, 2, 4, 8] if SMOKE else [1, 2, 4, 8, 12, 16, 24, 32]
MQAR_STEPS = 20 if SMOKE else 640
MQAR_BATCH = 64
N_EVAL = 64 if SMOKE else 256  # held-out examples per pair count
MIXERS = ["softmax", "linear", "deltanet"]
SEEDS = {"softmax": [0], "linear": [0, 1], "deltanet": [0, 1]}


def build_mixer_lm(mixer, seed):
    torch.manual_seed(seed)
    # the length of a sequence at the largest P
    longest = mqar_seq_len(max(EVAL_PAIRS), show_answers=False)
    config = MixerConfig(vocab_size=VOCAB, block_size=longest, n_layer=2, n_head=2,
                         n_embd=64, mixer=mixer, conv_size=4, pos_emb=False)
    return MixerLM(config)


# each batch: one pair count P ~ U{1, ..., 8}, then MQAR_BATCH sequences of P pairs
batch_fn = mqar_sampler(MQAR_BATCH, PAIRS_TRAIN, VOCAB)
held = MQARHeldOut(EVAL_PAIRS, N_EVAL, VOCAB)  # fixed held-out sets, seed 1000 + P
held_out, accuracy_at = held.sets, held.accuracy


def train_mqar(mixer, seed):
    model = build_mixer_lm(mixer, seed)
    result = train_batches(model, batch_fn, steps=MQAR_STEPS, lr=1e-2, seed=seed,
                           warmup=min(50, MQAR_STEPS // 10),
                           eval_every=max(1, MQAR_STEPS // 16), progress=False,
                           eval_fn=lambda m: accuracy_at(m, PAIRS_TRAIN))
    return dict(model=model, result=result,
                accuracy={P: accuracy_at(model, P) for P in EVAL_PAIRS})


seed_runs = {}  # (mixer, seed) -> run
for mixer in MIXERS:
    for seed in SEEDS[mixer]:
        run = seed_runs[mixer, seed] = train_mqar(mixer, seed)
        print(f"{mixer:8s} seed {seed}: {run['model'].num_parameters():,} parameters, "
              f"{MQAR_STEPS} steps in {run['result'].seconds:.0f} s, "
              f"final training loss {run['result'].train_loss[-1]:.3f}")
mqar_runs = {mixer: seed_runs[mixer, 0] for mixer in MIXERS}  # seed 0: the rest uses it

# %% [markdown]
# Before the results, the check promised above: the trained DeltaNet gives the same logits with
# the token loop in place of the triangular solve (the layer takes any function with the
# contract as `op`).

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

# %% [markdown]
# The chance levels, from the held-out examples themselves: a guesser that answers each query
# with a value drawn uniformly from its context is right with probability (context values
# equal to the answer) / $P$; one that draws from all value tokens of the vocabulary, with one
# over their number.

# %%
def chance_at(P):
    """Recall of a uniform guess among the context's values (held-out set at P)."""
    x, y = held_out[P]
    values, answers = x[:, 1 : 2 * P : 2], y[:, 2 * P :]  # [N, P] each
    return (values[:, None, :] == answers[:, :, None]).double().mean(-1).mean().item()


chance = {P: chance_at(P) for P in EVAL_PAIRS}
value_tokens = torch.cat([held_out[P][0][:, 1 : 2 * P : 2].flatten()
                          for P in EVAL_PAIRS])
vocabulary_chance = 1 / value_tokens.unique().numel()
print("chance, a value of the context: "
      + " ".join(f"P={P} {c:.3f}" for P, c in chance.items()))
print(f"chance, any of the {value_tokens.unique().numel()} value tokens: "
      f"{vocabulary_chance:.3f}")

# %% mystnb={"figure": {"caption": "Multi-query associative recall with softmax attention, linear attention and DeltaNet, 2 layers of width $d_{\\text{model}} = 64$, trained on $P \\le 8$ pairs; thick lines seed 0, thin lines the other seeds. Top: held-out accuracy at $P = 8$ during training. Bottom: accuracy after training against the number of pairs $P$ (shaded: the trained range; dotted: chance for a random value of the context; dashed: chance for a random value token).", "name": "fig-deltanet-mqar"}, "image": {"alt": "Two line plots of recall accuracy. Top, against training step: softmax jumps to 1 early; DeltaNet's thin line climbs to nearly 1, and its thick line rises late, past linear attention's, to about half, still rising at the end; linear attention levels off below both. Bottom, against pairs P from 1 to 32 on a log axis: softmax stays at 1; DeltaNet's thin line stays near 1 up to 8 and its thick line falls from 2 on, to about half at 8, both falling beyond; linear attention falls lower, all above a dotted chance curve 1 over P and a dashed floor at 1 over 32; linear attention's thin line lies near its thick one, DeltaNet's lies well above its thick one"}}
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.8, 6.4))
for mixer, color in zip(MIXERS, ("C0", "C1", "C2")):
    for seed in SEEDS[mixer]:
        run, main = seed_runs[mixer, seed], seed == 0
        style = dict(color=color, lw=1.5 if main else 0.8, alpha=1 if main else 0.6,
                     label=mixer if main else None)
        ax1.plot(run["result"].val_steps, run["result"].val_metric,
                 "o-" if main else "-", ms=3, **style)
        ax2.plot(EVAL_PAIRS, [run["accuracy"][P] for P in EVAL_PAIRS],
                 "o-" if main else "-", **style)
ax2.plot(EVAL_PAIRS, [chance[P] for P in EVAL_PAIRS], "k:", lw=1)
ax2.text(2.1, chance[2] + 0.02, "chance: a value of the context", fontsize=8)
ax2.axhline(vocabulary_chance, color="gray", lw=1, ls="--")
ax2.text(1.05, vocabulary_chance + 0.02, "chance: any value token", fontsize=8,
         color="gray")
ax2.axvspan(0.9, PAIRS_TRAIN, color="gray", alpha=0.12, lw=0)
ax2.text(1.05, 0.62, "trained on\nP ≤ 8", fontsize=8, color="gray")
ax1.set(xlabel="training step", ylabel=f"recall accuracy at P = {PAIRS_TRAIN}",
        title="Learning to recall (held-out examples)", ylim=(-0.02, 1.02))
ax2.set(xscale="log", xlabel="key-value pairs P in the context",
        ylabel="recall accuracy", title="Recall against the number of pairs",
        ylim=(-0.02, 1.02))
ax2.set_xticks(EVAL_PAIRS, [str(P) for P in EVAL_PAIRS])
ax2.minorticks_off()
ax1.legend(loc="lower right")  # the colours of both panels
plt.tight_layout()
plt.show()

print(f"{'mixer':>8s} {'seed':>4s} {'time':>5s}  "
      + " ".join(f"{'P=' + str(P):>6s}" for P in EVAL_PAIRS))
for mixer in MIXERS:
    for seed in SEEDS[mixer]:
        run = seed_runs[mixer, seed]
        print(f"{mixer:>8s} {seed:4d} {run['result'].seconds:4.0f}s  "
              + " ".join(f"{run['accuracy'][P]:6.3f}" for P in EVAL_PAIRS))
    if len(SEEDS[mixer]) > 1:
        acc = torch.tensor([[seed_runs[mixer, s]["accuracy"][P] for P in EVAL_PAIRS]
                            for s in SEEDS[mixer]])
        spread = acc.max(0).values - acc.min(0).values
        print(f"{mixer:>8s} {'max-min':>11s}  "
              + " ".join(f"{s:6.3f}" for s in spread.tolist()))
print(f"{'chance':>8s} {'':>11s}  " + " ".join(f"{chance[P]:6.3f}" for P in EVAL_PAIRS))
worst_case = [min(seed_runs["deltanet", s]["accuracy"][P] for s in SEEDS["deltanet"])
              - max(seed_runs["linear", s]["accuracy"][P] for s in SEEDS["linear"])
              for P in EVAL_PAIRS]
print(f"{'DeltaNet':>8s} {'- linear':>11s}  "
      + " ".join(f"{d:+6.3f}" for d in worst_case)
      + "   (worst DeltaNet seed minus best linear seed)")

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
# - **Softmax attention recalls everything.** It learns first (top panel) and is perfect at
#   every pair count, four times the trained range included. Its state, the KV cache, grows
#   with the context; the fixed states do not (last two lines).
# - **DeltaNet learns the trained range with one seed, part of it with the other**: one seed
#   recalls nearly every pair up to $P = 8$; the other loses pairs from $P = 2$ on and recalls
#   about half at $P = 8$ (its curve in the top panel is still rising at the last step). Beyond
#   the trained range both lose pairs, steadily.
# - **Linear attention levels off lowest** (top panel) and recalls fewer pairs than DeltaNet at
#   every count above one, even DeltaNet's worse seed against linear attention's better one
#   (line "DeltaNet - linear").
# - **The seeds** (lines "max-min"): linear attention's agree closely at every pair count
#   (within 0.060); DeltaNet's agree at $P = 1$, differ by 0.059 at $P = 2$, and differ widely
#   from $P = 4$ on: by 0.182 there and by 0.364 to 0.580 beyond. Differences between models
#   smaller than these spreads are noise.
#
# **Which pairs are lost.** At the largest pair count, each model's accuracy by the age of the
# queried pair: how many pairs the context wrote after it (0 for the last). If the delta
# rule's erasure is at work, as in experiment 1, the old pairs go first.

# %% mystnb={"figure": {"caption": "Recall accuracy at $P = 32$ pairs by the age of the queried pair (how many pairs the context wrote after it), seed 0; dotted: chance for a random value of the context. DeltaNet recalls the newest pairs best, and its recall falls with age, flattening for the oldest; softmax attention does not depend on age, linear attention little.", "name": "fig-deltanet-recall-by-age"}, "image": {"alt": "Line plot of recall accuracy against the age of the queried pair, pooled in groups of four ages from 0 to 31: softmax flat at 1, DeltaNet falling from the newest pairs to the oldest, linear attention low and nearly flat, above a dotted chance line"}}
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
ax.axhline(chance[P], color="k", lw=1, ls=":", label="chance")
ax.set(xlabel="age of the queried pair (pairs written after it)",
       ylabel="recall accuracy", title=f"Recall by age, P = {P} pairs",
       ylim=(-0.02, 1.02))
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=4)  # below the axes
plt.show()

# %% [markdown]
# **How hard the trained DeltaNet writes.** Its write strengths $\beta_t$ on the same examples,
# in both layers, averaged by kind of token: key tokens and queries bring no new pair to store,
# each value token completes one.

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
# **How much the keys overlap.** Chapter 4 measured what positive features cost an additive
# memory: for unit-length feature keys $k = \phi(x)/\|\phi(x)\|$ with Gaussian pre-activations,
# $k_i \cdot k_j \to \bar c = \mathbb{E}[\phi(x)]^2 / \mathbb{E}[\phi(x)^2]$ as $D$ grows, and a
# normalised read of the right key puts only about $1/(1 + \bar c(N-1))$ of its weight on the
# right value. The same quadrature for this chapter's features: ELU+1 (chapter 4), DeltaNet's
# SiLU then L2, and both as these models compute them, behind the convolution's SiLU:

# %%
grid = torch.linspace(-12, 12, 200_001, dtype=torch.float64)
density = torch.exp(-grid**2 / 2) / math.sqrt(2 * math.pi)  # N(0, 1)


def c_bar(phi):
    """E[φ(x)]² / E[φ(x)²], x ~ N(0, 1); phi = φ(grid), trapezoids on [-12, 12]."""
    return (torch.trapezoid(phi * density, grid) ** 2
            / torch.trapezoid(phi**2 * density, grid)).item()


silu = F.silu(grid)
features = {"ELU+1 (chapter 4)": feature_maps.elu_plus_one(grid),
            "SiLU, then L2 (DeltaNet)": silu,
            "ELU+1 of SiLU (linear, with the conv)": feature_maps.elu_plus_one(silu),
            "SiLU of SiLU (DeltaNet, with the conv)": F.silu(silu)}
for name, phi in features.items():
    print(f"c̄ = {c_bar(phi):.3f}  {name}")

# %% [markdown]
# Those constants assume Gaussian pre-activations. The trained models' own keys: the unit
# feature keys of the $2P$ context tokens (every token writes) of the held-out examples at
# $P = 8$, their mean overlap $c$ and mean squared overlap over $i \ne j$, per layer, with
# chapter 4's weight rule at $c$ and, for DeltaNet, the mean write strength $\bar\beta$ (at the
# context tokens of the β cell above) times the mean squared overlap: by experiment 1, about
# the share of an older pair's value that each later write erases.

# %%
def context_key_features(model, mixer, x, P):
    """Unit feature keys each layer writes at the 2P context tokens.

    A list over layers of [N, H, 2P, D].
    """
    kept = []

    def keep(attn, inputs):  # runs before each layer's mixer, on its input x
        _, k, _, _ = attn.qkv(inputs[0])  # the keys before the feature map
        kept.append(k[:, :, : 2 * P])

    hooks = [b.attn.register_forward_pre_hook(keep) for b in model.transformer.h]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    phi = {"linear": feature_maps.elu_plus_one, "deltanet": F.silu}[mixer]
    return [F.normalize(phi(k.double()), dim=-1) for k in kept]


P = PAIRS_TRAIN
x, _ = held_out[P]
off_diagonal = ~torch.eye(2 * P, dtype=torch.bool)
key_overlap = {}
for mixer in ("linear", "deltanet"):
    keys_ = context_key_features(mqar_runs[mixer]["model"], mixer, x, P)
    for layer, k in enumerate(keys_, start=1):
        gram = (k @ k.mT)[..., off_diagonal]  # k_i·k_j, i ≠ j  [N, H, 2P(2P-1)]
        mean, mean_sq = gram.mean().item(), gram.pow(2).mean().item()
        erased = ""
        if mixer == "deltanet":  # β̄ at the context tokens of the β cell above
            beta_bar = betas[layer - 1][:, : 2 * max(EVAL_PAIRS)].mean().item()
            erased = f"; β̄ (k_i·k_j)² = {beta_bar * mean_sq:.3f}"
        print(f"{mixer:8s} layer {layer}: mean k_i·k_j = {mean:.3f}, "
              f"mean (k_i·k_j)² = {mean_sq:.3f}, "
              f"1/(1 + c(2P−1)) = {1 / (1 + mean * (2 * P - 1)):.2f}{erased}")
print(f"random unit keys in D = {k.shape[-1]}: mean k_i·k_j = 0, "
      f"mean (k_i·k_j)² = 1/D = {1 / k.shape[-1]:.3f}")

# %% [markdown]
# Putting these together:
#
# - **DeltaNet forgets in order of age**, as experiment 1's memory did: the newest pairs are
#   recalled most often and recall falls with age, levelling off for the oldest groups (the age
#   plot), while softmax attention does not depend on age at all.
# - **It writes at every token.** In layer 1, $\beta_t$ is well above zero at key tokens and
#   queries too, not only at the value tokens that complete a pair; layer 2 writes weakly at
#   every kind of token (the β lines). Each write erases about $\bar\beta\,(k_i\cdot k_j)^2$
#   of every older pair (last column above), compounded over all the writes after it.
# - **MQAR never asks for an overwrite.** Its keys are distinct, so replacing a value, what the
#   delta rule is built for, is never needed; beyond the trained range what shows is its price.
# - **Linear attention's keys overlap more.** For Gaussian pre-activations chapter 4's constant
#   is several times larger for ELU+1 than for DeltaNet's SiLU-then-L2 keys, and behind the
#   convolution's SiLU both constants grow, linear attention's most (the quadrature lines).
#   Training moved both models' keys (the measured lines); linear attention's still overlap
#   more in each layer. At overlap $c$
#   each of the $2P - 1$ other context tokens gets $c$ times the right token's weight in a
#   normalised read, so the wrong values add up as $P$ grows: a handicap of positive features
#   that training has to remove, and this budget does not finish the job.
#
# Yang et al. (2024) find the delta rule better than the additive update at associative recall
# in models far larger than these. What this small experiment shows is the trade every
# fixed-size state makes: something must be dropped, and the delta rule drops the oldest first.
# Chapter 10 adds a learned decay that makes forgetting the model's decision, and chapter 15
# keeps a few softmax-attention layers for the recall a fixed state cannot hold.

# %% [markdown]
# (erratum-deltanet-prefill)=
# ## Erratum: a DeltaNet prefill that reads the state once
#
# The post's DeltaNet layer (its "DeltaNet (Fast weight programmers)" section) computes, for all
# the new tokens of a call at once, $V^{\text{old}} = K S$ with the state $S$ from before the call,
# $U = \beta \odot (V - V^{\text{old}})$, one write $S \leftarrow S + K^\top U$, and then every
# output $Q S$. For decoding, one token per call, this is the recurrence. For a prefill of
# $T > 1$ tokens it has two faults:
#
# - every correction is computed against the state from *before the block*: token $t$ does not
#   see what tokens $1, \dots, t-1$ of the block wrote, so a key written twice in the prompt is
#   written twice *additively*. Unlike chapter 3's erratum, the final state is wrong too, and
#   decoding after the prefill inherits the error;
# - every token reads the state *after the block*, $o_t = q_t S_T$: the outputs are not causal,
#   as in chapter 3's linear-attention prefill.
#
# As printed it also starts from `S = 0.0`, a Python float, when there is no cache, and
# `k @ 0.0` raises a `TypeError`; a zero tensor is what is meant. A minimal version of that
# logic, against the recurrence:

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
# One token per call agrees with the recurrence; a block of 12 is wrong at every position, the
# last included. The two faults can be told apart. The first is the parallel form's triangular
# system with its strictly lower part dropped: the post solves $U = \operatorname{diag}(\beta)(V - K S_0)$, where the recurrence needs
# $\big(I + \operatorname{diag}(\beta)\operatorname{tril}(K K^\top, -1)\big)U =
# \operatorname{diag}(\beta)(V - K S_0)$. The dropped part is $\beta_t (k_t\cdot k_j)$ for
# $j < t$, so with keys orthogonal inside the block the corrections and the final state are
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
# **The fix.** Run a prefill as the recurrence, token by token (`delta_rule.recurrent`), or
# solved for the whole block (`delta_rule.parallel`, or chapter 8's chunked form for long
# prompts), in both cases from the cached state. The first 8 tokens, then the other 4 as a
# second block from the first block's state:

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
# This erratum is on the [errata page](../book/errata.md). `tinyk3.layers.DeltaNet` does it
# the fixed way: a prompt goes through `delta_rule.parallel` from the cached state, a single
# decoded token through one step of `delta_rule.recurrent`.

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
# - The delta rule reads before it writes:
#   $S_t = S_{t-1} + k_t^\top \beta_t (v_t - k_t S_{t-1}) = F_t S_{t-1} + \beta_t k_t^\top v_t$
#   with $F_t = I - \beta_t k_t^\top k_t$, and $o_t = q_t S_t$. Papers write the transpose.
# - Each write is one gradient step on $\tfrac12\|k_t S - v_t\|^2$ with learning rate
#   $\beta_t$: a fast weight matrix trained online by the slow weights.
# - $F_t$ has eigenvalues 1 ($D_k - 1$ times) and $1 - \beta_t\|k_t\|^2$: with unit keys every
#   write is non-expansive; without normalisation the state can grow geometrically.
# - Overwriting: the additive memory returns old and new values in equal parts; the delta rule
#   replaces them, exactly for orthonormal keys, and with random keys forgets the oldest first,
#   keeping about $(1 - e^{-N/D})/(N/D)$ of each value.
# - On MQAR at this scale softmax attention, whose cache grows, recalls every pair; DeltaNet
#   recalls nearly every pair of the trained range with one seed and fewer with the other
#   (about half at $P = 8$), and beyond it forgets the oldest pairs first; linear attention,
#   whose positive keys overlap more, levels off lower and, with either seed, recalls fewer
#   pairs than either DeltaNet seed.
# - The post's DeltaNet listing reads the state once per block: exact for one token per call,
#   wrong for a prefill, final state included.
#
# **Next.** The delta rule is sequential as written: each correction depends on the state left
# by the token before. `delta_rule.parallel` solves for all corrections at once, in $O(T^2 D)$
# time and $O(T^2)$ memory. Part III makes it fast on long sequences and GPUs: chapter 6 chunks
# linear attention, chapter 7 finds the compact (WY) form of a product of transitions and the
# triangular solve (the UT transform) that computes it, and chapter 8 combines them into
# chunkwise DeltaNet, whose one-chunk case is the parallel form used here.
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
