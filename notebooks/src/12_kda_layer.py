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
# # The KDA layer
#
# Chapter 11's operator takes $q, k, v, \beta$ and a gate per key channel and returns the
# read-outs; it says nothing about where those come from, or what happens to the read-outs. A
# layer of a model has to decide both. This chapter builds the layer that Kimi Linear uses in
# 20 of its 27 layers (Kimi Team, *Kimi Linear*, arXiv 2510.26692, and the model's released
# `config.json`), and Kimi K3 in 69 of its 93 (its released config), from the equations, and
# checks it piece by piece against `tinyk3.layers.KimiDeltaAttention`:
#
# - projections of the token to $q, k, v$, each through a short causal convolution of four taps
#   and SiLU, whose last inputs become part of the decoding state;
# - unit queries and keys and the $D_k^{-1/2}$ scale, $\beta = \sigma(\cdot)$, and the forget
#   gate in its two forms (Kimi Linear's softplus, Kimi K3's lower bound) from a low-rank
#   projection;
# - an RMSNorm of each head's read-out times a sigmoid output gate, low-rank in Kimi Linear and
#   full-rank in K3; more value heads than key heads where a config asks for them.
#
# Beside it stands Qwen3-Next's Gated DeltaNet layer, the same mechanism with other choices; both
# are checked against `transformers`' implementations. Then decoding: token by token through the
# convolution and state caches, and a prefill of any length followed by decoding, against the
# full forward. The experiment measures what a decoding step costs, in time and in memory, against
# a softmax layer's KV cache as the context grows, and computes the state's bytes at the sizes
# of Kimi Linear and K3.
#
# **Cost.** Well under a minute on one CPU core, most of it in the timing experiment (the last
# cell prints the time); `SMOKE = True` runs in a few seconds.

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
import numpy as np
import torch
import torch.nn.functional as F

from tinyk3 import bench, checks
from tinyk3.attention import causal_attention_sdpa
from tinyk3.layers import GatedDeltaNet, KimiDeltaAttention, KVState, SoftmaxAttention
from tinyk3.layers.base import state_nbytes
from tinyk3.models import presets
from tinyk3.ops import gated_delta_rule, kda
from tinyk3.timing import time_fn
from tinyk3.util import import_without_fla, max_diff, randomise_

F64 = torch.float64
T_DECODE = 24 if SMOKE else 48  # tokens of the decoding checks
CONTEXTS = [2**n for n in (range(8, 13) if SMOKE else range(8, 17))]  # 256 … 65,536
REPEATS = 3 if SMOKE else 7  # measured runs per timing (after one warm-up)


