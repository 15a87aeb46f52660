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
# # Associative memory: how much can a D×D state hold?
#
# Chapter 3 replaced the growing KV cache with a state of fixed size: linear attention folds
# every key-value pair into one $D_k \times D_v$ matrix, $S_t = S_{t-1} + k_t^\top v_t$, however
# long the sequence. Something must be lost. This chapter asks how much, with no training: the
# state is an *associative memory*, a matrix that stores key→value pairs by adding them up, and
# a key reads its value back together with *crosstalk* from every other pair.
#
# **In this chapter** you write pairs into a memory and read them back, prove recall exact for
# orthonormal keys, derive and measure the crosstalk of random keys, find that no keys do much
# better, measure recall against the load $N/D$, and see why positive feature maps make the
# memory far worse.
#
# **Cost.** Well under a minute on one CPU core (the last cell prints the time); `SMOKE = True`
# runs in a few seconds.

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
from tinyk3.ops import feature_maps, linear_attention
from tinyk3.util import max_diff
from tinyk3.widgets import figure_png, image_grid_explorer

DIMS = [8, 16] if SMOKE else [16, 32, 64, 128]  # state sizes D = Dk = Dv in the sweeps
RATIOS = 2.0 ** torch.arange(-3, 5.5 if not SMOKE else 4, 0.5)  # loads N/D, 1/8 to 32
PAIRS_PER_POINT = 512 if SMOKE else 4096  # stored pairs averaged over for each point
WIDGET_D = 32
WIDGET_N = [8, 64] if SMOKE else [8, 16, 32, 64, 128, 256]


# %% [markdown]
# ## The idea: a matrix that stores pairs
#
# Leave the queries aside and look at what the state does with keys and values. Each token
# adds the outer product of its key and its value; a vector multiplied into the state reads out
# a combination of the stored values. If that vector is a stored key $k_i$, we want its own
# value $v_i$ back. A matrix used this way is an *associative memory*: Kohonen (1972) and
# Anderson (1972) called it a correlation matrix memory, and Schmidhuber (1992) used one whose
# entries a network writes on the fly, *fast weights*. Schlag, Irie and Schmidhuber (2021)
# pointed out that linear attention is exactly such a memory, so its capacity is limited by
# the size of the keys. This chapter measures that limit.
#
# Chapter 2's KV cache is a memory too, with a separate slot per pair, so a sharp enough softmax
# can pick out one stored value however many there are. The associative memory superposes all
# pairs in the same $D_k D_v$ numbers.

# %% [markdown]
# ## The math: write, read, crosstalk
#
# Store $N$ pairs, keys $k_j \in \mathbb{R}^{1 \times D_k}$ and values
# $v_j \in \mathbb{R}^{1 \times D_v}$ (rows, as everywhere in this course), stacked into
# $K \in \mathbb{R}^{N \times D_k}$ and $V \in \mathbb{R}^{N \times D_v}$. Writing adds outer
# products:
#
# $$
# S = \sum_{j=1}^{N} k_j^\top v_j = K^\top V \qquad (D_k \times D_v).
# $$
#
# Reading with a stored key gives every stored value, weighted by how much its key overlaps:
#
# $$
# \begin{gathered}
# k_i S = \sum_{j=1}^{N} (k_i \cdot k_j)\, v_j = \underbrace{\|k_i\|^2\, v_i}_{\text{signal}} + \underbrace{\sum_{j \ne i} (k_i \cdot k_j)\, v_j}_{\text{crosstalk}}, \\
# \text{all at once: } K S = (K K^\top)\, V .
# \end{gathered}
# $$
#
# The Gram matrix $G = K K^\top$ of the keys decides everything: recall is exact for every pair
# exactly when $G = I$. Papers write the transpose, $S = \sum_j v_j k_j^\top$ read by $S k_i$
# (see the [notation page](../book/notation.md)).

# %% [markdown]
# ## Build it: write and read
#
# The write as a loop of outer products, against `tinyk3.memory.write` (one matrix product)
# and the final state of chapter 3's linear attention over the same pairs as a sequence:

# %%
torch.manual_seed(0)
N, D = 12, 8
keys = torch.randn(N, D, dtype=torch.float64)
values = torch.randn(N, D, dtype=torch.float64)

S_loop = torch.zeros(D, D, dtype=torch.float64)
for k, v in zip(keys, values):
    S_loop = S_loop + torch.outer(k, v)  # S += k_jᵀ v_j   [Dk, Dv]

S = memory.write(keys, values)  # Kᵀ V
# any queries: the final state ignores them
q = torch.randn(1, 1, N, D, dtype=torch.float64)
_, S_linear_attention = linear_attention.recurrent(q, keys[None, None],
                                                   values[None, None])
print(f"max |loop - memory.write|              = {max_diff(S_loop, S):.1e}")
print(f"max |loop - linear attention's state|  = "
      f"{max_diff(S_loop, S_linear_attention[0, 0]):.1e}")

# %% [markdown]
# And the read: `memory.read(S, keys)` is `keys @ S`, which must equal the Gram matrix applied
# to the values, and, row by row, the signal plus the crosstalk.

