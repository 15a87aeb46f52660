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
# # Training at scale: Muon and QK-Clip
#
# Chapters 10 to 15 built the layers of Kimi's models. This chapter is about how the largest of
# them was trained. Kimi K2 (Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534)
# was trained on 15.5T tokens with *MuonClip*: the Muon optimiser (Keller Jordan, 2024; scaled
# up by Moonshot in "Muon is Scalable for LLM Training", arXiv 2502.16982) together with
# *QK-Clip*, a rescaling of the query and key weights that keeps every attention head's largest
# logit below a threshold $\tau = 100$.
#
# **In this chapter** you build Muon from scratch: why it orthogonalises the update, the
# Newton–Schulz iteration that does it without an SVD and its quintic coefficients, the
# momentum, and the shape-dependent learning-rate scale, checked against `torch.optim.Muon`;
# and Kimi K3's Per-Head Muon, which orthogonalises each attention head's block of the Q, K
# and V projections on its own. Then QK-Clip: the per-head maximum logit, the factor $\eta = \min(1, \tau / S_{\max})$, and
# how it is split between the query and key weights of multi-head attention and of MLA,
# checked on `tinyk3.layers`. Two experiments train a tiny MLA model on the course's corpus: at
# a learning rate high enough that the logits run away, with and without the clip; and Muon
# and Per-Head Muon against AdamW on the same budget. The library form of everything is
# `tinyk3.optim`.
#
# **Cost.** About a minute and a half on one CPU core (up to twice that on a slower machine),
# almost all of it in the eight training runs (the last cell prints the time); `SMOKE = True`
# runs in seconds.

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

from tinyk3 import checks, data, optim
from tinyk3.bench import stamp
from tinyk3.layers import MLAConfig, MultiHeadLatentAttention, SoftmaxAttention
from tinyk3.models import LM, LMConfig
from tinyk3.timing import time_fn
from tinyk3.train import evaluate_loss
from tinyk3.util import max_diff, moving_mean

STEPS_CLIP = 30 if SMOKE else 300  # steps of each run of the QK-Clip experiment
STEPS_CMP = 20 if SMOKE else 200  # steps of each run of Muon against AdamW
BATCH, BLOCK = (4, 32) if SMOKE else (16, 64)  # sequences per step, tokens per sequence
RESULTS = {}  # distances for the closing note

# %% [markdown]
# ## The idea: move every direction of a matrix alike
#
# A weight matrix $W \in \mathbb{R}^{m \times n}$ acts on its input through its singular
# directions. Its gradient $G = U \Sigma V^\top$ (a thin SVD, $\Sigma$ diagonal with the
# singular values $\sigma_1 \ge \sigma_2 \ge \dots$) is typically dominated by a few of them: a
# step along $G$ moves those few directions a lot and the rest hardly at all. Muon replaces
# the step by the nearest orthogonal matrix, the *polar factor*
#
# $$
# O = U V^\top = \arg\max_{\|O\|_2 \le 1} \langle G, O \rangle ,
# $$
#
# the steepest-descent direction when the size of a step is measured by its spectral norm
# $\|\cdot\|_2$ (its largest singular value): every singular value of the step is 1, so every
# direction the gradient points along moves by the same amount. (The maximum is
# $\langle G, UV^\top\rangle = \sum_i \sigma_i$.) The gradient of a real layer, from a tiny
# language model on the course's corpus:

# %%
corpus = data.encode(data.load_corpus())
train_data, val_data = data.split(corpus)


def tiny_config():
    """Two MLA layers (RoPE, Kimi K2's attention) in a 64-wide model over bytes."""
    mla = MLAConfig(n_head=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16)
    return LMConfig(vocab_size=data.VOCAB_SIZE, block_size=BLOCK, n_embd=64,
                    pattern="AA", mixers={"A": mla}, pos_emb=False, norm="rmsnorm",
                    tie_embeddings=False)


torch.manual_seed(0)
model = LM(tiny_config())
x, y = data.get_batch(train_data, BATCH, BLOCK, torch.Generator().manual_seed(0))
F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
G = model.transformer.h[0].mlp.c_fc.weight.grad  # [256, 64]
s = torch.linalg.svdvals(G)
U, _, Vh = torch.linalg.svd(G, full_matrices=False)
print(f"gradient of the first MLP's input matrix {list(G.shape)}: singular values from "
      f"{s.max():.2e} down to {s.min():.2e}; the top 3 of {len(s)} hold "
      f"{(s[:3] ** 2).sum() / (s ** 2).sum():.0%} of its squared norm")
print(f"U Vᵀ: singular values all 1 (max |σ - 1| "
      f"{max_diff(torch.linalg.svdvals(U @ Vh), torch.ones(len(s))):.1e}); "
      f"<G, U Vᵀ> = {(G * (U @ Vh)).sum():.4f} = sum of σ = {s.sum():.4f}")

# %% [markdown]
# ## Newton–Schulz: the polar factor without an SVD
#
# An SVD of every weight matrix at every step is slow on accelerators and hard to
# parallelise. Muon uses instead an odd matrix polynomial. For $X = U \Sigma V^\top$,
# $X X^\top X = U \Sigma^3 V^\top$, so
#
# $$
# \begin{gathered}
# p(X) = aX + b\,(XX^\top)X + c\,(XX^\top)^2 X = U\, p(\Sigma)\, V^\top, \\
# p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5 :
# \end{gathered}
# $$
#
# the singular vectors stay and each singular value goes through the scalar polynomial.
# Iterating $p$ drives the singular values towards a fixed point; if that point is 1, the
# iterates approach $U V^\top$. Start from $X_0 = G / \|G\|_F$ (the Frobenius norm is at
# least the largest singular value, so every $\sigma$ lies in $(0, 1]$), and write $Z = X
# X^\top$:
#
# $$
# X_{k+1} = a X_k + (b Z_k + c Z_k^2)\, X_k .
# $$
#
# The classical Newton–Schulz iteration is the cubic $(a, b, c) = (\tfrac32, -\tfrac12, 0)$:
# $p(1) = 1$ and $p'(1) = 0$, so it converges to 1 quadratically near it; but near 0 it only
# multiplies by $\tfrac32$ per step, so a small singular value takes many steps. Keller Jordan's
# quintic $(3.4445, -4.7750, 2.0315)$ takes the slope at 0 as large as possible, $a =
# 3.4445$, and gives up exact convergence: after five steps every $\sigma \in (0, 1]$ not too
# close to 0 lands in a band around 1, not on 1. Its one step in code (a tall matrix is done
# transposed, so that $Z$ is the smaller Gram matrix):

# %%
NS = (3.4445, -4.7750, 2.0315)