def randomise_gates_(layer, seed):
    """Give a fresh layer's gate parameters and norm weight random values, so that a
    check sees gates that decay strongly and weakly, and a norm weight that is not 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        A_log = torch.empty(layer.A_log.shape).uniform_(-1, 2.5, generator=gen)
        layer.A_log.copy_(A_log)
        layer.dt_bias.add_(torch.randn(layer.dt_bias.shape, generator=gen))
        norm = layer.o_norm if hasattr(layer, "o_norm") else layer.norm
        norm.weight.add_(0.2 * torch.randn(norm.weight.shape, generator=gen))
    return layer


# %% [markdown]
# ## The layer in equations
#
# One token $x_t \in \mathbb{R}^{1 \times d_{\text{model}}}$ (a row, like every vector here). The
# layer has $H$ key heads of $D_k$ and $H_v$ value heads of $D_v$ ($H_v = H$ in Kimi Linear and
# K3; $H_v = m H$ with grouped value heads, below). Per head:
#
# 1. **Projections and a short convolution.** $q_t = x_t W_q$, $k_t = x_t W_k$, $v_t = x_t W_v$
#    (no biases), then on every channel $c$ a causal filter over the last $K_{\text{conv}} = 4$
#    projected tokens and SiLU: $\tilde q_t[c] = \operatorname{silu}\big(\sum_{i=0}^{3}
#    w_q[c, i]\, q_{t-3+i}[c]\big)$, the same for $k$ and $v$ with their own filters.
# 2. **Unit queries and keys.** $q_t \leftarrow \tilde q_t / \lVert \tilde q_t \rVert \cdot
#    D_k^{-1/2}$, $k_t \leftarrow \tilde k_t / \lVert \tilde k_t \rVert$ (fla's $\ell_2$ norm,
#    $x / \sqrt{\lVert x \rVert^2 + 10^{-6}}$).
# 3. **Write strength and forget gate.** $\beta_t = \sigma(x_t W_\beta)$, one per head. A
#    pre-activation per key channel through a rank-$r$ bottleneck, $a_t = x_t W_{fa} W_{fb}$
#    ($r = D_k$ in Kimi Linear), and then one of the two gates of chapter 11, with a rate
#    $A = e^{A_{\log}}$ per head and a bias $\Delta_{\text{bias}}$ per channel:
#
#    $$
#    \begin{gathered}
#    g_t = -A \operatorname{softplus}(a_t + \Delta_{\text{bias}}) \;\text{(Kimi Linear)}, \\
#    g_t = -5\, \sigma\big(A\, (a_t + \Delta_{\text{bias}})\big) \;\text{(Kimi K3)} .
#    \end{gathered}
#    $$
# 4. **The operator** of chapter 11: $S_t = (I - \beta_t k_t^\top k_t)\operatorname{Diag}(e^{g_t})
#    S_{t-1} + \beta_t k_t^\top v_t$, $o_t = q_t S_t$.
# 5. **Output norm and gate.** $y_t = \big[\operatorname{RMSNorm}(o_t) \odot w_{\text{norm}}
#    \odot \sigma(u_t)\big] W_o$, concatenating the heads before $W_o$, with the output gate's
#    pre-activation $u_t = x_t W_{ga} W_{gb}$ (rank $r$, Kimi Linear) or $u_t = x_t W_g$ (full
#    rank, Kimi K3) and $w_{\text{norm}}$ the norm's weight, shared by the heads.
#
# Where do the parameters go? At the sizes of the two released models
# (`tinyk3.models.presets`, each with its source in the docstring), one KDA layer built on the
# `meta` device (shapes only, no memory), its parameters grouped by the step they serve:

# %%
GROUPS = {  # parameter name prefix -> the step it serves
    "q_proj": "1. q, k, v projections", "k_proj": "1. q, k, v projections",
    "v_proj": "1. q, k, v projections", "q_conv1d": "1. short convolutions",
    "k_conv1d": "1. short convolutions", "v_conv1d": "1. short convolutions",
    "b_proj": "3. β", "f_a_proj": "3. forget gate", "f_b_proj": "3. forget gate",
    "A_log": "3. forget gate", "dt_bias": "3. forget gate",
    "g_a_proj": "5. output gate", "g_b_proj": "5. output gate",
    "g_proj": "5. output gate",
    "o_norm": "5. output norm", "o_proj": "5. output projection W_o",
}
released = {"Kimi Linear 48B": presets.kimi_linear_48b(),
            "Kimi K3": presets.kimi_k3_mixers()}  # K3's mixers (chapter 17: the model)
counts = {}
for name, cfg in released.items():
    spec = next(s for s in cfg.layer_mixers if s.kind == "kda")
    with torch.device("meta"):
        layer = spec.build(cfg.n_embd)
    by_step = {}
    for pname, p in layer.named_parameters():
        step = GROUPS[pname.split(".")[0]]
        by_step[step] = by_step.get(step, 0) + p.numel()
    total = sum(by_step.values())
    assert total == spec.num_parameters(cfg.n_embd)  # the formula, against the layer
    counts[name] = (spec, cfg.n_embd, by_step, total)
    n_kda = sum(s.kind == "kda" for s in cfg.layer_mixers)
    print(f"{name}: {n_kda} of {len(cfg.layer_mixers)} layers KDA; d_model = "
          f"{cfg.n_embd}, {spec.n_head} heads of {spec.head_dim}, value heads "
          f"{spec.value_heads}, {spec.conv_size} taps, gate {spec.gate!r}, output gate "
          f"{spec.output_gate!r}, rank {spec.rank}")
steps = sorted({s for *_, by_step, _ in counts.values() for s in by_step})
print(f"\n{'':>28s}" + "".join(f"{n:>18s}" for n in counts))
for step in steps:
    cells = [f"{by[step] / 1e6:9.3f}M {by[step] / tot:6.1%}" if step in by else "-"
             for _, _, by, tot in counts.values()]
    print(f"{step:>28s}" + "".join(f"{c:>18s}" for c in cells))
print(f"{'total per layer':>28s}"
      + "".join(f"{tot / 1e6:>17.2f}M" for *_, tot in counts.values()))
for name, (spec, d, by, _) in counts.items():
    full = d * spec.value_heads * spec.head_dim  # a full-rank d → H·Dk forget gate
    print(f"{name}: a full-rank forget gate would hold {full / 1e6:.1f}M weights, "
          f"{full / by['3. forget gate']:.0f}x the low-rank one")

# %% [markdown]
# The projections into and out of the heads hold most of a layer. What makes KDA a per-channel
# gate, the forget gate, is a small share, because it passes through a bottleneck of rank
# $r = D_k$: a full-rank gate would be another projection the size of $W_q$ (the last lines). K3
# gives its output gate full rank, which costs exactly that: its output gate is the size of a
# fourth projection. The short convolutions and the norm hold a fraction of a percent. (K3's
# forget-gate rank is taken to be Kimi Linear's, $D_k$: the tensor shapes of the released
# checkpoint were not at hand to confirm it, as the preset's docstring says.)

# %% [markdown]
# ## Step by step, from a layer's own weights
#
# A small layer with random weights, in float64 so that every distance below is round-off:
# $d_{\text{model}} = 32$, two heads of $D_k = D_v = 8$, Kimi Linear's form. Each step is written
# from the equations, reading the weights out of the module, and checked against the method of
# `KimiDeltaAttention` that does the same.

# %%
torch.manual_seed(0)
d_small, H_small, D_small = 32, 2, 8
layer = KimiDeltaAttention(d_small, H_small, D_small, chunk_size=16)
layer = randomise_gates_(layer, seed=1)
layer = layer.double()
P = {name: p.detach() for name, p in layer.named_parameters()}  # the weights, by name
x = torch.randn(2, 21, d_small, dtype=F64)  # B = 2 sequences of T = 21 tokens
print({name: list(p.shape) for name, p in P.items()})

# %% [markdown]
# **1. The short convolution.** A depthwise filter: each channel $c$ has its own $K_{\text{conv}}$
# taps $w[c, 0], \dots, w[c, K_{\text{conv}} - 1]$, and the newest input meets the last tap
# ($F.conv1d$'s cross-correlation, as fla and `transformers` use it):
#
# $$
# y_t[c] = \operatorname{silu}\Big(\sum_{i=0}^{K_{\text{conv}}-1} w[c, i]\;
#   p_{t-K_{\text{conv}}+1+i}[c]\Big),
# $$
#
# with $p_t = 0$ before the first token. To continue a sequence later, the layer must keep the
# inputs the next window will need: the last $K_{\text{conv}} - 1$ projected tokens. That is the
# convolution's state, three tokens per channel here:

# %%
def short_conv(p, weight, past=None):
    """Depthwise causal convolution and SiLU. p [B, T, C], weight [C, K],
    past [B, C, K-1] (the K-1 inputs before p, oldest first; zeros at the start of a
    sequence). Returns y [B, T, C] and the new past, the last K-1 inputs."""
    B, T, C = p.shape
    K = weight.shape[-1]
    if past is None:
        past = p.new_zeros(B, C, K - 1)
    full = torch.cat([past, p.mT], dim=-1)  # [B, C, K-1+T]
    windows = full.unfold(-1, K, 1)  # window t: inputs t-K+1 … t     [B, C, T, K]
    y = F.silu((windows * weight[:, None, :]).sum(-1))  # [B, C, T]
    return y.mT, full[..., T:]  # [B, T, C], the last K-1 inputs [B, C, K-1]


p_q = x @ P["q_proj.weight"].T  # the projected queries, before the filter  [B, T, H·Dk]
y_mine, past_mine = short_conv(p_q, P["q_conv1d.weight"][:, 0])
with torch.no_grad():
    y_lib, past_lib = layer.q_conv1d(p_q)
print(f"short_conv against the layer's q_conv1d: max |y| diff "
      f"{max_diff(y_mine, y_lib):.1e}, state diff {max_diff(past_mine, past_lib):.1e}; "
      f"state = last 3 inputs: {torch.equal(past_mine, p_q[:, -3:].mT)}")

# %% [markdown]
# Causal, and short: output $t$ depends on inputs $t-3, \dots, t$ only, so a token sees its three
# predecessors directly, before any state is read (chapter 5 explains why that helps small models
# with associative recall). Changing one input changes exactly four outputs:

# %%
p_bumped = p_q.clone()
p_bumped[:, 10] += 1.0  # change token 10
y_bumped, _ = short_conv(p_bumped, P["q_conv1d.weight"][:, 0])
changed = ((y_bumped - y_mine).abs().amax(dim=(0, 2)) > 0).nonzero().flatten()
print(f"outputs changed by input 10: tokens {changed.tolist()}")

# %% [markdown]
# **2. Heads, unit vectors and the scale.** Split each of $q, k, v$ into heads, normalise $q$ and
# $k$ per head and token, and scale $q$ by $D_k^{-1/2}$. Unit keys are what the delta rule needs:
# with $\lVert k_t \rVert = 1$, $I - \beta_t k_t^\top k_t$ shrinks the direction $k_t$ by
# $1 - \beta_t$ and leaves the others alone (chapter 5); a longer key would overshoot. The
# operators do neither step themselves (the contract), so the layer does both:

# %%
def l2(x, eps=1e-6):
    """fla's l2norm over the last dimension: x / √(Σ x² + eps)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def heads(t, n):
    """[B, T, n·D] → [B, n, T, D]"""
    B, T, _ = t.shape
    return t.view(B, T, n, -1).transpose(1, 2)