# %%
reads = memory.read(S, keys)  # [N, Dv]
G = keys @ keys.T  # k_i·k_j   [N, N]
i = 3
signal = G[i, i] * values[i]
crosstalk = sum(G[i, j] * values[j] for j in range(N) if j != i)
print(f"max |K S - G V|                        = {max_diff(reads, G @ values):.1e}")
print(f"max |k_3 S - (signal + crosstalk)|     = "
      f"{max_diff(reads[i], signal + crosstalk):.1e}")
print(f"size of signal and crosstalk for key 3: "
      f"{signal.norm():.2f} and {crosstalk.norm():.2f}")

# %% [markdown]
# With these unnormalised random keys the crosstalk is larger than the signal. From here on
# keys have unit length, $\|k_i\| = 1$, so the signal is exactly $v_i$ and only the crosstalk
# remains to study.

# %% [markdown]
# ## Exact recall for orthonormal keys, and why it stops at D
#
# If the keys are orthonormal, $k_i \cdot k_j = \delta_{ij}$, then $G = I$ and
#
# $$
# K S = K K^\top V = V :
# $$
#
# every value comes back exactly. `memory.orthonormal_keys` draws $N \le D$ of them (rows of a
# random orthogonal matrix); here $N = D = 64$ in float64:

# %%
D = 64
keys = memory.orthonormal_keys(D, D, generator=torch.Generator().manual_seed(1),
                               dtype=torch.float64)
values = torch.randn(D, D, dtype=torch.float64)
S = memory.write(keys, values)
identity = torch.eye(D, dtype=torch.float64)
print(f"max |K Kᵀ - I|       = {max_diff(keys @ keys.T, identity):.1e}")
print(f"max |K S - V|        = {max_diff(memory.read(S, keys), values):.1e}")
print(f"relative error       = {memory.relative_error(S, keys, values):.1e}")

# %% [markdown]
# A $D$-dimensional space holds at most $D$ orthonormal vectors, so this stops at $N = D$, and
# not only for the additive write. Whatever state $S$ we store, each column of the read-outs
# $K S$ (one value coordinate, over all $N$ keys) is a combination of the $D_k$ columns of $K$,
# so it lies in a subspace of $\mathbb{R}^N$ of dimension at most $D_k$:
#
# $$
# \operatorname{rank}(K S) \le \operatorname{rank}(K) \le D_k .
# $$
#
# For $N > D_k$, values in general position have columns outside that subspace, so no
# $D_k \times D_v$ state returns them all exactly, whatever the keys. The best state in the
# least-squares sense shows it: $S^\ast = \arg\min_S \|K S - V\|^2 = K^{+} V$, where $K^{+}$, the
# *pseudo-inverse* of $K$, is $K^\top (K K^\top)^{-1}$ for linearly independent keys and
# $(K^\top K)^{-1} K^\top$ for keys that span $\mathbb{R}^{D_k}$. Its read-out $K S^\ast$ is the
# projection of $V$ onto that subspace, and its error is zero up to $N = D$ and not beyond.