def ns_orthogonalise(G, steps=5, coefficients=NS, eps=1e-7):
    a, b, c = coefficients
    tall = G.shape[0] > G.shape[1]
    X = G.T if tall else G
    X = X / X.norm().clamp_min(eps)  # Frobenius: every singular value now <= 1
    for _ in range(steps):
        Z = X @ X.T  # the smaller Gram matrix: min(m, n) square
        X = a * X + (b * Z + c * Z @ Z) @ X  # = U p(Σ) Vᵀ
    return X.T if tall else X


def iterate(sigma, steps, coefficients=NS):
    a, b, c = coefficients
    for _ in range(steps):
        sigma = a * sigma + b * sigma ** 3 + c * sigma ** 5
    return sigma


G64 = G.double()
U, S, Vh = torch.linalg.svd(G64, full_matrices=False)
X = ns_orthogonalise(G64)
predicted = U @ torch.diag(iterate(S / G64.norm(), 5)) @ Vh
print(f"my Newton-Schulz vs U p⁵(Σ/‖G‖) Vᵀ from the SVD: max |diff| "
      f"{max_diff(X, predicted):.1e} (float64)")
print(f"my Newton-Schulz vs tinyk3.optim.newton_schulz: "
      f"{max_diff(X, optim.newton_schulz(G64)):.1e}")
sv = torch.linalg.svdvals(X)
start = S / G64.norm()  # the normalised singular values X₀ starts from
out = iterate(start, 5)  # each singular value of X, from its start
left = out < 0.6  # not lifted into the band
print(f"the gradient: {int((~left).sum())} of {len(S)} singular values end in "
      f"{out[~left].min():.3f} to {out[~left].max():.3f}"
      + (f"; {int(left.sum())} end below 0.6, all of which started below "
         f"{start[left].max():.1e} of the norm" if left.any() else ""))
gen = torch.Generator().manual_seed(0)
G_rand = torch.randn(256, 64, dtype=torch.float64, generator=gen)
U_r, _, Vh_r = torch.linalg.svd(G_rand, full_matrices=False)
CUBIC = (1.5, -0.5, 0.0)
for name, coeffs, steps in (("quintic", NS, 5), ("cubic", CUBIC, 5),
                            ("cubic", CUBIC, 10), ("cubic", CUBIC, 30)):
    Xr = ns_orthogonalise(G_rand, steps, coeffs)
    sr = torch.linalg.svdvals(Xr)
    dist_r = torch.linalg.matrix_norm(Xr - U_r @ Vh_r, 2)
    print(f"a random [256, 64], {name}, {steps:2d} steps: singular values "
          f"{sr.min():.3f} to {sr.max():.3f}, distance to U Vᵀ {dist_r:.1e}")
RESULTS["Newton-Schulz vs SVD prediction (float64)"] = max_diff(X, predicted)

# %% [markdown]
# The first line is the algebra above checked numerically: the iteration acts on singular
# values only. A singular value that starts very close to 0 (below about 0.0015 of the norm,
# printed under the figure below) is not lifted into the band in five steps; a gradient can have such
# values along the directions it hardly points in (the third line, for this one), and they
# add little to the update. A
# random matrix, whose normalised singular values all lie well above 0, lands entirely in the
# band after five quintic steps; Keller Jordan reports that this band, rather than the exact
# $U V^\top$, does not hurt training. The cubic reaches $U V^\top$ to round-off, but only
# after more steps than the quintic's five (the last lines: 10 and 30). The scalar maps side
# by side:

# %% mystnb={"figure": {"caption": "The scalar map applied to each singular value by Newton–Schulz, after 1, 2 and 5 steps, for the classical cubic (1.5, −0.5, 0) and Keller Jordan's quintic (3.4445, −4.7750, 2.0315), on the normalised singular values in (0, 1] (log axis). The shaded band is where the quintic's five steps land.", "name": "fig-newton-schulz-maps"}, "image": {"alt": "Two panels of output singular value against input singular value from 0.001 to 1 on a logarithmic axis. Left, the cubic: each step lifts the curve towards one, but after five steps inputs below about 0.1 are still well below one. Right, the quintic: after one step the curve peaks at 1.2 near 0.5; after five steps it oscillates between about 0.68 and 1.15, inside the shaded band, for every input above about 0.0015, and smaller inputs fall steeply below it."}}
fine = torch.logspace(-4, 0, 2000, dtype=torch.float64)
out5 = iterate(fine, 5)
LOW, HIGH = out5[fine > 5e-3].min().item(), out5[fine > 5e-3].max().item()  # the band
reach = fine[out5 >= LOW].min().item()  # from here up, five steps land in the band
sig = torch.logspace(-3, 0, 400, dtype=torch.float64)
fig, axes = plt.subplots(1, 2, figsize=(6.7, 2.9), sharey=True, layout="constrained")
for ax, (name, coeffs) in zip(axes, (("cubic", (1.5, -0.5, 0.0)), ("quintic", NS))):
    for steps in (1, 2, 5):
        label = f"{steps} step" + "s" * (steps > 1)
        ax.plot(sig, iterate(sig, steps, coeffs), label=label)
    ax.axhspan(LOW, HIGH, color="0.85", zorder=0)
    ax.set_xscale("log")
    ax.set_title(f"{name} {coeffs}", fontsize=9)
    ax.set_xlabel("σ / ‖G‖_F")
axes[0].set_ylabel("singular value after the steps")
axes[0].legend(fontsize=8)
plt.show()
print(f"quintic, 5 steps, inputs above 0.005: outputs {LOW:.3f} to {HIGH:.3f} (the "
      f"band); every input from {reach:.4f} up lands in it")

# %% [markdown]
# Why not just take the SVD: a timing of both on one matrix the size of a small model's MLP
# weight, float32, one CPU thread (median of the runs, `tinyk3.timing`):

# %%
print(stamp())
W_big = torch.randn((128, 512) if SMOKE else (512, 2048))
t_ns = time_fn(lambda: optim.newton_schulz(W_big), repeats=5, max_seconds=3)
t_svd = time_fn(lambda: torch.linalg.svd(W_big, full_matrices=False), repeats=5,
                max_seconds=3)
print(f"{list(W_big.shape)}: Newton-Schulz (5 steps) {t_ns.ms()} ms, "
      f"SVD {t_svd.ms()} ms, "
      f"ratio SVD / NS {float(t_svd) / float(t_ns):.1f}")