def qkv_mine(layer, P, x, conv_state=None):
    """Steps 1 and 2: q, k [B, H, T, Dk] (unit, q scaled), v [B, HV, T, Dv] and the
    three convolution states."""
    H, HV, Dk = layer.n_head, layer.n_v_head, layer.head_dim
    past = conv_state or (None, None, None)
    outs, states = [], []
    for name, prev in zip("qkv", past):
        w_conv = P[f"{name}_conv1d.weight"][:, 0]  # [C, K]
        y, s = short_conv(x @ P[f"{name}_proj.weight"].T, w_conv, prev)
        outs.append(y)
        states.append(s)
    q, k, v = heads(outs[0], H), heads(outs[1], H), heads(outs[2], HV)
    return l2(q) * Dk**-0.5, l2(k), v, states


q, k, v, conv_states = qkv_mine(layer, P, x)
with torch.no_grad():
    q_lib, k_lib, v_lib, conv_lib = layer.qkv(x)
k_norm, q_norm = k.norm(dim=-1), q.norm(dim=-1) * D_small**0.5
print(f"q, k, v against layer.qkv: {max_diff(q, q_lib):.1e}, {max_diff(k, k_lib):.1e}, "
      f"{max_diff(v, v_lib):.1e}; norms of k: {k_norm.min():.6f} to "
      f"{k_norm.max():.6f}, of q·√Dk: up to {q_norm.max():.6f}")

# %% [markdown]
# The keys' norms sit a hair below 1: the $10^{-6}$ under the square root. `F.normalize` divides
# by $\max(\lVert x \rVert, 10^{-12})$ instead; the two differ by about $10^{-6} / (2\lVert x
# \rVert^2)$, which only matters for nearly zero vectors.
#
# **3. β and the forget gate.** Both from the token itself, not from the convolved $q$, $k$.
# One $\beta$ per head; a gate per key channel through the rank-$r$ bottleneck, then either form:

# %%
def gates_mine(layer, P, x):
    """Step 3: beta [B, HV, T] and the log decay g [B, HV, T, Dk]."""
    HV, Dk = layer.n_v_head, layer.head_dim
    beta = torch.sigmoid(x @ P["b_proj.weight"].T).mT  # one per value head   [B, HV, T]
    a = heads(x @ P["f_a_proj.weight"].T @ P["f_b_proj.weight"].T, HV)  # rank r inside
    z = a + P["dt_bias"].view(HV, 1, Dk)  # a_t + Δ_bias, per channel   [B, HV, T, Dk]
    A = P["A_log"].exp().view(HV, 1, 1)  # one rate per head
    if layer.gate == "softplus":  # Kimi Linear: −A softplus(z), unbounded below
        return beta, -A * F.softplus(z)
    return beta, -5 * torch.sigmoid(A * z)  # Kimi K3: in (−5, 0)


beta, g = gates_mine(layer, P, x)
with torch.no_grad():
    print(f"beta against layer.write_strength: "
          f"{max_diff(beta, layer.write_strength(x)):.1e}; g against layer.log_decay: "
          f"{max_diff(g, layer.log_decay(x)):.1e}")
torch.manual_seed(0)
layer_k3 = KimiDeltaAttention(d_small, H_small, D_small, gate="lower_bound",
                              output_gate="full", chunk_size=16)
layer_k3 = randomise_gates_(layer_k3, seed=2).double()
P_k3 = {name: p.detach() for name, p in layer_k3.named_parameters()}
_, g_k3 = gates_mine(layer_k3, P_k3, x)
with torch.no_grad():
    print(f"K3's form against its layer.log_decay: "
          f"{max_diff(g_k3, layer_k3.log_decay(x)):.1e}")
print(f"{'input scale':>11s} {'softplus: min g':>16s} {'share < -5':>11s} "
      f"{'lower bound: min g':>19s} {'share < -5':>11s}")
for scale in (1, 10, 30):  # the same tokens, larger pre-activations
    with torch.no_grad():
        g_soft, g_low = layer.log_decay(scale * x), layer_k3.log_decay(scale * x)
    print(f"{scale:11d} {g_soft.min():16.2f} {(g_soft < -5).double().mean():11.1%} "
          f"{g_low.min():19.4f} {(g_low < -5).double().mean():11.1%}")

# %% [markdown]
# With this layer's small random weights both gates are mild. Scale the tokens up, as training
# can make pre-activations large, and the softplus gate falls below $-5$ without bound, while
# the lower-bound gate saturates at $-5$ (the table). That bound is what keeps every 16-token
# sub-chunk of the chunked operator representable in float32 (chapter 11).
#
# **4 and 5. The operator, the output norm and the gate.** `kda.chunked` on what steps 2 and 3
# made, then per head $\operatorname{RMSNorm}(o_t) \odot w_{\text{norm}} \odot \sigma(u_t)$
# with the norm's $\epsilon$ (`layer.norm_eps`), the heads side by side, and $W_o$. The layer's
# `o_norm` is a `GatedRMSNorm` (`tinyk3.layers.kda`), which computes the norm and the gate in
# one module:

# %%
def output_mine(layer, P, o, x):
    """Step 5: o [B, HV, T, Dv] → y [B, T, d_model]."""
    B, HV, T, Dv = o.shape
    if layer.output_gate == "low_rank":  # Kimi Linear: x W_ga W_gb
        u = x @ P["g_a_proj.weight"].T @ P["g_b_proj.weight"].T
    else:  # Kimi K3: x W_g
        u = x @ P["g_proj.weight"].T
    o = o.transpose(1, 2)  # [B, T, HV, Dv]
    rms = torch.sqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm_eps)
    o = o / rms * P["o_norm.weight"] * torch.sigmoid(u.view(B, T, HV, Dv))
    return o.reshape(B, T, HV * Dv) @ P["o_proj.weight"].T


o, S = kda.chunked(q, k, v, beta, g, chunk_size=16)
y_step = output_mine(layer, P, o, x)
with torch.no_grad():
    y_layer, _ = layer(x)
print(f"steps 1-5 against layer(x): max |y| diff {max_diff(y_step, y_layer):.1e} "
      f"(outputs up to {y_layer.abs().max():.2f})")