# %%
for N in (D // 2, D, D + 1, 2 * D):
    g = torch.Generator().manual_seed(N)
    keys = memory.random_unit_keys(N, D, generator=g, dtype=torch.float64)
    values = torch.randn(N, D, dtype=torch.float64)
    S_best = torch.linalg.lstsq(keys, values).solution  # K⁺ V   [D, D]
    rank = torch.linalg.matrix_rank(keys @ S_best).item()
    best_error = memory.relative_error(S_best, keys, values)
    print(f"N = {N:3d}: rank of K S* = {rank:3d}, "
          f"relative error of the best state = {best_error:.2e}")

# %% [markdown]
# So $D$ is a hard ceiling for *exact* recall. Beyond it, in turn: random keys with the
# additive write, the best keys, the best write.

# %% [markdown]
# ## Random keys: the crosstalk, derived
#
# Take keys uniform on the unit sphere of $\mathbb{R}^D$ (`memory.random_unit_keys`), and values
# independent of them with zero-mean, unit-variance coordinates. The crosstalk on coordinate
# $d$ of key $i$'s read-out, $c_{id} = \sum_{j \ne i} (k_i \cdot k_j)\, v_{jd}$, is a sum of
# independent zero-mean terms, so given the keys its variance is the sum of theirs:
#
# $$
# \operatorname{Var}[c_{id} \mid K] = \sum_{j \ne i} (k_i \cdot k_j)^2 .
# $$
#
# One overlap: fix $k_j$ and let $k_i$ be uniform on the sphere. By symmetry every coordinate of
# $k_i$ in an orthonormal basis that starts with $k_j$ has the same mean square, and the $D$
# squares sum to $\|k_i\|^2 = 1$, so $\mathbb{E}[(k_i \cdot k_j)^2] = 1/D$. With $N - 1$ other
# keys:
#
# $$
# \operatorname{Var}[c_{id}] = \frac{N-1}{D},
# \qquad
# \text{relative error} = \sqrt{\frac{\mathbb{E}\,\|k_i S - v_i\|^2}{\mathbb{E}\,\|v_i\|^2}}
# = \sqrt{\frac{N-1}{D}} .
# $$
#
# Nothing here is asymptotic, and $D_v$ does not appear: the error depends only on
# $(N-1)/D \approx N/D$, the *load* of the memory, and reaches 1 (noise as large as the signal)
# at about $N = D$. The check, for $D = 64$: the measured error variance per coordinate over
# many memories, the prediction from the actual keys (`memory.crosstalk_std`), and the formula:

# %%
tinyk3.notebook.show_source(memory.crosstalk_std)

# %%
D = 64
print(f"{'N':>5s} {'measured error²':>16s} {'Σ(k_i·k_j)², mean':>19s} {'(N-1)/D':>8s}")
for N in (2, 16, 64, 256):
    # memories, so that each row averages the same number of pairs
    M = PAIRS_PER_POINT * 4 // N
    g = torch.Generator().manual_seed(N)
    keys = memory.random_unit_keys(N, D, batch=M, generator=g, dtype=torch.float64)
    values = torch.randn(M, N, D, generator=g, dtype=torch.float64)
    # the crosstalk   [M, N, D]
    err = memory.read(memory.write(keys, values), keys) - values
    measured = err.pow(2).mean().item()
    given_keys = memory.crosstalk_std(keys).pow(2).mean().item()
    print(f"{N:5d} {measured:16.4f} {given_keys:19.4f} {(N - 1) / D:8.4f}")

# %% [markdown]
# The columns agree to within sampling noise. At $N = D$ the read-out is already as much
# crosstalk as value, although the state has room for $D$ orthonormal keys: random keys waste
# it.

# %% [markdown]
# ## Could better keys help? The Welch bound
#
# For $N \le D$, yes: orthonormal keys remove the crosstalk entirely. Beyond $D$, not by much.
# The $D \times D$ matrix $K^\top K$ has eigenvalues $\lambda_1, \dots, \lambda_D \ge 0$ that
# sum to its trace $\sum_i \|k_i\|^2 = N$. The sum of all squared overlaps is
# $\|K K^\top\|_F^2 = \|K^\top K\|_F^2 = \sum_d \lambda_d^2 \ge (\sum_d \lambda_d)^2 / D = N^2/D$
# (Cauchy-Schwarz). Removing the $N$ diagonal terms, each 1, and averaging over keys:
#
# $$
# \frac{1}{N} \sum_i \sum_{j \ne i} (k_i \cdot k_j)^2 \;\ge\; \frac{N}{D} - 1
# \qquad \text{(Welch, 1974)},
# $$
#
# with equality when all $\lambda_d = N/D$, i.e. $K^\top K = \tfrac{N}{D} I$. Such keys form a
# *tight frame*: $N \ge D$ vectors that cover every direction of $\mathbb{R}^D$ equally, the
# closest a set larger than $D$ comes to an orthonormal basis. `memory.harmonic_frame` builds
# one from cosines and sines at $D/2$ frequencies. Random keys give $(N-1)/D$ on average, so
# the best unit keys save $(D-1)/D < 1$ of variance: little once $N$ is a few times $D$.

# %%
D = 32
g = torch.Generator().manual_seed(0)
print(f"{'N':>5s} {'random keys':>12s} {'tight frame':>12s} {'bound N/D-1':>12s}"
      "   (mean crosstalk variance)")
for N in (48, 64, 128, 256):
    unit_keys = memory.random_unit_keys(N, D, generator=g, dtype=torch.float64)
    frame = memory.harmonic_frame(N, D, dtype=torch.float64)
    print(f"{N:5d} {memory.crosstalk_std(unit_keys).pow(2).mean():12.3f} "
          f"{memory.crosstalk_std(frame).pow(2).mean():12.3f} "
          f"{memory.min_crosstalk_std(N, D) ** 2:12.3f}")

# %% [markdown]
# The frame meets the bound exactly, and random keys lie about one unit of variance above it
# (the gap $(D-1)/D$ predicted above):
# beyond $N = D$ the crosstalk of an additive memory is a property of its size, not of clever
# keys.
#
# The write is another matter. The least-squares state $S^\ast = K^+ V$ reads back the
# projection of the values onto the $D$-dimensional column space of $K$; for random values a
# fraction $(N - D)/N$ of their energy lies outside it, so its relative error is
# $\sqrt{\max(0, 1 - D/N)}$: below 1 at every load, and 0 for *any* linearly independent keys up
# to $N = D$, orthogonal or not. The additive write reaches that only for orthonormal keys.

# %% [markdown]
# ## Experiment: recall against the load N/D
#
# For each size $D$ and each load $N/D$ from 1/8 to 32, store $N$ random pairs (random unit
# keys, Gaussian values, $D_k = D_v = D$) and read every key back. Two scores, both in
# `tinyk3.memory`:
#
# - the **relative error** $\sqrt{\sum_i \|k_i S - v_i\|^2 / \sum_i \|v_i\|^2}$;
# - the **recall accuracy**: the fraction of keys whose read-out is closer, by cosine similarity,
#   to their own value than to any of the other $N - 1$ stored values: the question a later
#   layer faces when it must tell *which* stored value came back.
#
# Orthonormal keys ($N \le D$ only) and the least-squares state are measured alongside. Each
# point averages over `PAIRS_PER_POINT` stored pairs (several memories for small $N$); a few
# seconds.

# %%
tinyk3.notebook.show_source(memory.recall_accuracy)



# %%
def sweep(make_keys, D, ns, least_squares=False, seed=0):
    """Store N random pairs in a D×D memory, for each N in ns; read every key back.

    make_keys(N, D, batch=M, generator=g) -> M memories of N keys, [M, N, D], like
    memory.random_unit_keys and memory.orthonormal_keys. Returns a dict of tensors
    over ns: relative error, recall accuracy, and (if least_squares) the relative
    error of the best state K⁺V for the same keys and values.
    """
    g = torch.Generator().manual_seed(seed)
    out = {"N": list(ns), "error": [], "accuracy": [], "ls_error": []}
    for N in ns:
        M = max(1, PAIRS_PER_POINT // N)  # memories averaged over
        keys = make_keys(N, D, batch=M, generator=g)
        values = torch.randn(M, N, D, generator=g)
        S = memory.write(keys, values)  # [M, D, D]
        out["error"].append(memory.relative_error(S, keys, values))
        out["accuracy"].append(memory.recall_accuracy(S, keys, values))
        if least_squares:
            k64, v64 = keys.double(), values.double()
            S_best = torch.linalg.lstsq(k64, v64).solution  # K⁺V
            out["ls_error"].append(memory.relative_error(S_best, k64, v64))
    return {name: torch.tensor(x) for name, x in out.items()}


t0 = time.perf_counter()
load_ns = {D: sorted({max(2, round(r * D)) for r in RATIOS.tolist()}) for D in DIMS}
random_runs = {D: sweep(memory.random_unit_keys, D, load_ns[D], least_squares=True)
               for D in DIMS}
ortho_runs = {D: sweep(memory.orthonormal_keys, D, [n for n in load_ns[D] if n <= D])
              for D in DIMS}
print(f"swept {sum(len(v) for v in load_ns.values())} (D, N) points "
      f"in {time.perf_counter() - t0:.1f} s")
largest_error = max(r["error"].max().item() for r in ortho_runs.values())
lowest_accuracy = min(r["accuracy"].min().item() for r in ortho_runs.values())
print(f"orthonormal keys, all N ≤ D: largest relative error {largest_error:.1e}, "
      f"lowest accuracy {lowest_accuracy:.2f}")


# %% [markdown]
# The accuracy has no formula as simple as the error's, but its scale can be estimated. Compare
# the read-out $r_i = v_i + c_i$ with each stored value's direction $\hat v_j = v_j/\|v_j\|$. For
# its own value the score is about $\|v_i\| \approx \sqrt{D_v}$; for another value it is noise
# of standard deviation about $\sqrt{1 + (N-1)/D_k}$, and the largest of $N - 1$ such scores is
# about $\sqrt{2 \ln N}$ times that. With $D_k = D_v = D$ and $N \gg D$, recall succeeds while
# $\sqrt{D} \gtrsim \sqrt{2 \ln N}\, \sqrt{N/D}$, that is while
#
# $$
# 2 N \ln N \lesssim D^2 .
# $$
#
# Unlike the error, this is not a function of $N/D$: a wider state averages the crosstalk over
# more coordinates, so the *identity* of the value survives far beyond the load where its
# coordinates are mostly noise (lower right panel below).

# %% mystnb={"figure": {"caption": "Recall from an additive $D \\times D$ memory of random unit keys. Top: the relative error against the load $N/D$ falls on one curve $\\sqrt{(N-1)/D}$ for every $D$, while the least-squares state (squares) stays below 1. Bottom left: the recall accuracy against the load. Bottom right: the same accuracies against $2N\\ln N/D^2$, where the curves for all $D$ nearly coincide and cross one half near 1.", "name": "fig-memory-load"}, "image": {"alt": "Three line plots, one wide panel on top and two below, with one colour per state size D from 16 to 128. Top: relative error against load N/D on a log axis, all sizes rising together along the black formula curve, squares for least squares levelling off below 1. Bottom left: recall accuracy against load, the curves dropping from 1 to 0 later for larger D. Bottom right: the same accuracies against 2 N ln N over D squared, nearly one curve crossing a dashed line at 1"}}
colors = dict(zip(DIMS, plt.cm.viridis(torch.linspace(0, 0.85, len(DIMS)).tolist())))
fig, axes = plt.subplot_mosaic([["error", "error"], ["accuracy", "rescaled"]],
                               figsize=(6.8, 6.6))
ax1, ax2, ax3 = axes["error"], axes["accuracy"], axes["rescaled"]
r = torch.logspace(math.log10(RATIOS[0].item()), math.log10(RATIOS[-1].item()), 200,
                   dtype=torch.float64)
for D in DIMS:
    run, ortho = random_runs[D], ortho_runs[D]
    load = run["N"] / D
    ax1.plot(load, run["error"], "o-", ms=4, color=colors[D], label=f"D = {D}")
    ax1.plot(load, run["ls_error"], "s", ms=4, mfc="none", color=colors[D])
    ax1.plot(ortho["N"] / D, ortho["error"], "x", color=colors[D])
    ax2.plot(load, run["accuracy"], "o-", ms=4, color=colors[D], label=f"D = {D}")
    ax2.plot(ortho["N"] / D, ortho["accuracy"], "x", color=colors[D])
    rescaled_load = 2 * run["N"] * run["N"].log() / D**2
    ax3.plot(rescaled_load, run["accuracy"], "o-", ms=4, color=colors[D],
             label=f"D = {D}")
Dmax = DIMS[-1]
ax1.plot(r, (r - 1 / Dmax).clamp(min=0).sqrt(), "k-", lw=1,
         label="√((N−1)/D), random keys")
ax1.plot(r, (r - 1).clamp(min=0).sqrt(), "k--", lw=1,
         label="√(N/D − 1), best unit keys")
ax1.plot(r, (1 - 1 / r).clamp(min=0).sqrt(), "k:", lw=1.5,
         label="√(1 − D/N), least squares (□)")
ax1.set(xscale="log", xlabel="load N/D", ylabel="relative error",
        title="Error: one curve for every D")
ax2.set(xscale="log", xlabel="load N/D", ylabel="recall accuracy",
        title="Accuracy: wider states hold more")
ax3.set(xscale="log", xlabel="2 N ln N / D²", ylabel="recall accuracy",
        title="Accuracy, rescaled")
ax3.axvline(1, color="gray", lw=1, ls="--")
ax1.legend(fontsize=8, loc="upper left")
ax2.legend(fontsize=8, loc="lower left")
plt.tight_layout()
plt.show()

# %% [markdown]
# Crosses are orthonormal keys ($N \le D$: error 0, accuracy 1); squares the least-squares
# state for the same random keys. Behind the accuracy panels: the $N$ at which half of the keys
# are still recalled, interpolated from the sweep, next to the $N$ that solves
# $2 N \ln N = D^2$.

# %%
def half_recall_n(run):
    """N where the accuracy crosses 0.5 (linear interpolation in log N)."""
    acc, n = run["accuracy"], run["N"].double()
    below = (acc < 0.5).nonzero()
    if len(below) == 0:
        return math.nan  # never below half in the range swept
    j = int(below[0])
    if j == 0:
        return n[0].item()
    t = (acc[j - 1] - 0.5) / (acc[j - 1] - acc[j])
    return math.exp(math.log(n[j - 1]) + t * (math.log(n[j]) - math.log(n[j - 1])))


def rule_n(D):
    """Solve 2 N ln N = D² by fixed-point iteration."""
    n = float(D * D)
    for _ in range(50):
        n = D * D / (2 * math.log(n))
    return n


print(f"{'D':>4s} {'error at N = D':>15s} {'N at 50% recall':>16s} {'(N/D)':>6s} "
      f"{'2N ln N = D²':>13s} {'rule / measured':>16s}")
for D in DIMS:
    run = random_runs[D]
    at_d = run["error"][run["N"] == D].item()
    n50 = half_recall_n(run)
    print(f"{D:4d} {at_d:15.2f} {n50:16.0f} {n50 / D:6.1f} "
          f"{rule_n(D):13.0f} {rule_n(D) / n50:16.2f}")

# %% [markdown]
# What the sweep shows:
#
# - **The error collapses.** Measured relative errors for every $D$ lie on one curve,
#   $\sqrt{(N-1)/D}$: a function of the load alone, already about 1 at $N = D$ (the column
#   "error at N = D"). A $D \times D$ additive memory gives back values buried in noise long
#   before it "runs out of room".
# - **The best write is much better.** The least-squares state (squares) is exact up to $N = D$
#   for the same non-orthogonal keys and stays below error 1 at every load. The additive write's
#   weakness is not only the state's size: it never looks at what is already stored.
# - **Identification lasts longer, and longer for wider states.** The half-recall load
#   (column "(N/D)") grows with $D$, and the rule $2 N \ln N = D^2$ tracks it to within the
#   ratio in the last column; in the rescaled panel the curves nearly coincide.

# %% [markdown]
# ## Positive keys: why ELU+1 features hold so little
#
# Chapter 3 passes keys through $\phi = \mathrm{ELU} + 1$ so that every score is positive and the
# output can be normalised. For the memory this is bad news: every overlap $k_i \cdot k_j$ is
# now positive, so the crosstalk terms no longer cancel on average. For unit-length keys
# $k = \phi(x)/\|\phi(x)\|$ with Gaussian pre-activations $x$, the law of large numbers gives
# $k_i \cdot k_j \to \bar c = \mathbb{E}[\phi(x)]^2 / \mathbb{E}[\phi(x)^2]$ as $D$ grows, and
# so the crosstalk variance is about
#
# $$
# \sum_{j \ne i} (k_i \cdot k_j)^2 \approx \bar c^{\,2}\, (N - 1),
# \qquad \text{relative error} \approx \bar c\, \sqrt{N-1} ,
# $$
#
# which grows with $N$ at *any* $D$. The constant, by quadrature over the Gaussian density, and
# the measured mean overlap of such keys:

# %%
x = torch.linspace(-12, 12, 200_001, dtype=torch.float64)
density = torch.exp(-x**2 / 2) / math.sqrt(2 * math.pi)
phi = feature_maps.elu_plus_one(x)
c_bar = torch.trapezoid(phi * density, x) ** 2 / torch.trapezoid(phi**2 * density, x)
print(f"c̄ = E[φ]² / E[φ²] = {c_bar:.4f} for φ = ELU+1 and x ~ N(0, 1)")


def elu_keys(N, D, *, batch, generator):
    """`batch` memories of N unit-length ELU+1 keys (Gaussian pre-activations):
    [batch, N, D], called like memory.random_unit_keys."""
    x = torch.randn(batch, N, D, generator=generator)  # pre-activations
    return F.normalize(feature_maps.elu_plus_one(x), dim=-1)


for D in DIMS:
    k = elu_keys(256, D, batch=1, generator=torch.Generator().manual_seed(D))[0]
    gram = k @ k.T
    off_diagonal = gram[~torch.eye(256, dtype=torch.bool)]
    print(f"D = {D:3d}: mean k_i·k_j (i ≠ j) = {off_diagonal.mean():.4f}, "
          f"smallest = {gram.min():.3f}")

# %% [markdown]
# Every overlap is large and positive. The experiment: the same sweep over absolute $N$, with
# ELU+1 keys and with random unit keys, for every $D$; a few seconds.

# %% mystnb={"figure": {"caption": "An additive memory with ELU+1 keys (solid) and with random unit keys (dashed). Top: with ELU+1 keys the error follows $\\bar c\\sqrt{N-1}$ whatever the state size $D$, while random keys improve with every doubling of $D$. Bottom: recall accuracy against $N$.", "name": "fig-memory-elu-keys"}, "image": {"alt": "Two line plots against the number of stored pairs N on a log axis, one colour per state size D. Top, log-log relative error: the solid ELU+1 lines for all D lie on one gray line that rises to about 15, the dashed random-key lines sit lower and lower as D grows. Bottom, recall accuracy: the solid lines fall close to 0 within a few dozen pairs, the dashed lines stay near 1 much longer"}}
t0 = time.perf_counter()
ns = [2, 4, 8, 16, 32, 64, 128, 256, 512] if not SMOKE else [2, 8, 32]
elu_runs = {D: sweep(elu_keys, D, ns, seed=1) for D in DIMS}
rand_runs_n = {D: sweep(memory.random_unit_keys, D, ns, seed=1) for D in DIMS}
print(f"ELU+1 and random-key sweeps: {time.perf_counter() - t0:.1f} s")

fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.8, 6.4))
n = torch.tensor(ns, dtype=torch.float64)
for D in DIMS:
    for ax, score in ((ax1, "error"), (ax2, "accuracy")):
        ax.plot(n, elu_runs[D][score], "o-", ms=4, color=colors[D], label=f"D = {D}")
        ax.plot(n, rand_runs_n[D][score], "^--", ms=4, color=colors[D], alpha=0.6)