# %% [markdown]
# On a CPU, where both run on the same cores and LAPACK's SVD is well optimised, the ratio
# printed above is modest, and it varies from machine to machine. The case for Newton–Schulz
# is the accelerator: its fifteen matrix products (three per step) are what GPUs do fastest,
# they run in bf16, and they shard across devices, where an SVD is a sequential,
# high-precision algorithm.
#
# ## Momentum, and the learning-rate scale
#
# Muon orthogonalises not the raw gradient but a momentum of it. `torch.optim.Muon` (and
# `tinyk3.optim.Muon`) keep an exponential moving average and use its Nesterov form,
#
# $$
# \begin{gathered}
# M_t = \mu M_{t-1} + (1 - \mu)\, g_t, \\
# \hat M_t = (1 - \mu)\, g_t + \mu M_t, \\
# W_t = (1 - \mathrm{lr}\cdot \lambda)\, W_{t-1} - \mathrm{lr}\cdot s(m, n)\, \mathrm{NS}(\hat M_t),
# \end{gathered}
# $$
#
# with $\mu = 0.95$ and decoupled weight decay $\lambda$. Keller Jordan's original writes the
# momentum as a sum, $M_t = \mu M_{t-1} + g_t$ and $\hat M_t = g_t + \mu M_t$: that is $1/(1-\mu)$
# times the average, and since Newton–Schulz first divides by the norm, the two give the same
# update.
#
# The factor $s(m, n)$ sets the size. An $m \times n$ matrix whose $\min(m, n)$ singular
# values are all 1 has Frobenius norm $\sqrt{\min(m, n)}$, so its root-mean-square entry is
# $\sqrt{\min(m,n)/(mn)} = 1/\sqrt{\max(m, n)}$: the wider the matrix, the smaller each entry
# of an orthogonal update. Moonshot's scale $s = 0.2\sqrt{\max(m, n)}$ brings the RMS to 0.2,
# about that of an AdamW update, so Muon can reuse the learning rate and weight decay tuned for
# AdamW (arXiv 2502.16982); Keller Jordan's original $s = \sqrt{\max(1, m/n)}$ keeps the
# RMS at $1/\sqrt{n}$ and needs its own learning rate (0.02 in his runs):

# %%
for m_, n_ in ((64, 256), (256, 64), (7168, 2048)):
    Q, _ = torch.linalg.qr(torch.randn(max(m_, n_), min(m_, n_)))  # orthonormal columns
    O = Q if m_ >= n_ else Q.T  # [m, n], singular values 1
    rms = O.pow(2).mean().sqrt().item()
    print(f"[{m_:4d}, {n_:4d}]: RMS of an orthogonal update {rms:.4f} "
          f"(1/sqrt(max) = {1 / math.sqrt(max(m_, n_)):.4f}); "
          f"times 0.2 sqrt(max(m, n)): "
          f"{rms * optim.muon_lr_scale((m_, n_)):.3f}; times sqrt(max(1, m/n)): "
          f"{rms * optim.muon_lr_scale((m_, n_), 'original'):.4f}")

# %% [markdown]
# ## Muon from scratch, checked against `torch.optim.Muon`
#
# One step for a list of matrices, in the equations' order:

# %%
def muon_step_mine(params, grads, bufs, lr, mu=0.95, wd=0.0, ns_dtype=None):
    for W, g, M in zip(params, grads, bufs):
        M.mul_(mu).add_((1 - mu) * g)  # the moving average
        u = (1 - mu) * g + mu * M  # Nesterov
        O = ns_orthogonalise(u.to(ns_dtype or u.dtype)).to(W.dtype)
        W.mul_(1 - lr * wd)
        W.sub_(lr * 0.2 * math.sqrt(max(W.shape)) * O)