# %% [markdown]
# Why a norm and a gate? The read-out $o_t = q_t S_t$ has whatever size the state has, and the
# state's size depends on how much has been written and forgotten; RMSNorm puts every head's
# read-out on one scale, token by token. The sigmoid output gate, computed from the token, then
# chooses per channel how much of it passes, between 0 and 1.
#
# **The whole layer.** The steps in one function, with the grouped value heads (GVA) that
# fla's layer offers as `num_v_heads`: $H_v = m H$ value heads, key head $i$ serving value heads
# $m i, \dots, m i + m - 1$. Queries and keys are repeated to the value heads; $\beta$, the
# gate and the state are per value head, so the state grows with $H_v$. Checked against
# `KimiDeltaAttention` in three forms:

# %%
def kda_layer_mine(layer, x, chunk_size=16):
    """A KimiDeltaAttention layer's forward from its weights: x [B, T, d] → y."""
    P = {name: p.detach() for name, p in layer.named_parameters()}
    q, k, v, _ = qkv_mine(layer, P, x)  # steps 1, 2
    m = layer.n_v_head // layer.n_head  # value heads per key head
    q, k = (t.repeat_interleave(m, dim=1) for t in (q, k))  # [B, HV, T, Dk]
    beta, g = gates_mine(layer, P, x)  # step 3
    o, _ = kda.chunked(q, k, v, beta, g, chunk_size=chunk_size)  # step 4
    return output_mine(layer, P, o, x)  # step 5


forms = {"Kimi Linear": dict(),
         "Kimi K3": dict(gate="lower_bound", output_gate="full"),
         "K3 with GVA, HV = 2H, Dv = 6": dict(gate="lower_bound", output_gate="full",
                                               n_v_head=4, v_head_dim=6)}
for name, kw in forms.items():
    torch.manual_seed(0)
    m = KimiDeltaAttention(d_small, H_small, D_small, **kw)
    m = randomise_gates_(m, seed=3).double()
    with torch.no_grad():
        y_lib, state = m(x)
    print(f"{name:>29s}: max |kda_layer_mine - KimiDeltaAttention| = "
          f"{max_diff(kda_layer_mine(m, x), y_lib):.1e}, state S {list(state.S.shape)}")

# %% [markdown]
# The layer is these five steps and nothing else. From here on the chapter uses
# `KimiDeltaAttention`; its `forward`:

# %%
tinyk3.notebook.show_source(KimiDeltaAttention.forward)

# %% [markdown]
# ## Qwen3-Next's Gated DeltaNet layer beside it
#
# Qwen3-Next (Qwen team, 2025; `transformers`' `Qwen3NextGatedDeltaNet`) builds its linear
# layers around chapter 10's gated delta rule, with the same skeleton: projections, a
# short convolution of four taps with SiLU, unit $q$ and $k$ with the $D_k^{-1/2}$ scale, $\beta =
# \sigma(\cdot)$, a softplus gate, the operator, a gated RMSNorm, an output projection. It makes
# other choices at almost every step:
#
# | step | Kimi Linear (KDA) | Kimi K3 (KDA) | Qwen3-Next (Gated DeltaNet) |
# |---|---|---|---|
# | projections | separate $W_q, W_k, W_v$ | the same | one fused `in_proj_qkvz` for $q, k, v$ and the output gate $z$, grouped by key head; one `in_proj_ba` for the pre-activations of $\beta$ and of the gate |
# | convolution | one filter per channel of $q, k, v$ | the same | the same, as one `conv1d` over $q, k, v$ side by side |
# | forget gate | per key channel, through rank $r = D_k$, softplus form | per key channel, rank $D_k$, lower bound $-5$ | one per head and token, a single column of `in_proj_ba`, softplus form |
# | output gate | $\sigma(x W_{ga} W_{gb})$, low rank | $\sigma(x W_g)$, full rank | $\operatorname{silu}(z)$, full rank, from the fused projection |
# | output norm | RMSNorm, weight $w$ (from 1) | the same | the same (its other norms are zero-centred, $1 + w$ from 0) |
# | heads | $H = H_v = 32$, $D_k = D_v = 128$ | $H = H_v = 96$, the same $D$ | 16 key heads, 32 value heads, $D = 128$ (`transformers`' defaults) |
#
# What follows from each:
#
# - **One gate per head or per channel** (chapters 10 and 11): Gated DeltaNet needs one number per
#   head and token, so a column of a projection is cheap; a gate per key channel needs $D_k$
#   numbers per head and token, and a full-rank projection for it would be as large as $W_q$,
#   hence Kimi's rank-$D_k$ bottleneck (the table of the first section).
# - **Sigmoid or SiLU.** $\sigma(u) \in (0, 1)$ can only attenuate a normalised read-out;
#   $\operatorname{silu}(z) = z\,\sigma(z)$ is unbounded above and can also amplify it or flip
#   its sign (for $z < 0$ it is negative).
# - **Fused and grouped.** One matrix product instead of four, and the layout puts everything one
#   key head needs, its $q$ and $k$ and the $v$ and $z$ of the value heads it serves, in one
#   contiguous block of rows: the projection splits into whole groups along the rows, for
#   example across devices by key heads.
# - **More value heads than key heads.** The state is $[H_v, D_k, D_v]$, so Qwen3-Next's 32 value
#   heads give 32 states while computing 16 key heads' $q$ and $k$.
#
# The grouping is the trap of loading such a layer. With two key heads, two value heads per key
# head and tiny heads, the rows of `in_proj_qkvz` are, in order:

# %%
def qkvz_rows(Hk, m, Dk, Dv):
    """What each output row of in_proj_qkvz is, key head by key head."""
    rows = []
    for i in range(Hk):  # key head i: [q_i | k_i | v of its m value heads | z of them]
        rows += [f"q{i}"] * Dk + [f"k{i}"] * Dk
        rows += [f"v{m * i + j}" for j in range(m) for _ in range(Dv)]
        rows += [f"z{m * i + j}" for j in range(m) for _ in range(Dv)]
    return rows


print(" ".join(qkvz_rows(Hk=2, m=2, Dk=2, Dv=1)))

# %% [markdown]
# Reading these rows as four plain blocks $[q \mid k \mid v \mid z]$ would be a different layer, of
# the same shapes and with no error raised. `GatedDeltaNet.split` undoes the grouping
# (`transformers`' `fix_query_key_value_ordering`). The layer from its weights, reusing
# `short_conv` and `l2`, checked against `tinyk3.layers.GatedDeltaNet` at $H_k = 2$, $H_v = 4$,
# $D_k = 8$, $D_v = 6$:

# %%
def gdn_layer_mine(layer, x, chunk_size=16):
    """Qwen3-Next's Gated DeltaNet layer from its weights: x [B, T, d] → y."""
    P = {name: p.detach() for name, p in layer.named_parameters()}
    B, T, _ = x.shape
    Hk, Hv, Dk, Dv = layer.n_head, layer.n_v_head, layer.head_dim, layer.v_head_dim
    m = Hv // Hk
    qkvz = (x @ P["in_proj_qkvz.weight"].T).view(B, T, Hk, 2 * Dk + 2 * m * Dv)
    q, k, v, z = qkvz.split([Dk, Dk, m * Dv, m * Dv], dim=-1)  # per key head
    b, a = (x @ P["in_proj_ba.weight"].T).view(B, T, Hk, 2 * m).split([m, m], dim=-1)
    q, k, v, z, b, a = (t.reshape(B, T, -1) for t in (q, k, v, z, b, a))  # in order
    c, _ = short_conv(torch.cat([q, k, v], dim=-1), P["conv1d.weight"][:, 0])  # one
    q, k, v = c.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k = l2(heads(q, Hk)) * Dk**-0.5, l2(heads(k, Hk))  # [B, Hk, T, Dk]
    q, k = (t.repeat_interleave(m, dim=1) for t in (q, k))  # [B, Hv, T, Dk]
    beta = torch.sigmoid(b).mT  # [B, Hv, T]
    g = -P["A_log"].exp()[:, None] * F.softplus(a + P["dt_bias"]).mT  # one per head
    o, _ = gated_delta_rule.chunked(q, k, heads(v, Hv), beta, g, chunk_size=chunk_size)
    o = o.transpose(1, 2)  # [B, T, Hv, Dv]
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm_eps)
    o = o * P["norm.weight"] * F.silu(z.view(B, T, Hv, Dv))  # SiLU output gate
    return o.reshape(B, T, Hv * Dv) @ P["out_proj.weight"].T


torch.manual_seed(0)
gdn = GatedDeltaNet(d_small, 2, 8, n_v_head=4, v_head_dim=6)
gdn = randomise_gates_(gdn, seed=4).double()
with torch.no_grad():
    y_gdn, _ = gdn(x)
print(f"max |gdn_layer_mine - GatedDeltaNet| = "
      f"{max_diff(gdn_layer_mine(gdn, x), y_gdn):.1e}")

# %% [markdown]
# ## Check: against `transformers`
#
# Both layers exist in `transformers`: `KimiLinearDeltaAttention` (`models/kimi_linear`) and
# `Qwen3NextGatedDeltaNet` (`models/qwen3_next`), with their own pure-PyTorch operators. Each
# builds offline at a tiny random configuration; `from_hf` copies its weights into ours (the Kimi
# layer keeps one `conv1d` over $q, k, v$, which `from_hf` splits), and the outputs are compared
# in float32, for a prompt longer than one chunk. Where `flash-linear-attention` is installed,
# `transformers` binds its GPU kernels when these modules are imported, so it is hidden during
# the import (`tinyk3.util.import_without_fla`). `transformers` is not a dependency of the course: without it, the cell says so.

# %%
def randomise_hf_(layer, seed):
    """Every parameter of a transformers layer random (its A_log and dt_bias start
    uninitialised): gates that decay strongly and weakly, a norm weight ≠ 1
    (`tinyk3.util.randomise_`, which the oracle tests use too)."""
    return randomise_(layer, seed, decay=(1, 16)).float().eval()


MODULES = {"kimi": "transformers.models.kimi_linear.modeling_kimi_linear",
           "qwen": "transformers.models.qwen3_next.modeling_qwen3_next"}
hf = {}
try:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # not the notices that fla's kernels are unused
except ImportError as err:
    print(f"transformers is not installed ({err}): skipping these checks "
          "(pip install transformers to run them)")
else:
    for key, module in MODULES.items():
        try:
            hf[key] = import_without_fla(module)
        except ImportError as err:  # an older transformers
            print(f"this transformers has no {module}: skipping its check ({err})")


def hf_pairs():
    """(name, transformers' layer, ours from_hf, this chapter's function) per oracle."""
    if "kimi" in hf:
        cfg = hf["kimi"].KimiLinearConfig(
            hidden_size=d_small, num_hidden_layers=1, num_attention_heads=2,
            layer_types=["linear_attention"],
            linear_attn_config={"head_dim": 8, "num_heads": 2,
                                "short_conv_kernel_size": 4})
        ref = randomise_hf_(hf["kimi"].KimiLinearDeltaAttention(cfg, layer_idx=0), 5)
        ours = KimiDeltaAttention.from_hf(ref)
        yield "KimiLinearDeltaAttention", ref, ours, kda_layer_mine
    if "qwen" in hf:
        Config = hf["qwen"].Qwen3NextConfig
        qd = Config()  # its defaults: Qwen3-Next-80B-A3B's linear layers
        print(f"Qwen3NextConfig's defaults: {qd.linear_num_key_heads} key heads and "
              f"{qd.linear_num_value_heads} value heads of {qd.linear_key_head_dim}, "
              f"d_model {qd.hidden_size}")
        cfg = Config(hidden_size=d_small, num_hidden_layers=1, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=8,
                     linear_value_head_dim=6, linear_conv_kernel_dim=4,
                     layer_types=["linear_attention"])
        ref = randomise_hf_(hf["qwen"].Qwen3NextGatedDeltaNet(cfg, layer_idx=0), 6)
        yield "Qwen3NextGatedDeltaNet", ref, GatedDeltaNet.from_hf(ref), gdn_layer_mine


hf_distances = {}
x32 = torch.randn(2, 70, d_small)  # T = 70: a chunk of 64 and a short one
with torch.no_grad():
    for name, ref, ours, mine in hf_pairs():
        y_ref = ref(x32)
        hf_distances[name] = max_diff(ours(x32)[0], y_ref)
        print(f"{name:>24s} (outputs up to {y_ref.abs().max():.1f}): "
              f"ours {hf_distances[name]:.1e}, this chapter's function "
              f"{max_diff(mine(ours, x32, chunk_size=64), y_ref):.1e}")

# %% [markdown]
# Float32 round-off on outputs of order one, for the library's layers and for this chapter's
# own functions alike. The tests (`tests/test_layers_kda.py`, `tests/test_layers_gated_deltanet.py`)
# assert the same at several lengths, chunk sizes and head shapes, and check what `transformers`
# lacks (K3's gate forms and grouped value heads in the Kimi layer) against a token loop written
# from the equations.