ax1.plot(n, c_bar * (n - 1).sqrt(), "k-", lw=2, alpha=0.3, label="c̄ √(N−1)")
ax1.plot([], [], "ko-", ms=4, label="ELU+1 keys")
ax1.plot([], [], "k^--", ms=4, alpha=0.6, label="random unit keys")
ax1.set(xscale="log", yscale="log", xlabel="stored pairs N", ylabel="relative error",
        title="Error: positive keys do not average out")
ax1.set_ylim(top=100)  # room for the legend, which serves both panels
ax2.set(xscale="log", xlabel="stored pairs N", ylabel="recall accuracy",
        title="Accuracy (solid: ELU+1, dashed: random)")
ax1.legend(fontsize=8, ncols=2, loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# The ELU+1 error curves (solid) lie on each other and on $\bar c\sqrt{N-1}$: doubling the
# state's width buys nothing, while random keys (dashed) improve with every doubling. The
# accuracy with ELU+1 keys improves with $D$, but slowly; the number of pairs recalled half of
# the time, for both kinds of keys:

# %%
print(f"{'D':>4s} {'N at 50% recall, ELU+1':>23s} {'random unit keys':>17s}")
for D in DIMS:
    print(f"{D:4d} {half_recall_n(elu_runs[D]):23.1f} "
          f"{half_recall_n(random_runs[D]):17.0f}")

# %% [markdown]
# The crosstalk formula still predicts the error given the actual keys, since the derivation
# only assumed independent values. For the largest $D$:

# %%
D = DIMS[-1]
g = torch.Generator().manual_seed(2)
print(f"D = {D}, ELU+1 keys")
print(f"{'N':>5s} {'measured error':>15s} {'from crosstalk_std':>19s} "
      f"{'c̄ √(N−1)':>10s} {'random keys, √((N−1)/D)':>24s}")
for N in ns[::2]:
    M = max(1, PAIRS_PER_POINT // N)
    keys = elu_keys(N, D, batch=M, generator=g)
    values = torch.randn(M, N, D, generator=g)
    measured = memory.relative_error(memory.write(keys, values), keys, values)
    predicted = memory.crosstalk_std(keys).pow(2).mean().sqrt().item()
    print(f"{N:5d} {measured:15.3f} {predicted:19.3f} {c_bar * math.sqrt(N - 1):10.3f} "
          f"{memory.random_key_crosstalk_std(N, D):24.3f}")

# %% [markdown]
# Linear attention also divides by $\phi(q)\cdot z$ (chapter 3), which turns the read-out into a
# weighted average $\sum_j w_{ij} v_j$ with $w_{ij} = k_i\cdot k_j / \sum_l k_i \cdot k_l$. With
# unit keys the weight on the right value is $w_{ii} = 1 / (1 + \sum_{j \ne i} k_i\cdot k_j)
# \approx 1/(1 + \bar c (N-1))$: the normaliser keeps the output's scale, but the right value's
# share of it shrinks like $1/N$.

# %%
for N in (4, 16, 64, 256):
    k = elu_keys(N, DIMS[-1], batch=1, generator=torch.Generator().manual_seed(N))[0]
    gram = k @ k.T
    w_self = (gram.diagonal() / gram.sum(-1)).mean().item()
    w_rule = 1 / (1 + c_bar * (N - 1))
    print(f"N = {N:3d}: weight on the right value {w_self:.3f} "
          f"(1/(1 + c̄(N−1)) = {w_rule:.3f})")

# %% [markdown]
# This is the capacity problem of linear attention with positive feature maps, seen without
# training: the positive features that make the normaliser safe also make every key overlap
# every other. Chapter 5's DeltaNet L2-normalises its keys (so a stored value reads back at its
# own size) and, more importantly, changes the write.

# %% [markdown]
# ## See it: the Gram matrix and the read-out
#
# The sliders pick a kind of key (the best unit keys: orthonormal up to $N = D$, a tight frame
# beyond; random unit keys; ELU+1 keys) and the number of stored pairs $N$, for $D = 32$.
# Left: the overlaps $k_i\cdot k_j$ of the first 32 keys. Right: read-out against true value
# for the first 8 coordinates of every pair (the diagonal is perfect recall), with the
# measured crosstalk and its expectation given the keys. The pictures are precomputed, so the
# sliders also work on the website; about 5 seconds.
#
# One memory is one sample, so the measured crosstalk scatters around its expectation, most for
# ELU+1 keys, whose crosstalk is mostly one vector $\bar c \sum_j v_j$ for every key: the
# horizontal bands in the read-outs.

# %%
def best_keys(N, D, *, batch, generator):
    """Orthonormal keys up to N = D, a tight frame beyond (one for all memories)."""
    if N <= D:
        return memory.orthonormal_keys(N, D, batch=batch, generator=generator)
    return memory.harmonic_frame(N, D).expand(batch, N, D)


KINDS = [("best unit keys", best_keys), ("random unit keys", memory.random_unit_keys),
         ("ELU+1 keys", elu_keys)]


def memory_png(kind, make_keys, N, D=WIDGET_D):
    g = torch.Generator().manual_seed(N)
    keys = make_keys(N, D, batch=1, generator=g)[0]
    values = torch.randn(N, D, generator=g)
    S = memory.write(keys, values)
    reads = memory.read(S, keys)
    measured = (reads - values).pow(2).mean().sqrt().item()
    predicted = memory.crosstalk_std(keys).pow(2).mean().sqrt().item()
    accuracy = memory.recall_accuracy(S, keys, values)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.8, 3.6), width_ratios=[1, 1.25])
    # the overlaps of the first 32 keys (keeps the pictures small)
    first = keys[:32]
    ax1.imshow(first @ first.T, cmap="RdBu_r", vmin=-1, vmax=1)
    ax1.set(xlabel="j", ylabel="i")
    ax1.set_title(f"k_i·k_j, first {len(first)} keys\n(N = {N}, D = {D})", fontsize=10)
    ax1.grid(False)
    # the first 8 coordinates of every pair (keeps the pictures small)
    shown = slice(0, 8)
    ax2.plot(values[:, shown].flatten(), reads[:, shown].flatten(), ".",
             ms=2, alpha=0.4)
    ax2.plot([-4, 4], [-4, 4], "k-", lw=1)
    ax2.set(xlim=(-4, 4), ylim=(-12, 12), xlabel="true value coordinate",
            ylabel="read-out")
    ax2.set_title(f"crosstalk std {measured:.2f} (expected {predicted:.2f})\n"
                  f"accuracy {accuracy:.2f}", fontsize=10)
    fig.suptitle(kind)
    fig.tight_layout()
    return figure_png(fig, colors=64)