def compare(ns_dtype, steps=6, lr=0.02, wd=0.1):
    """Distance of my parameters to torch.optim.Muon's, relative to its total update."""
    g = torch.Generator().manual_seed(1)
    shapes = [(64, 32), (32, 96), (48, 48)]
    W0 = [torch.randn(s, generator=g) for s in shapes]
    mine = [w.clone() for w in W0]
    bufs = [torch.zeros_like(w) for w in W0]
    lib = [w.clone().requires_grad_() for w in W0]
    ref = [w.clone().requires_grad_() for w in W0]
    opt_lib = optim.Muon(lib, lr=lr, weight_decay=wd, ns_dtype=ns_dtype)
    opt_ref = torch.optim.Muon(ref, lr=lr, weight_decay=wd,
                               adjust_lr_fn="match_rms_adamw")
    for _ in range(steps):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, q, gr in zip(lib, ref, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        muon_step_mine(mine, grads, bufs, lr, wd=wd, ns_dtype=ns_dtype)
        opt_lib.step()
        opt_ref.step()

    def rel(ws):
        return max(((w - r.detach()).norm() / (r.detach() - w0).norm()).item()
                   for w, r, w0 in zip(ws, ref, W0))

    return rel(mine), rel([p.detach() for p in lib])


for name, dt in (("float32", None), ("bfloat16", torch.bfloat16)):
    d_mine, d_lib = compare(dt)
    RESULTS[f"Muon vs torch.optim.Muon, NS in {name}"] = d_lib
    print(f"Newton-Schulz in {name}: distance to torch.optim.Muon after 6 steps, "
          f"relative to its update: mine {d_mine:.1e}, tinyk3.optim.Muon {d_lib:.1e}")

# %% [markdown]
# `torch.optim.Muon` runs Newton–Schulz in bfloat16, whose 8-bit mantissa has a unit roundoff
# of $2^{-8} \approx 4 \times 10^{-3}$; through the fifteen matrix products of five steps that
# amounts to about $10^{-2}$ of the update. So in float32 both of ours sit at that distance
# from it (the first line): the stated tolerance of the library's test is $3 \times 10^{-2}$,
# and a wrong scale, sign or momentum would be off by order 1. With `ns_dtype=torch.bfloat16`
# the library performs the same operations in the same order as torch (fused `addmm`
# included) and agrees bit for bit on this machine; my version, in bf16 with separate
# operations, rounds differently and stays at the bf16 distance (the second line).

# %% [markdown]
# ## Per-Head Muon (Kimi K3)
#
# Kimi K3 trained with Muon too (and with Kimi K2's QK-Clip, the next section), but changed
# what Muon orthogonalises in attention. Its report
# (arXiv 2607.24653, §2.5, quoted by torchtitan's `models/kimi_k3/muon.py`): "instead of
# applying Newton-Schulz orthogonalization to the full Q, K, and V projection matrices, we
# partition their momentum matrices along the head dimension and orthogonalize each head's
# block separately." The output projection is not split: its head axis is on its input side.
#
# **The math.** A query projection $W_Q \in \mathbb{R}^{H d \times n}$ stacks one block of $d$
# rows per head, $W_Q = [W_1; \dots; W_H]$, and so does its momentum $M = [M_1; \dots; M_H]$.
# The full-matrix update $O = \operatorname{polar}(M) = UV^\top$ has every singular value 1 as a
# whole, but its head blocks $O_h = U_h V^\top$ have the singular values of $U_h$, the rows of
# $U$ that belong to head $h$: anywhere between 0 and 1, small for a head whose momentum is
# small beside the others'. Per head, $O_h = \operatorname{polar}(M_h)$ for each $h$: each
# block gets singular values 1, as if each head were a matrix of its own, whatever the other
# heads' gradients. On the first layer's query projection of the tiny model above (4 heads of
# 24 rows: 16 for the position-free part and 8 for the rope part):

# %%
attn0 = model.transformer.h[0].attn
Gq = attn0.q_proj.weight.grad.double()  # [H·(dn + dr), d] = [96, 64]
H_q = attn0.n_head
d_h = Gq.shape[0] // H_q
full = optim.newton_schulz(Gq)
per_head = optim.per_head_newton_schulz(Gq, H_q)
mine = torch.cat([ns_orthogonalise(block) for block in Gq.split(d_h)])  # one at a time
dist = max_diff(per_head, mine)
RESULTS["per-head Newton-Schulz vs a loop over heads (float64)"] = dist
print(f"per_head_newton_schulz against my loop over the {H_q} blocks: "
      f"max |diff| {dist:.1e}")
print(f"{'head':>6s}{'share of |G|²':>15s}{'full matrix: σ of the block':>30s}"
      f"{'per head: σ of the block':>27s}")
sv_full, sv_head = [], []
blocks = zip(Gq.split(d_h), full.split(d_h), per_head.split(d_h))
for h, (g_b, f_b, p_b) in enumerate(blocks):
    sf, sp = torch.linalg.svdvals(f_b), torch.linalg.svdvals(p_b)
    sv_full.append(sf)
    sv_head.append(sp)
    print(f"{h:>6d}{(g_b.norm() ** 2 / Gq.norm() ** 2).item():15.1%}"
          f"{sf.min().item():18.2f} to {sf.max().item():.2f}"
          f"{sp.min().item():17.2f} to {sp.max().item():.2f}")

# %% mystnb={"figure": {"caption": "The singular values of each head's block of the orthogonalised update of one query projection (the tiny MLA model's first layer, 4 heads of 24 rows), under full-matrix Newton\u2013Schulz (left) and Per-Head Muon (right), sorted, one line per head.", "name": "fig-per-head-muon"}, "image": {"alt": "Two panels of singular value against index from 1 to 24, one line per head. Left, full matrix: each head's line falls from about one to between 0.1 and 0.15, the four heads alike. Right, per head: all four lines lie between about 0.7 and 1.2 for every index."}}
fig, axes = plt.subplots(1, 2, figsize=(6.7, 2.9), sharey=True, layout="constrained")
panels = ((axes[0], sv_full, "full matrix"), (axes[1], sv_head, "per head"))
for ax, svs, title in panels:
    for h, sv in enumerate(svs):
        ax.plot(range(1, len(sv) + 1), sv, marker="o", ms=2, lw=1.2, label=f"head {h}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("singular value index")
axes[0].set_ylabel("σ of the head's block")
axes[1].legend(fontsize=8)
plt.show()

# %% [markdown]
# Under the full-matrix form the heads share one budget: this matrix has more rows (96) than
# columns (64), so its 64 singular values near 1 are shared out among the four blocks' 96
# directions, and each block's fall from about 1 to about 0.1 (left), the head with half the
# gradient's squared norm and those with a tenth of it alike. Per head, every block gets
# singular values in Newton–Schulz's band around 1 (right). The update is then
# larger as a whole (up to $\sqrt{H}$ times in RMS when the matrix has at least as many columns
# as rows; the ratio here is printed below). `tinyk3.optim.Muon` scales a per-head group by
# the block's shape, $0.2\sqrt{\max(d, n)}$, the scale a matrix of that shape would get, which
# gives each block the RMS a whole matrix gets under the plain form: 0.2 for an exact polar
# factor, a little less after Newton–Schulz's five steps (how K3 scales its blocks is not
# among what its readers quote):

# %%
for name, O, shape in (("full matrix", full, tuple(Gq.shape)),
                       ("per head", per_head, (d_h, Gq.shape[1]))):
    scaled = optim.muon_lr_scale(shape) * O
    print(f"{name:>12s}: update RMS {O.pow(2).mean().sqrt():.4f}, times "
          f"0.2·sqrt(max{shape}) = {optim.muon_lr_scale(shape):.2f}: "
          f"{scaled.pow(2).mean().sqrt():.3f}")

# %% [markdown]
# In training, `optim.muon_param_groups(model)` hands `Muon` the Q, K and V projections in
# groups that carry their head count (`optim.per_head_projections` lists them: in MLA the
# query projection and `kv_b_proj`, whose per-head blocks hold that head's key and value rows;
# the latent down-projections have no head axis) and every other matrix in a plain group; the
# second experiment below runs it beside plain Muon.
#
# ## QK-Clip: bounding the attention logits
#
# The logit of head $h$ for query $i$ and key $j$ is $S^h_{ij} = q^h_i \cdot k^h_j / \sqrt{d}$,
# with $q^h_i = W^h_q x_i$ and $k^h_j = W^h_k x_j$: *bilinear* in the two weight matrices. An
# update that grows both by a factor $1 + \epsilon$ grows the logits by $(1+\epsilon)^2$, and
# nothing in the loss stops a head from sharpening its softmax further. Kimi K2's report
# (arXiv 2507.20534) describes the logits of some heads growing past 1000 in a mid-scale run with Muon, and
# QK-Clip as its remedy: after each optimiser step, for each head, with $S^h_{\max}$ the
# largest logit the head produced in the step's forward pass,
#
# $$
# \eta_h = \min\!\big(1,\; \tau / S^h_{\max}\big), \qquad
# W^h_q \leftarrow \eta_h^{\alpha} W^h_q, \quad W^h_k \leftarrow \eta_h^{1-\alpha} W^h_k ,
# $$
#
# so that every logit of the head is multiplied by $\eta_h^\alpha \eta_h^{1-\alpha} = \eta_h$
# and its largest becomes $\tau$ ($\tau = 100$, $\alpha = \tfrac12$ for K2). A head at or below
# $\tau$ has $\eta_h = 1$ and is not touched. Clipping per head, rather than scaling every head
# by the worst one, leaves the well-behaved heads alone.
#
# **MLA.** In multi-head latent attention (chapter 13) the logit has two parts,
#
# $$
# S^h_{ij} = \big(q^{C,h}_i \cdot k^{C,h}_j + q^{R,h}_i \cdot k^{R}_j\big) / \sqrt{d_n + d_r},
# $$
#
# a content part whose key $k^{C,h} = W^h_{UK} c$ belongs to the head, and a rope part whose
# key $k^R$ is *shared by all heads*. Scaling $k^R$ would change every head, so it stays; the
# rope part is scaled through the query alone, by the full $\eta_h$. The content part is split
# as before. Per head $h$:
#
# | rows | factor |
# |---|---|
# | $q^C$ (the first $d_n$ of head $h$ in `q_b_proj`) | $\eta_h^{\alpha}$ |
# | $q^R$ (its last $d_r$) | $\eta_h$ |
# | $k^C$: $W_{UK}$ (the first $d_n$ of head $h$ in `kv_b_proj`) | $\eta_h^{1-\alpha}$ |
# | $v$: $W_{UV}$ (its last $d_v$), and the shared $k^R$ | 1 |
#
# Both parts of the logit are then multiplied by $\eta_h$ exactly. This is what Megatron-LM's
# `clip_qk` (`megatron/core/transformer/multi_latent_attention.py`) does to `linear_q_up_proj`
# (or `linear_q_proj`) and `linear_kv_up_proj`. In code, first the per-head maximum over the
# causal score matrix, recomputed from a layer's projections:

# %%
def max_logits_mine(layer, x):
    """S_max per head of an MLA layer on x [B, T, d] (causal)."""
    q_nope, q_rope = layer.queries(x)  # [B, H, T, dn], [B, H, T, dr]
    c, k_rope = layer.latents(x)  # [B, T, r], [B, T, dr]: the cache
    k_nope, _ = layer.expand(c)  # [B, H, T, dn]
    s = q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope[:, None].transpose(-1, -2)
    s = s * layer.scale  # [B, H, T, T]
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return s.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))