# %% [markdown]
# ## Decoding: the two caches
#
# For a prompt, the layer runs the chunked operator over all its tokens (its default `form`, on
# which `run_rule` in the `forward` above dispatches). To generate, it then takes one token at a
# time and must give the outputs the whole sequence would have given. It keeps, per layer, a
# state of fixed size, `KDAState(S, conv)`:
#
# - $S$, `[B, H_v, D_k, D_v]`, the operator's state after the last token (float32, as the
#   fused kernels keep it);
# - `conv`, the last $K_{\text{conv}} - 1 = 3$ projected tokens of $q$, $k$ and $v$, the inputs
#   the next convolution window needs.
#
# A single token goes through one step of `kda.recurrent` from $S$, whatever the `form`, and
# through the convolution from its state. **Token by token from the start**, against the full
# forward (chunked, one call), in float32, for Kimi Linear's form and for K3's with grouped value
# heads:

# %%
def decode_layers():
    """The two forms of the decoding checks, float32, d_model = 48, heads of 16."""
    layers = {}
    for name, kw in (("Kimi Linear", dict()),
                     ("K3 + GVA", dict(gate="lower_bound", output_gate="full",
                                       n_v_head=4))):
        torch.manual_seed(0)
        layer_ = KimiDeltaAttention(48, 2, 16, chunk_size=16, **kw)
        layers[name] = randomise_gates_(layer_, 7)
    return layers


dec_layers = decode_layers()
x_dec = torch.randn(1, T_DECODE, 48)
for name, m in dec_layers.items():
    with torch.no_grad():
        y_full, state_full = m(x_dec)
        state, ys = None, []
        for t in range(T_DECODE):
            y_t, state = m(x_dec[:, t : t + 1], state)
            ys.append(y_t)
    conv_diff = max(max_diff(a, b) for a, b in zip(state.conv, state_full.conv))
    y_diff = max_diff(torch.cat(ys, 1), y_full)
    print(f"{name:>11s}, T = {T_DECODE}: max |y| diff {y_diff:.1e}, S diff "
          f"{max_diff(state.S, state_full.S):.1e}, conv state diff {conv_diff:.1e}")
m = dec_layers["Kimi Linear"]
with torch.no_grad():
    last_q = (x_dec[:, -3:] @ m.q_proj.weight.T).mT  # the last 3 projected queries
print(f"the conv state of q is the last three projected tokens: "
      f"max diff {max_diff(state.conv.q, last_q):.1e}")

# %% [markdown]
# **A prefill of any length, then decoding.** The prompt (the first $n$ tokens) in one chunked
# call, every later token one at a time from the returned state. Prompts shorter than the
# convolution, one chunk exactly, one token past a chunk, most of the sequence:

# %%
splits = sorted({1, 2, 3, 16, 17, T_DECODE // 2 + 5, T_DECODE - 1})
for name, m in dec_layers.items():
    with torch.no_grad():
        y_full, _ = m(x_dec)
        dists = []
        for n in splits:
            y_pre, state = m(x_dec[:, :n])
            ys = [y_pre]
            for t in range(n, T_DECODE):
                y_t, state = m(x_dec[:, t : t + 1], state)
                ys.append(y_t)
            dists.append(max_diff(torch.cat(ys, 1), y_full))
    print(f"{name:>11s}: "
          + ", ".join(f"n = {n}: {e:.0e}" for n, e in zip(splits, dists)))
torch.manual_seed(0)
gdn32 = randomise_gates_(GatedDeltaNet(48, 2, 16, n_v_head=4, chunk_size=16), seed=8)
with torch.no_grad():
    y_full, _ = gdn32(x_dec)
    y_pre, state = gdn32(x_dec[:, :17])
    ys = [y_pre]
    for t in range(17, T_DECODE):
        y_t, state = gdn32(x_dec[:, t : t + 1], state)
        ys.append(y_t)
print(f"GatedDeltaNet, n = 17: {max_diff(torch.cat(ys, 1), y_full):.0e}")

# %% [markdown]
# Every split gives the full forward to float32 round-off: the state after a prompt is all the
# layer needs, whatever the prompt's length, chunk boundaries included. A prompt shorter than the
# convolution works too: its state is zero-padded, as the start of a sequence is.

# %% [markdown]
# ## Experiment: a decoding step against a KV cache
#
# A softmax layer decodes by appending the new token's key and value to its cache and reading
# the whole cache: memory and time per token grow with the context $T$. KDA's step reads and
# writes a state of fixed size. Both measured, at the same width: $d_{\text{model}} = 512$, four
# heads of 128 (Kimi's head size), batch 1, float32, on this CPU. For each context $T$:
#
# - **softmax, layer step**: `SoftmaxAttention` (GPT-2's attention of chapter 1 with chapter 2's
#   KV cache, as a library layer) with a KV cache of $T$ tokens, one token in; its step
#   projects, appends by copying the cache into a new tensor (the library's states are never
#   modified in place) and attends;
# - **softmax, the read alone**: only the attention of one query over the $T$ cached keys and
#   values, the part no cache layout avoids;
# - **KDA, layer step**: `KimiDeltaAttention` at one token from its state.
#
# The cache's values do not change the time, so it is filled with random numbers instead of a
# prefill of $T$ tokens; the KDA state is that of a short prompt, and the same size after any
# other. Times are medians of the runs (`tinyk3.timing`), bytes are measured from the state
# tensors the step returns (`tinyk3.layers.state_nbytes`). The cell prints its time.

# %%
t0 = time.perf_counter()
d_exp, H_exp = 512, 4
D_exp = d_exp // H_exp
torch.manual_seed(0)
softmax_layer = SoftmaxAttention(d_exp, H_exp)
kda_exp = KimiDeltaAttention(d_exp, H_exp, D_exp)
x_one = torch.randn(1, 1, d_exp)
rows = []
with torch.no_grad():
    _, kda_state = kda_exp(torch.randn(1, 64, d_exp))
    kda_bytes = {n: state_nbytes(kda_exp(torch.randn(1, n, d_exp))[1])
                 for n in (16, 64, 1024)}
    for T in CONTEXTS:
        cache = KVState(torch.randn(1, H_exp, T, D_exp),
                        torch.randn(1, H_exp, T, D_exp))
        q_one = torch.randn(1, H_exp, 1, D_exp)
        limit = dict(repeats=REPEATS, max_seconds=2.0)
        t_soft = time_fn(lambda c=cache: softmax_layer(x_one, c), **limit)
        t_read = time_fn(lambda q=q_one, c=cache: causal_attention_sdpa(q, c.k, c.v),
                         **limit)
        t_kda = time_fn(lambda: kda_exp(x_one, kda_state), **limit)
        _, new_cache = softmax_layer(x_one, cache)
        _, new_state = kda_exp(x_one, kda_state)
        rows.append((T, t_soft, t_read, t_kda, state_nbytes(new_cache),
                     state_nbytes(new_state)))
print(bench.stamp())
print(f"{'T':>7s} {'softmax step ms':>23s} {'read alone ms':>20s} {'KDA step ms':>16s} "
      f"{'KV cache':>10s} {'KDA state':>10s}")
for T, ts, tr, tk, bs, bk in rows:
    print(f"{T:7d} {ts.ms(2):>23s} {tr.ms(2):>20s} {tk.ms(2):>16s} "
          f"{bs / 2**20:7.2f}MiB {bk / 2**20:7.2f}MiB")
assert all(r[5] == kda_exp.state_numel(1) * 4 for r in rows)  # measured = formula
print(f"KDA state after prompts of 16, 64 and 1024 tokens and every step: "
      f"{sorted({*kda_bytes.values(), *(r[5] for r in rows)})} bytes")
apart = [ts.low > tk.high for _, ts, _, tk, _, _ in rows]  # KDA faster, quartiles apart
faster = [rows[i][0] for i in range(len(rows)) if all(apart[i:])]  # ...from here on
print(f"softmax step / KDA step: at T = {rows[0][0]} {rows[0][1] / rows[0][3]:.2f}x, "
      f"at T = {rows[-1][0]} {rows[-1][1] / rows[-1][3]:.1f}x (read alone: "
      f"{rows[-1][2] / rows[-1][3]:.1f}x); KDA faster, quartile ranges apart, at every "
      f"T from {faster[0] if faster else 'none, in this range'}")
per_token = 2 * d_exp * 4  # a key and a value of d_model float32 numbers
print(f"the KV cache holds {per_token} bytes per token; the KDA state equals the cache "
      f"of {rows[0][5] / per_token:.0f} tokens ({time.perf_counter() - t0:.0f} s)")

# %% mystnb={"figure": {"caption": "One decoding step of a layer of width 512 (four heads of 128, batch 1, float32, CPU) against the context length: left, the median time of a softmax layer's step with a KV cache, of the attention read alone, and of a KDA layer's step; right, the bytes of the state each step returns, measured from its tensors.", "name": "fig-kda-layer-decode-cost"}, "image": {"alt": "Two panels with logarithmic axes against the context length from 256 to 65,536 tokens. Left: the softmax layer's step time and the attention read alone rise with the context, roughly in proportion to it at long contexts, while the KDA layer's step time stays roughly flat; the softmax step starts below the KDA line at short contexts and ends far above it. Right: the KV cache's bytes rise in proportion to the context, already above the KDA state's constant line at 256 tokens and far above it at the end."}}
Ts = np.array([r[0] for r in rows])
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.8, 3.2))
lines = ((1, "softmax, layer step", "C0"), (2, "softmax, read alone", "C0"),
         (3, "KDA, layer step", "C1"))