t0 = time.perf_counter()
pngs = [[memory_png(kind, make, N) for N in WIDGET_N] for kind, make in KINDS]
kilobytes = sum(len(p) for row in pngs for p in row) / 1e3
print(f"{kilobytes:.0f} kB of pictures in {time.perf_counter() - t0:.1f} s")
image_grid_explorer(pngs, "keys", "N",
                    title=f"An additive memory of size {WIDGET_D}×{WIDGET_D}",
                    row_labels=[kind for kind, _ in KINDS], col_labels=WIDGET_N)

# %% [markdown]
# ## Exercises
#
# ```{exercise} Write a memory
# :label: ex-memory-write
#
# Write `write_memory(keys, values)`: keys `[N, Dk]`, values `[N, Dv]`, return the state
# $S = \sum_j k_j^\top v_j$ of shape `[Dk, Dv]`, in the inputs' dtype.
# ```

# %%
def write_memory_mine(keys, values):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("memory.write_memory", write_memory_mine)

# %% [markdown]
# ```{solution-start} ex-memory-write
# :class: dropdown
# ```

# %%
def write_memory_solution(keys, values):
    return keys.T @ values  # Σ_j k_jᵀ v_j   [Dk, Dv]


ok = checks.run("memory.write_memory", write_memory_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} Recall accuracy
# :label: ex-memory-accuracy
#
# Write `recall_accuracy(S, keys, values)`: `S` is `[Dk, Dv]` (it may hold other pairs, or only
# some of these), keys `[N, Dk]`, values `[N, Dv]`. For each key read $r_i = k_i S$, compute its
# cosine similarity with every stored value $v_j$, and count the recall as correct when the most
# similar value is $v_i$ itself. Return the fraction of correct recalls as a float.
# ```