def clip_mla_mine(layer, s_max, tau=100.0, alpha=0.5):
    H, dn, dr, dv = (layer.n_head, layer.qk_nope_head_dim, layer.qk_rope_head_dim,
                     layer.v_head_dim)
    eta = torch.where(s_max > tau, tau / s_max, torch.ones_like(s_max))
    q_w = (layer.q_b_proj if layer.q_lora_rank else layer.q_proj).weight
    kv_w = layer.kv_b_proj.weight
    with torch.no_grad():
        q = q_w.view(H, dn + dr, -1)  # a view: writes go to the weight
        q[:, :dn] *= eta[:, None, None] ** alpha  # q_nope
        q[:, dn:] *= eta[:, None, None]  # q_rope: the full η
        kv = kv_w.view(H, dn + dv, -1)
        kv[:, :dn] *= eta[:, None, None] ** (1 - alpha)  # W_UK; W_UV untouched
    return eta


# %% [markdown]
# A check on an MLA layer with Kimi K2's head sizes (fewer heads, a narrower model), whose
# weights are scaled up until some heads exceed $\tau = 100$:

# %%
torch.manual_seed(0)
mla = MultiHeadLatentAttention(256, 8, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=384)
with torch.no_grad():
    for p in mla.parameters():
        p.mul_(3.3)
x_mla = torch.randn(2, 32, 256)
with torch.no_grad():
    before = max_logits_mine(mla, x_mla)
print(f"my maxima vs tinyk3.optim.attention_max_logits: max |diff| "
      f"{max_diff(before, optim.attention_max_logits(mla, x_mla)):.1e}")
print("S_max per head:", [round(v, 1) for v in before.tolist()])
snapshot = {k: v.clone() for k, v in mla.state_dict().items()}
eta = clip_mla_mine(mla, before, tau=100.0)
with torch.no_grad():
    after = max_logits_mine(mla, x_mla)
over = before > 100.0
print(f"η: {[round(v, 3) for v in eta.tolist()]}")
print(f"heads over τ ({int(over.sum())}): after the clip max |S_max - τ| "
      f"{max_diff(after[over], torch.full_like(after[over], 100.0)):.1e}; every head "
      f"<= τ (to rounding): {bool((after <= 100.0 * (1 + 1e-6)).all())}")
print(f"heads at or below τ: S_max unchanged bit for bit "
      f"{torch.equal(after[~over], before[~over])}")
changed = [k for k in snapshot if not torch.equal(snapshot[k], mla.state_dict()[k])]
print(f"tensors changed: {changed}")
ref = MultiHeadLatentAttention(256, 8, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=384)
ref.load_state_dict(snapshot)
optim.qk_clip_(ref, before, tau=100.0)
dist = max(max_diff(a, b) for a, b in zip(ref.state_dict().values(),
                                          mla.state_dict().values()))
RESULTS["my MLA clip vs tinyk3.optim.qk_clip_ (weights)"] = dist
print(f"my clip vs tinyk3.optim.qk_clip_: max |weight diff| {dist:.1e}")

# %% [markdown]
# The heads over $\tau$ end at $\tau$ up to float32 rounding; the others, and every tensor but
# the two projections, are untouched (the lines above). On plain multi-head attention,
# `tinyk3.optim.qk_clip_` scales head $h$'s rows of `q_proj` and `k_proj`, biases included, by
# $\sqrt{\eta_h}$ each:

# %%
torch.manual_seed(1)
mha = SoftmaxAttention(64, 4)
with torch.no_grad():
    for p in mha.parameters():
        p.mul_(6.0)
x_mha = torch.randn(2, 32, 64)
m_before = optim.attention_max_logits(mha, x_mha)
tau_mha = float(m_before.median())  # half the heads over
eta_mha = optim.qk_clip_(mha, m_before, tau_mha)
m_after = optim.attention_max_logits(mha, x_mha)
over = m_before > tau_mha
print(f"MHA, τ = {tau_mha:.1f}: S_max {[round(v, 1) for v in m_before.tolist()]} -> "
      f"{[round(v, 1) for v in m_after.tolist()]}; below τ unchanged bit for bit "
      f"{torch.equal(m_after[~over], m_before[~over])}")

# %% [markdown]
# One caution on what the clip assumes: the logit must be linear in each weight it scales.
# That holds for these layers, but not where a nonlinearity sits between the projection and
# the logit (a short convolution with SiLU on q and k) or where q and k are RMS-normalised
# (Qwen3-Next's gated attention, chapter 12, whose norms bound the logits through their own
# weights): the library refuses those layers rather than clip them wrongly.
#
# Why not normalise q and k in MLA too, as Qwen3-Next does? A norm on the keys needs each
# head's keys, and absorbed decoding (chapter 13) never forms them: it folds $W^h_{UK}$ into
# the query and attends over the cached latent, so a norm between $W^h_{UK}$ and the logit
# would break the absorption. The K2 report gives this reason for QK-Clip: it acts on the
# weights, so the absorbed path is untouched.
#
# ## Experiment 1: a learning rate at which the logits run away
#
# The tiny model of the first section (two MLA layers with RoPE, 64 wide, byte tokens) trains
# on windows of the course's corpus. Muon updates the hidden matrices (`q_a_proj`, `q_b_proj`,
# `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj` and the MLPs'); AdamW the embedding, the head and
# the norms (`tinyk3.optim.split_params_for_muon`). Both at the same constant learning rate
# (the AdamW half too runs at the high rate below), no warm-up and no weight decay, so that
# nothing but the clip holds the weights back. `tinyk3.optim.QKClip`
# records each head's largest logit during the forward pass (a hook that recomputes the scores)
# and, if asked, clips after the step:

# %%
def train(optimiser, lr, steps, tau=None, seed=0):
    """Per-step training loss and largest logit (over layers and heads, in the step's
    forward pass); the final validation loss. optimiser: "muon", "muon per head" (Kimi
    K3's Per-Head Muon on the Q, K and V projections) or "adamw"."""
    torch.manual_seed(seed)
    model = LM(tiny_config())
    if optimiser.startswith("muon"):
        per_head = optimiser == "muon per head"
        groups, rest = optim.muon_param_groups(model, per_head=per_head)
        opts = [optim.Muon(groups, lr=lr),
                torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)]
    recorder = optim.QKClip(model, tau=tau or math.inf)
    g = torch.Generator().manual_seed(seed)
    losses, max_logits, step_norms = [], [], []
    attn = model.transformer.h[0].attn  # the first layer's query and key weights
    model.train()
    for _ in range(steps):
        x, y = data.get_batch(train_data, BATCH, BLOCK, g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        before = attn.q_proj.weight.detach().clone()
        for opt in opts:
            opt.step()
        step_norms.append(spectral(attn.q_proj.weight.detach() - before))
        losses.append(loss.item())
        max_logits.append(recorder.largest())
        if tau is not None:
            recorder.clip_()  # rescale the heads over τ, then start a new record
        else:
            recorder.reset()
    recorder.remove()
    val = evaluate_loss(model, val_data, BATCH, BLOCK, n_batches=8)
    return dict(loss=losses, max_logit=max_logits, val=val,
                step=sum(step_norms) / steps,  # the mean ‖ΔW_q‖₂ of one step
                q=spectral(attn.q_proj.weight), k=spectral(attn.kv_b_proj.weight))


def spectral(w):
    """The largest singular value of a weight, ‖W‖₂."""
    return torch.linalg.matrix_norm(w.detach().float(), 2).item()


LR_HIGH, TAU = 0.08, 100.0
t0 = time.perf_counter()
runs_clip = {"no clip": train("muon", LR_HIGH, STEPS_CLIP),
             f"QK-Clip, τ = {TAU:g}": train("muon", LR_HIGH, STEPS_CLIP, tau=TAU)}
print(f"{len(runs_clip)} runs of {STEPS_CLIP} steps in "
      f"{time.perf_counter() - t0:.0f} s; the model has "
      f"{LM(tiny_config()).num_parameters():,} parameters")
for name, r in runs_clip.items():
    last = max(1, STEPS_CLIP // 10)
    print(f"{name:>15s}: largest logit at the end {r['max_logit'][-1]:8.1f} (peak "
          f"{max(r['max_logit']):8.1f}); train loss, last {last} steps "
          f"{sum(r['loss'][-last:]) / last:.3f}; validation loss {r['val']:.3f}")

# %% mystnb={"figure": {"caption": "Training the tiny two-layer MLA model with Muon at a high constant learning rate (0.08), without and with QK-Clip at τ = 100: the largest attention logit over all heads in each step's forward pass (top, log axis) and the training loss, averaged over 10 steps (bottom). One seed.", "name": "fig-qk-clip-training"}, "image": {"alt": "Two panels against training steps. Top, on a logarithmic axis: without the clip the largest logit climbs steadily past one hundred into the thousands; with the clip it rises like the other until it reaches about one hundred and then stays near that level, with small excursions above it. Bottom: the two training-loss curves, which fall together at first; the numbers printed above the figure give where each ends."}}
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.7, 5.0), sharex=True,
                               layout="constrained")
for name, r in runs_clip.items():
    steps = range(1, len(r["loss"]) + 1)
    ax1.plot(steps, r["max_logit"], label=name, lw=1.3)
    ax2.plot(steps, moving_mean(r["loss"]), label=name, lw=1.3)
ax1.axhline(TAU, color="k", lw=0.6, ls=":")
ax1.set_yscale("log")
ax1.set_ylabel("largest logit")
ax2.set_ylabel("training loss (mean of 10)")
ax2.set_xlabel("step")
ax1.legend(fontsize=8)
ax1.set_title(f"Muon at lr {LR_HIGH}, with and without QK-Clip", fontsize=10)
plt.show()

# %% [markdown]
# Without the clip the largest logit keeps growing, by orders of magnitude over the run; with
# it, it stops at about $\tau$. The recorded value is the logit of the forward pass *before*
# that step's update, so a step can push a head somewhat past $\tau$ before it is clipped
# back (the excursions above the dotted line). The loss lines and the numbers printed above
# compare how the two runs train; with one seed each, a gap between them is not evidence
# that the clip trains better (see below).
#
# What this run can and cannot show. It shows the mechanism: a learning rate at which the
# logits grow without bound, and a clip that holds them at $\tau$ while training continues.
# It cannot show what Kimi K2's report is about: at 1T parameters a run is too expensive to
# restart, and the failure the clip prevents there is a loss spike that appears after many
# thousands of steps; a model of the size printed above at a learning rate chosen to be too
# high is a caricature of that, and a single seed cannot separate "trains better" from noise. $\tau =
# 100$ is also K2's value for its own scale; here it happens to fall inside the range these
# runs reach, which is why it was kept.
#
# ## Experiment 2: Muon against AdamW on the same budget
#
# The same model, the same batches, the same number of steps, at four learning rates for
# AdamW and five for Muon (with Moonshot's scale, Muon is meant to share AdamW's learning rates), no clip;
# Muon in both forms, K2's (every matrix whole) and K3's (the Q, K and V projections per
# head):

# %%
OPTIMISERS = ("adamw", "muon", "muon per head")
# Muon one step further: its best lay at the top of the four
LRS = {opt: [1e-3, 3e-3, 1e-2, 3e-2] + ([] if opt == "adamw" else [1e-1])
       for opt in OPTIMISERS}
t0 = time.perf_counter()
runs_cmp = {(opt, lr): train(opt, lr, STEPS_CMP)
            for opt in OPTIMISERS for lr in LRS[opt]}
print(f"{len(runs_cmp)} runs of {STEPS_CMP} steps in {time.perf_counter() - t0:.0f} s")
for (opt, lr), r in runs_cmp.items():
    print(f"{opt:>13s}, lr {lr:g}: validation loss {r['val']:.3f}, "
          f"largest logit at the end {r['max_logit'][-1]:.1f}")
best = {opt: min((r["val"], lr) for (o, lr), r in runs_cmp.items() if o == opt)
        for opt in OPTIMISERS}
print("best of each: " + ", ".join(f"{opt} {v:.3f} (lr {lr:g})"
                                   for opt, (v, lr) in best.items()))