for col, label, color in lines:
    med = np.array([float(r[col]) for r in rows]) * 1e3
    lo = np.array([r[col].low for r in rows]) * 1e3
    hi = np.array([r[col].high for r in rows]) * 1e3
    ls = ":" if col == 2 else "-"
    ax1.plot(Ts, med, ls, marker="o", ms=3, color=color, label=label)
    ax1.fill_between(Ts, lo, hi, color=color, alpha=0.2)
ax1.set(yscale="log", ylabel="time per token (ms)", title="Decode time")
ax1.legend(fontsize=7)
ax2.plot(Ts, [r[4] / 2**20 for r in rows], "-o", ms=3, color="C0", label="KV cache")
ax2.plot(Ts, [r[5] / 2**20 for r in rows], "-o", ms=3, color="C1", label="KDA state")
ax2.set(yscale="log", ylabel="state (MiB)", title="Memory of the state")
ax2.legend(fontsize=7)
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ts[::2], [f"{T // 1024}K" if T >= 1024 else str(T) for T in Ts[::2]])
    ax.minorticks_off()
    ax.set_xlabel("context T (tokens)")
plt.tight_layout()
plt.show()

# %% [markdown]
# The printed table, read:
#
# - **Memory** is the clean result: the KV cache grows by a key and a value per token, the KDA
#   state not at all. It is the same size after a prompt of 16 tokens or a thousand, and equals
#   the cache of only about $D/2$ tokens ($H D^2$ numbers in $S$ against $2 H D$ per cached
#   token; the last line): from there on every token of context is memory a softmax layer needs
#   and KDA does not.
# - **Time.** At the shortest context the KDA step is the slower one here (the first ratio
#   printed): its extra projections (two low-rank gates and $\beta$) and the $D_k \times D_v$
#   state update per head are more work than attending over a few hundred cached tokens. The
#   softmax step grows with $T$ (its append copies the cache, its read scans it), the KDA step
#   does not, and they cross (the line after the table: from which context KDA is faster,
#   quartile ranges apart). The read alone, the part a preallocated cache still pays, grows
#   the same way from lower down.
#
# On a GPU the constants differ; what does not is that the cache's reads grow with $T$ and the
# state's do not.
#
# **At the sizes of the released models.** Per KDA layer the state is
# $H_v D_k D_v$ numbers plus the convolutions' $3\,(H D_k + H D_k + H_v D_v)$, whatever the
# context; a softmax layer with the same heads caches $H D_k + H_v D_v$ numbers per token. The
# presets' KDA layers, with the state in float32 (as `transformers` keeps it) and a softmax
# cache in bfloat16 (2 bytes), at each model's context length (`block_size`, $2^{20}$ tokens for
# both):

# %%
print(f"{'':>16s} {'KDA layers':>10s} {'state/layer':>12s} {'all KDA layers':>15s} "
      f"{'context':>9s} {'softmax cache/layer':>20s} {'ratio':>7s}")
for name, cfg in released.items():
    kda_layers = [s for s in cfg.layer_mixers if s.kind == "kda"]
    state_bytes = sum(s.state_numel(1) for s in kda_layers) * 4  # float32
    S_bytes = sum(s.value_heads * s.head_dim * s.value_dim for s in kda_layers) * 4
    spec = kda_layers[0]
    per_token = spec.n_head * spec.head_dim + spec.value_heads * spec.value_dim  # k, v
    cache_layer = per_token * cfg.block_size * 2  # bfloat16, at the full context
    per_layer = state_bytes / len(kda_layers)
    print(f"{name:>16s} {len(kda_layers):>10d} {per_layer / 1e6:>10.2f}MB "
          f"{state_bytes / 1e6:>13.0f}MB {cfg.block_size:>9d} "
          f"{cache_layer / 1e9:>18.1f}GB "
          f"{cache_layer * len(kda_layers) / state_bytes:>6.0f}x")
    print(f"{'':>16s} of which S: {S_bytes / 1e6:.0f} MB, the convolutions: "
          f"{(state_bytes - S_bytes) / 1e6:.1f} MB; break-even context "
          f"{spec.state_numel(1) * 4 / (per_token * 2):.0f} tokens")