# %%
def recall_accuracy_mine(S, keys, values):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("memory.recall_accuracy", recall_accuracy_mine)

# %% [markdown]
# ```{solution-start} ex-memory-accuracy
# :class: dropdown
# ```

# %%
def recall_accuracy_solution(S, keys, values):
    reads = keys @ S  # [N, Dv]
    # cosines   [N reads, N values]
    sim = F.normalize(reads, dim=-1) @ F.normalize(values, dim=-1).T
    return (sim.argmax(dim=-1) == torch.arange(len(keys))).float().mean().item()


ok = checks.run("memory.recall_accuracy", recall_accuracy_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The crosstalk of each key
# :label: ex-memory-crosstalk
#
# Write `crosstalk_std(keys)`: keys `[N, Dk]` (any length, not only unit), return a tensor `[N]`
# whose entry $i$ is the standard deviation of one coordinate of key $i$'s crosstalk
# $\sum_{j\ne i}(k_i\cdot k_j)\,v_j$, for values with independent unit-variance coordinates.
# Then check on random unit keys that the mean of its square is close to $(N-1)/D$.
# ```

# %%
def crosstalk_std_mine(keys):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("memory.crosstalk_std", crosstalk_std_mine)

# %% [markdown]
# ```{solution-start} ex-memory-crosstalk
# :class: dropdown
# ```

# %%
def crosstalk_std_solution(keys):
    gram = keys @ keys.T  # k_i·k_j   [N, N]
    # drop j = i: that is the signal
    off = gram * (1 - torch.eye(len(keys), dtype=keys.dtype))
    return off.pow(2).sum(dim=-1).sqrt()  # variances add, then one square root


ok = checks.run("memory.crosstalk_std", crosstalk_std_solution)
keys = memory.random_unit_keys(512, 64, generator=torch.Generator().manual_seed(0))
mean_variance = crosstalk_std_solution(keys).pow(2).mean()
print(f"N = 512, D = 64: mean crosstalk_std² = {mean_variance:.3f}, "
      f"(N-1)/D = {511 / 64:.3f}")

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - The state of linear attention is an associative memory, $S = \sum_j k_j^\top v_j$; the Gram
#   matrix of the keys decides what a key reads back. Recall is exact for orthonormal keys, and
#   no state returns more than $D_k$ values in general position exactly.
# - For random unit keys the relative error is $\sqrt{(N-1)/D}$, about 1 at $N = D$; no unit
#   keys do better than $\sqrt{N/D - 1}$ (Welch's bound, met by a tight frame). Telling *which*
#   value came back lasts until roughly $2N\ln N \approx D^2$.
# - ELU+1 keys overlap by about $\bar c$ each, so the error grows as $\bar c\sqrt{N-1}$ whatever
#   $D$.
# - The least-squares state is exact up to $N = D$ for any independent keys: the additive write
#   is far from the best the state can hold.
#
# **Next.** The additive memory never overwrites: a new value under an old key is added to the
# old one, and every pair stays in the sum. Chapter 5's delta rule *reads before it writes*,
# storing only $v_t - k_t S_{t-1}$: one gradient step per token on $\tfrac12\|k_t S - v_t\|^2$,
# the least-squares objective whose minimiser is the best state measured here.
#
# **References.** T. Kohonen, "Correlation matrix memories", *IEEE Trans. Computers* C-21, 1972.
# J. A. Anderson, "A simple neural network generating an interactive memory", *Mathematical
# Biosciences* 14, 1972. J. Schmidhuber, "Learning to control fast-weight memories", *Neural
# Computation* 4, 1992. I. Schlag, K. Irie, J. Schmidhuber, "Linear Transformers Are Secretly
# Fast Weight Programmers", ICML 2021. L. Welch, "Lower bounds on the maximum cross correlation
# of signals", *IEEE Trans. Information Theory* 20, 1974.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