print(f"AdamW minus Muon {best['adamw'][0] - best['muon'][0]:+.3f}, Muon minus "
      f"Per-Head Muon {best['muon'][0] - best['muon per head'][0]:+.3f} nats per byte")

# %% mystnb={"figure": {"caption": "The tiny MLA model trained with AdamW, Muon and Per-Head Muon (AdamW for the embedding, head and norms in both Muon runs) at constant learning rates from 0.001 to 0.03 (AdamW) or 0.1 (Muon), on the same batches and budget, one seed. Left: validation loss at the end. Right: the largest attention logit at the end (log axis).", "name": "fig-muon-vs-adamw"}, "image": {"alt": "Two panels against the learning rate from 0.001 to 0.1 on a logarithmic axis, one line with markers per optimiser: AdamW dashed, Muon solid, Per-Head Muon dash-dotted. Left, validation loss: each line has its own lowest point, given in the printed lines above. Right, the largest logit at the end, rising with the learning rate for every optimiser."}}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.7, 3.0), layout="constrained")
for opt in OPTIMISERS:
    line = {"muon": "-", "muon per head": "-.", "adamw": "--"}[opt]
    style = dict(ls=line, marker="o", ms=4, label=opt)
    ax1.plot(LRS[opt], [runs_cmp[opt, lr]["val"] for lr in LRS[opt]], **style)
    ax2.plot(LRS[opt], [runs_cmp[opt, lr]["max_logit"][-1] for lr in LRS[opt]], **style)
ax1.set(xscale="log", xlabel="learning rate", ylabel="validation loss")
ax2.set(xscale="log", yscale="log", xlabel="learning rate", ylabel="largest logit, end")
ax1.legend(fontsize=8)
plt.show()

# %% [markdown]
# The best-of-each line compares the best run of each optimiser, from a grid wide enough that
# no best run sits at its end (the printed lines show it); with one seed per run, that is one
# draw, not a measured gap. Moonshot reports about twice
# the compute efficiency of AdamW at compute-optimal training (arXiv 2502.16982, its
# scaling-law fits); a comparison this small can at most suggest whether the orthogonalised
# update also helps a tiny model in its first few hundred steps, at untuned constant learning
# rates and one seed. It does not measure the ratio, nor what happens with a schedule, weight
# decay, or tuned AdamW hyper-parameters at the same cost. The same holds for Per-Head Muon
# against Muon: a model of four heads per layer and one seed cannot show what K3's report
# attributes to it at 96 heads; what this run shows is that it trains, through the same loop,
# with nothing else changed.
#
# **Why would Muon drive the logits up?** A logit is bounded by the weights that form it:
# $|q_i \cdot k_j| \le \lVert W_q \rVert_2 \lVert W_k \rVert_2 \lVert x_i \rVert \lVert x_j \rVert$
# (for MLA, $W_k$ the key rows of `kv_b_proj` and $x_j$ the latent), so the logits grow as the
# two weights' largest singular values grow. Muon's step has every singular value equal: its
# spectral norm is the learning rate times Moonshot's scale, $0.2\sqrt{\max(m, n)}$, whatever
# the gradient, and it moves the weight in every direction the gradient points along, the weak
# ones too. AdamW's elementwise step has no such fixed size. The runs above, at one learning
# rate, side by side: the average spectral norm of one step's update to the first layer's
# query weight, and the two weights' spectral norms and the largest logit at the end:

# %%
LR_SHOWN = 1e-2
for opt in OPTIMISERS:
    r = runs_cmp[opt, LR_SHOWN]
    print(f"{opt:>13s}, lr {LR_SHOWN:g}: one step's ‖ΔW_q‖₂ {r['step']:.3f}; at the "
          f"end ‖W_q‖₂ {r['q']:.2f}, ‖W_kv_b‖₂ {r['k']:.2f}, largest logit "
          f"{r['max_logit'][-1]:.1f}")
q_shape = LM(tiny_config()).transformer.h[0].attn.q_proj.weight.shape
print(f"Muon's step by construction, W_q {list(q_shape)}: lr · 0.2·√max(m, n) = "
      f"{LR_SHOWN * optim.muon_lr_scale(q_shape):.3f}, times Newton-Schulz's band "
      f"({LOW:.2f} to {HIGH:.2f})")

# %% [markdown]
# In this tiny model, at the same learning rate, the comparison goes the other way from the
# K2 story: AdamW's steps are the larger in spectral norm (the first lines), its weights grow
# more, and its logits end the larger. Muon's step is the fixed size printed last, whatever
# the gradient. What the bound explains is the mechanism K2's
# report meets at scale: with Muon every step moves the query and key weights by a fixed
# spectral amount in all their directions at once, a 1T-parameter run takes hundreds of
# thousands of such steps, and nothing in the loss stops a head from sharpening its softmax;
# the report found the logits of some heads growing past 1000 with Muon. Which optimiser grows
# logits faster depends on the learning rates, the model and the data; QK-Clip caps the
# result whichever it is.
#
# ## Exercises
#
# ```{exercise} The largest logit under QK-Norm
# :label: ex-qk-norm-max-logit
#
# The library refuses to clip a layer that normalises q and k (the caution above). Find out
# why it would be pointless. One head of such a layer computes $q = \operatorname{RMSNorm}(W_q
# x) \odot \gamma_q$ and $k = \operatorname{RMSNorm}(W_k x') \odot \gamma_k$ (no epsilon, no
# rotation in between; $W_q, W_k \in \mathbb{R}^{d \times d_{\text{model}}}$ of full rank
# $d$) and the logit $q \cdot k / \sqrt d$. Write `max_logit(W_q, W_k, gamma_q, gamma_k)`:
# the largest logit any inputs $x, x'$ can produce, as a float. The cases include gains at
# their initial value 1, weights a thousand times too large, and a negative gain.
# ```

# %%
def max_logit_mine(W_q, W_k, gamma_q, gamma_k):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("qk_norm.max_logit", max_logit_mine)

# %% [markdown]
# ```{solution-start} ex-qk-norm-max-logit
# :class: dropdown
# ```
#
# RMSNorm divides $W_q x$ by its root-mean-square, so $\hat q$ has length exactly $\sqrt d$:
# the weights choose its direction and nothing else. The logit is
# $\sum_j \gamma_{q,j}\gamma_{k,j}\hat q_j \hat k_j / \sqrt d$, largest when both vectors
# put their whole length on the channel with the largest $|\gamma_{q,j}\gamma_{k,j}|$:
# $\sqrt d \max_j |\gamma_{q,j}\gamma_{k,j}|$. Scaling $W_q$ and $W_k$, which is all QK-Clip
# does, cannot change it; only the gains can. (With RoPE between the norm and the product,
# rotations mix the channels in pairs and the bound becomes $\sqrt d \max|\gamma_q|
# \max|\gamma_k|$ at most: still free of the weights.)