# %% [markdown]
# One KDA layer of Kimi K3 keeps a few megabytes whatever the context; a softmax layer with its
# heads would cache tens of gigabytes at a million tokens, and the break-even context is a
# little over a hundred tokens (the last lines: a float32 state against a bfloat16 cache). The
# whole models are not all KDA: Kimi Linear keeps 7 of its 27 layers as multi-head latent
# attention and K3 24 of its 93, and those keep a cache, a far smaller one than softmax
# attention's (chapter 13).
# For the hybrid as a whole the Kimi Team report a KV cache up to 75% smaller and up to six
# times the decoding throughput at a million tokens of context (*Kimi Linear*, arXiv
# 2510.26692); chapter 15 computes the first figure from the layer pattern.

# %% [markdown]
# ## A published checkpoint (optional, in Colab)
#
# In Colab the cell below downloads a checkpoint in Qwen3-Next's published format
# (`transformers`' own tiny test model of the architecture: Gated DeltaNet layers like this
# chapter's, with random weights, so the generated text is noise; the trained Qwen3-Next-80B
# needs about 160 GB in bfloat16), loads it with `tinyk3.models.from_hf`, compares the logits with
# `transformers`' and generates, decoding through the convolution and state caches. Anywhere
# else it says why it is skipped.

# %%
from tinyk3.models import try_checkpoint
from tinyk3.models.demo import CHECKPOINTS

demo = try_checkpoint(CHECKPOINTS["qwen3_next"])

# %% [markdown]
# **What the cell shows in Colab** (this website is built offline, so it shows the skip
# message): three lines, the checkpoint's name with its parameter count and `model_type`; the
# largest logit difference between `tinyk3` and `transformers` on the same input, at float32
# rounding when the loader is right; and a greedy continuation of a short prompt, which is
# noise because the weights are random. The same check runs offline in the course's tests, on
# models written in the checkpoint's format.

# %% [markdown]
# ## Exercises
#
# ```{exercise} One decoding step of the short convolution
# :label: ex-kda-layer-conv-step
#
# Write `conv_step(x, state, weight)`: one token through a depthwise causal convolution of $K$
# taps and SiLU, as a KDA layer decodes. `x [B, C]` is the token's projected channels,
# `state [B, C, K-1]` the previous $K - 1$ inputs, oldest first (zeros at the start), and
# `weight [C, K]` the filter (a `ShortConvolution`'s `weight[:, 0]`: tap $K - 1$ multiplies the
# newest input). Return `(y, new_state)`: the output `[B, C]` and the state the next token needs,
# `[B, C, K-1]`. It must work for any $K \ge 1$.
# ```

# %%
def conv_step_mine(x, state, weight):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kda_layer.conv_step", conv_step_mine)

# %% [markdown]
# ```{solution-start} ex-kda-layer-conv-step
# :class: dropdown
# ```

# %%
def conv_step_solution(x, state, weight):
    window = torch.cat([state, x.unsqueeze(-1)], dim=-1)  # the last K inputs [B, C, K]
    y = F.silu((window * weight).sum(-1))  # tap K-1 meets x, the newest
    return y, window[..., 1:]  # the oldest input leaves, x stays


ok = checks.run("kda_layer.conv_step", conv_step_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The operator's inputs from one layer's projections
# :label: ex-kda-layer-inputs
#
# Write `layer_inputs(q, k, b, a, A_log, dt_bias, gate)`: steps 2 and 3 of the layer. Inputs in
# the projections' layout: `q, k [B, T, H, Dk]` (after the convolution), the logits of $\beta$
# `b [B, T, H]`, the gate's pre-activations `a [B, T, H, Dk]`, `A_log [H]`, `dt_bias [H, Dk]`,
# and `gate`, `"softplus"` (Kimi Linear) or `"lower_bound"` (Kimi K3). Return `(q, k, beta, g)`
# in the operators' layout: `q, k [B, H, T, Dk]` ($k$ unit, $q$ unit times $D_k^{-1/2}$),
# `beta [B, H, T]`, `g [B, H, T, Dk]`, in the inputs' dtype.
# ```

# %%
def layer_inputs_mine(q, k, b, a, A_log, dt_bias, gate):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kda_layer.inputs", layer_inputs_mine)

# %% [markdown]
# ```{solution-start} ex-kda-layer-inputs
# :class: dropdown
# ```

# %%
def layer_inputs_solution(q, k, b, a, A_log, dt_bias, gate):
    Dk = q.shape[-1]
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * Dk**-0.5  # unit, scaled
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)  # unit
    beta = torch.sigmoid(b)
    A = A_log.exp()[:, None]  # one rate per head, [H, 1] against [B, T, H, Dk]
    z = a + dt_bias
    g = -A * F.softplus(z) if gate == "softplus" else -5 * torch.sigmoid(A * z)
    return q.transpose(1, 2), k.transpose(1, 2), beta.transpose(1, 2), g.transpose(1, 2)


ok = checks.run("kda_layer.inputs", layer_inputs_solution)

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - A KDA layer is five steps around chapter 11's operator: separate $q, k, v$ projections,
#   each through a causal depthwise convolution of four taps and SiLU; unit $q$ and $k$ with the
#   $D_k^{-1/2}$ scale on $q$; $\beta = \sigma(x W_\beta)$ and a per-channel gate from a rank-$D_k$
#   projection, $-A\operatorname{softplus}(\cdot)$ in Kimi Linear or $-5\sigma(A\,\cdot)$ in Kimi
#   K3; the operator; a per-head RMSNorm times a sigmoid output gate, low-rank in Kimi Linear
#   and full-rank in K3, and $W_o$. Built from a layer's weights in front of you, it equals
#   `KimiDeltaAttention` to float64 round-off in all three forms, grouped value heads included.
# - The projections hold most of the parameters; the low-rank bottleneck keeps the per-channel
#   gate small, where a full-rank one would cost another $W_q$.
# - Qwen3-Next's Gated DeltaNet layer has the same skeleton with other choices: one gate per head
#   from a column of a fused projection, a SiLU output gate from the same projection, rows
#   grouped by key head (load them as blocks and you get a different layer without an error), and
#   twice as many value heads as key heads. Both layers, ours and this chapter's functions, match
#   `transformers`' to float32 round-off.
# - The decoding state is the operator's $S$ plus the convolutions' last three inputs. Token by
#   token, or any prefill followed by single tokens, gives the full forward to float32 round-off.
# - Measured on a CPU at width 512, the state is constant while a KV cache grows with every
#   token; the KDA step costs more than a softmax step at short contexts and less at long ones.
#   At Kimi K3's size one KDA layer holds a few megabytes at any context, against tens of
#   gigabytes for a softmax layer with its heads at a million tokens.
#
# **Next.** Chapter 13 builds the other layer of Kimi Linear and K3, multi-head latent attention,
# whose cache is the small one the hybrids keep.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