# %%
def max_logit_solution(W_q, W_k, gamma_q, gamma_k):
    d = gamma_q.shape[0]
    return d ** 0.5 * (gamma_q * gamma_k).abs().max().item()


ok = checks.run("qk_norm.max_logit", max_logit_solution)

# Through a head itself: inputs solved to put q̂ and k̂ on the best channel reach the
# bound, 10,000 random pairs stay below it, and QK-Clip's scaling changes neither.
d, d_model = 64, 256
gen = torch.Generator().manual_seed(0)
f64 = torch.float64
W_q, W_k = (torch.randn(d, d_model, generator=gen, dtype=f64) for _ in range(2))
g_q, g_k = (1 + 0.2 * torch.randn(d, generator=gen, dtype=f64) for _ in range(2))


def head_logit(W_q, W_k, x, x2):
    q = torch.nn.functional.rms_norm(x @ W_q.T, (d,), g_q, eps=0.0)
    k = torch.nn.functional.rms_norm(x2 @ W_k.T, (d,), g_k, eps=0.0)
    return (q * k).sum(-1) / d ** 0.5


j = (g_q * g_k).abs().argmax()
e_j = torch.zeros(d, dtype=f64)
e_j[j] = 1.0
x_best = torch.linalg.pinv(W_q) @ e_j  # W_q x = e_j
x2_best = torch.linalg.pinv(W_k) @ (e_j * torch.sign(g_q[j] * g_k[j]))
xs = torch.randn(10_000, d_model, generator=gen, dtype=f64)
print(f"bound: {max_logit_solution(W_q, W_k, g_q, g_k):.4f}")
for eta in (1.0, 0.01):  # QK-Clip's factor, split as sqrt(eta) on each weight
    Wq, Wk = W_q * eta ** 0.5, W_k * eta ** 0.5
    reached = head_logit(Wq, Wk, x_best, x2_best).item()
    sampled = head_logit(Wq, Wk, xs, xs.roll(1, 0)).abs().max().item()
    print(f"eta = {eta:4}: solved inputs {reached:.4f}, largest of 10,000 random "
          f"pairs {sampled:.4f}")

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} QK-Clip's row scales for MLA
# :label: ex-qk-clip-mla-scales
#
# Write `mla_scales(max_logits, tau, alpha, dn, dr, dv)`: for an MLA layer of `H` heads whose
# largest logits were `max_logits [H]`, return `(q_scale, kv_scale)`, the factors by which
# QK-Clip multiplies the rows of `q_b_proj` (`H·(dn + dr)` rows: per head `dn` nope rows,
# then `dr` rope rows) and of `kv_b_proj` (`H·(dn + dv)` rows: per head `dn` rows of
# $W_{UK}$, then `dv` of $W_{UV}$), in `max_logits`' dtype. A head at or below `tau` keeps
# the factor 1 everywhere. Some cases use $\alpha \ne \tfrac12$.
# ```

# %%
def mla_scales_mine(max_logits, tau, alpha, dn, dr, dv):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("qk_clip.mla_scales", mla_scales_mine)

# %% [markdown]
# ```{solution-start} ex-qk-clip-mla-scales
# :class: dropdown
# ```

# %%
def mla_scales_solution(max_logits, tau, alpha, dn, dr, dv):
    H = max_logits.shape[0]
    eta = torch.where(max_logits > tau, tau / max_logits, torch.ones_like(max_logits))
    q = torch.cat([(eta ** alpha)[:, None].expand(H, dn),  # q_nope
                   eta[:, None].expand(H, dr)], dim=1)  # q_rope: the full η
    kv = torch.cat([(eta ** (1 - alpha))[:, None].expand(H, dn),  # W_UK
                    torch.ones(H, dv, dtype=eta.dtype)], dim=1)  # W_UV
    return q.reshape(-1), kv.reshape(-1)


ok = checks.run("qk_clip.mla_scales", mla_scales_solution)

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Muon updates a weight matrix by the orthogonalised momentum of its gradient, close to the
#   polar factor $UV^\top$: steepest descent under the spectral norm, every singular direction
#   of the step moved alike.
# - Newton–Schulz computes it with matrix products only: an odd polynomial
#   $aX + b(XX^\top)X + c(XX^\top)^2X$ acts on each singular value as $p(\sigma)$ and keeps the
#   singular vectors. After normalising by the Frobenius norm, the quintic $(3.4445, -4.7750,
#   2.0315)$ maps the singular values into a band around 1 in five steps; the cubic
#   $(1.5, -0.5, 0)$ converges to 1 exactly, but slowly from small values.
# - The momentum is an exponential moving average in its Nesterov form (the same update as a
#   summed momentum, since the iteration normalises first), and Moonshot's scale
#   $0.2\sqrt{\max(m, n)}$ gives the update an RMS of 0.2, like AdamW's. `tinyk3.optim.Muon`
#   agrees with `torch.optim.Muon` bit for bit with bf16 Newton–Schulz, and within bf16 rounding (about
#   $10^{-2}$ of the update) with float32.
# - QK-Clip rescales, after each step, the query and key weights of every head whose largest
#   logit exceeded $\tau$ (in MLA, where absorbed decoding never forms per-head keys, in place
#   of a norm on q and k), by $\eta = \tau / S_{\max}$ split as $\eta^\alpha$ and
#   $\eta^{1-\alpha}$; in MLA the rope query rows take the full $\eta$ because the rope key is
#   shared, and the values are untouched. Heads over $\tau$ end at $\tau$; the others are
#   unchanged bit for bit.
# - Kimi K3's Per-Head Muon orthogonalises the momentum of the Q, K and V projections one
#   head's block at a time (`optim.per_head_newton_schulz`): each block's singular values
#   land around 1, where the full-matrix form spreads one budget unevenly over the heads
#   (measured above); the output projection stays whole.
# - On a tiny MLA model at a learning rate too high for it, the largest logit grew by orders
#   of magnitude without the clip and stayed near $\tau$ with it; AdamW, Muon and Per-Head
#   Muon were compared over a grid of learning rates on the same small budget. A logit is
#   bounded by the spectral norms of its query and key weights, and Muon moves those by a
#   fixed spectral step in every direction; which optimiser grows them faster in a given run
#   is measured, not assumed. Both experiments are single-seed CPU runs: they show the
#   mechanisms, not their value at scale.
#
# The distances this run measured:

# %%
for key, value in RESULTS.items():
    print(f"{key:>48s}: {value:.1e}")

# %% [markdown]
# **Next.** Chapter 17 assembles Kimi K3 from its released configuration: KDA and gated MLA
# layers, attention residuals, a latent mixture of experts.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
