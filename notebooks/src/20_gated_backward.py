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
# # Gradients through the gates: Gated DeltaNet and KDA
#
# Chapter 19 derived the backward pass of the chunked delta rule. The rules of the models this
# course builds have one more input: a **log decay** $g_t \le 0$ per token, one per head in
# Gated DeltaNet (chapter 10), one per key channel in KDA (chapter 11). A decay multiplies the
# state before every later token reads it, so the gate of token $s$ reaches every later term of
# the sequence. Its gradient looks as if it needs all of them. It does not: inside a chunk the
# gates enter only through their running sums $G_i = \sum_{s \le i} g_s$, and the gradient of a
# running sum is a **reverse cumulative sum**. This chapter derives that, carries chapter 19's
# stages through the gates, and then meets the two numerical traps the gate gradient hides:
# terms that should cancel exactly, and factors that overflow float32.
#
# **In this chapter** you derive the token loop's adjoint with a gate and check it; see why the
# log decay's gradient is a reverse cumulative sum; build Gated DeltaNet's chunked backward
# for one head with the gate's lines marked; read KDA's, where the decayed scores need their own
# backward with bounded factors; check both against autograd through the token loops, against
# fla's and transformers' reference code, and in float32 at the lower-bound gate, where the
# diagonal pairs of the decay mask decide the accuracy; measure bytes and time for the three
# rules in one run; and train a tiny Kimi Linear-shaped model with the derived backward.
#
# **Cost.** About a minute on one CPU core (the last cell prints the time); `SMOKE = True` runs
# in a fraction of that.

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
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from tinyk3 import bench, checks, data, layers, models, train
from tinyk3.grad_memory import autograd_grads, cotangents, step_bytes
from tinyk3.ops import delta_rule, kda
from tinyk3.ops import gated_delta_rule as gdr
from tinyk3.util import max_diff

F64 = torch.float64
MIB = 2**20
D, C = 64, 64  # head size and chunk size of the measurements
T_LOW = 512 if SMOKE else 2048  # sequence length of the float32 check
MEM_TS = [512, 1024, 2048] if SMOKE else [1024, 2048, 4096, 8192, 16384]
REPEATS = 1 if SMOKE else 3  # timed runs per point: the median (tinyk3.timing.time_fn)
T_TRAIN = 256 if SMOKE else 2048  # context of the tiny hybrid's training
TRAIN_STEPS = 3 if SMOKE else 30
RULES = {"delta_rule": delta_rule, "gated_delta_rule": gdr, "kda": kda}


def gated_inputs(B, H, T, Dk, Dv, seed, *, per_channel=False, low=-1.0, dtype=F64):
    """Unit q and k, standard normal v, β in (0, 1), log decays uniform in (low, 0): one
    per head, or one per key channel (per_channel, KDA)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=dtype)
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype)
    shape = (B, H, T, Dk) if per_channel else (B, H, T)
    g = low * torch.rand(*shape, generator=gen, dtype=dtype)
    return q, k, v, beta, g


NAMES = ["dq", "dk", "dv", "dbeta", "dg"]

# %% [markdown]
# ## The token loop with a gate
#
# Gated DeltaNet forgets before it corrects: $S'_t = \alpha_t S_{t-1}$ with $\alpha_t = e^{g_t}$,
# then chapter 19's three lines run on $S'_t$:
#
# $$
# S'_t = \alpha_t S_{t-1}, \qquad u_t = \beta_t (v_t - k_t S'_t), \qquad
# S_t = S'_t + k_t^\top u_t, \qquad o_t = q_t S_t .
# $$
#
# The adjoint step is chapter 19's, applied to $S'_t$, followed by the new line's. Once
# $\mathrm{d}S'$, the gradient with respect to $S'_t$, is known (chapter 19's $\mathrm{d}S$
# after its read-back correction), the forget line $S'_t = \alpha_t S_{t-1}$ gives
#
# $$
# \mathrm{d}\alpha_t = \langle \mathrm{d}S', S_{t-1} \rangle, \qquad
# \mathrm{d}g_t = \alpha_t\, \mathrm{d}\alpha_t, \qquad \mathrm{d}S_{t-1} = \alpha_t\,
# \mathrm{d}S' ,
# $$
#
# with $\langle \cdot, \cdot \rangle$ the sum of the elementwise product. For KDA the gate is a
# vector that scales the rows of the state, $S'_t = \operatorname{Diag}(\alpha_t) S_{t-1}$, and
# the same line holds row by row: $\mathrm{d}g_{t,d} = \alpha_{t,d} \sum_v \mathrm{d}S'_{dv}
# S_{t-1,dv}$. The adjoint state now decays backward in time exactly as the state decays
# forward.
#
# One head of Gated DeltaNet, in front of you (the lines that chapter 19's loop did not have
# are marked `# gate`):

# %%
def gated_loop_backward(q, k, v, beta, g, do, dS_T):
    """One head: q, k [T, Dk], v, do [T, Dv], beta, g [T], dS_T [Dk, Dv]; S_0 = 0.
    Returns dq, dk, dv, dbeta, dg."""
    T, Dk = k.shape
    S, states, deltas = q.new_zeros(Dk, v.shape[1]), [], []
    for t in range(T):
        states.append(S)  # S_{t−1}
        S_dec = torch.exp(g[t]) * S  # gate
        u = beta[t] * (v[t] - k[t] @ S_dec)
        S = S_dec + torch.outer(k[t], u)
        deltas.append(u)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbeta, dg, dS = torch.zeros_like(beta), torch.zeros_like(g), dS_T.clone()
    for t in reversed(range(T)):
        alpha, S_prev, u = torch.exp(g[t]), states[t], deltas[t]  # gate
        S_dec = alpha * S_prev  # gate
        S_t = S_dec + torch.outer(k[t], u)
        dS = dS + torch.outer(q[t], do[t])  # o_t = q_t S_t
        dq[t] = do[t] @ S_t.T
        du = k[t] @ dS
        d_old = -beta[t] * du  # the read-back k_t S'_t
        dk[t] = dS @ u + S_dec @ d_old
        dv[t] = beta[t] * du
        dbeta[t] = du @ (v[t] - k[t] @ S_dec)
        dS = dS + torch.outer(k[t], d_old)  # now dS', the gradient of S'_t
        dg[t] = alpha * (dS * S_prev).sum()  # gate: dg = α ⟨dS', S_{t−1}⟩
        dS = alpha * dS  # gate: now dS_{t−1}
    return dq, dk, dv, dbeta, dg


q, k, v, beta, g = gated_inputs(1, 1, 40, 8, 6, seed=1)
dO, dS = cotangents(1, 1, 40, 8, 6, seed=2)
reference = autograd_grads(gdr.recurrent, (q, k, v, beta, g), dO, dS)
one = [x[0, 0] for x in (q, k, v, beta, g, dO, dS)]
mine = gated_loop_backward(*one)
lib = gdr.recurrent_backward(q, k, v, beta, g, dO, dS)
for name, r, m, lb in zip(NAMES, reference, mine, lib):
    print(f"{name:>5s}: this loop {max_diff(m, r[0, 0]):.1e}, "
          f"gated_delta_rule.recurrent_backward {max_diff(lb, r):.1e}")

# %% [markdown]
# ## Why the gate's gradient is a reverse cumulative sum
#
# In the chunked form, chapter 10 wrote every decay inside a chunk through the running sums
# $G_i = \sum_{s \le i} g_s$: the rows $\gamma_i = e^{G_i}$ that decay the queries and the WY
# keys, the mask $\Gamma_{ij} = e^{G_i - G_j}$ of the scores and of the UT transform, the
# factors $\rho_i = e^{G_C - G_i}$ that carry each key to the chunk's end, and $\gamma_C$, the
# chunk's decay of the state. So the backward pass first collects $\mathrm{d}G_i$, the
# gradient with respect to each running sum, from every term in which $G_i$ appears. Then one
# line turns it into the gates' gradient: $g_s$ appears in every $G_i$ with $i \ge s$, each
# time with coefficient one, so
#
# $$
# \mathrm{d}g_s = \sum_{i \ge s} \mathrm{d}G_i ,
# $$
#
# a cumulative sum taken from the chunk's end: `dG.flip(-1).cumsum(-1).flip(-1)`. The gate of
# an early token collects the gradients of every later running sum, which is how it reaches
# every later term, at the cost of one pass over the chunk. Autograd agrees:

# %%
g_chunk = torch.randn(6, dtype=F64, requires_grad=True)
dG = torch.randn(6, dtype=F64)
(by_autograd,) = torch.autograd.grad((g_chunk.cumsum(-1) * dG).sum(), g_chunk)
reverse_cumsum = dG.flip(-1).cumsum(-1).flip(-1)
print(f"reverse cumulative sum against autograd: "
      f"{max_diff(reverse_cumsum, by_autograd):.1e}")

# %% [markdown]
# Each factor gives $\mathrm{d}G$ the same kind of term: the factor times the gradient of what
# it multiplies, summed against what it multiplies, since $\partial e^{x} / \partial x = e^{x}$.
# For Gated DeltaNet, with $\tilde Q = \operatorname{diag}(\gamma) Q$, $\tilde K =
# \operatorname{diag}(\gamma) K$ (the WY keys) and $\bar K = \operatorname{diag}(\rho) K$ (the
# keys written into the next state):
#
# - $\gamma_i$: $\mathrm{d}G_i \mathrel{+}= \gamma_i (q_i \cdot \mathrm{d}\tilde q_i + k_i
#   \cdot \mathrm{d}\tilde k_i)$, where $\mathrm{d}\tilde q_i$ and $\mathrm{d}\tilde k_i$ are
#   the gradients with respect to the rows of $\tilde Q$ and $\tilde K$;
# - $\Gamma_{ij}$, in the scores $QK^\top \odot \Gamma$ and in the UT transform's
#   $KK^\top \odot \Gamma$: with $Z = \mathrm{d}\Gamma \odot \Gamma$, $\mathrm{d}G_i \mathrel{+}=
#   \sum_{j} Z_{ij} - \sum_{j} Z_{ji}$ ($G_i$ enters row $i$ with a plus sign and column $i$
#   with a minus sign);
# - $\rho_i = e^{G_C - G_i}$: $\mathrm{d}G_i \mathrel{-}= \rho_i (k_i \cdot \mathrm{d}\bar k_i)$
#   and the same amount added to $\mathrm{d}G_C$ (the library sums $G_C - G_i$ from the chunk's
#   end instead, which gives the same gradient);
# - $\gamma_C$, in $S_{[c+1]} = \gamma_C S_{[c]} + \bar K^\top U'$: $\mathrm{d}G_C \mathrel{+}=
#   \gamma_C \langle \mathrm{d}S_{[c+1]}, S_{[c]} \rangle$, and the adjoint state pass decays
#   by $\gamma_C$ as the state pass does.
#
# Every factor is at most 1, so every term is finite in float32 for any gate.
#
# ## Build it: Gated DeltaNet's chunked backward, one head
#
# Chapter 19's one-head function with the gate's lines added (marked `# gate`). The forward
# keeps the boundary states; the backward recomputes each chunk, collects $\mathrm{d}G$, and
# ends with the reverse cumulative sum:

# %%
def gated_chunked_backward_one_head(q, k, v, beta, g, do, dS_T, C):
    """One head, S_0 = 0: q, k [T, Dk], v, do [T, Dv], beta, g [T], dS_T [Dk, Dv].
    Returns dq, dk, dv, dbeta, dg. The last chunk may be short."""
    T, Dk = k.shape
    starts = list(range(0, T, C))

    def chunk(s, S):  # every factor of one chunk, from its inputs and S_[c]
        K, V, b, G = k[s:s + C], v[s:s + C], beta[s:s + C], g[s:s + C].cumsum(0)
        gam, rho, decay = G.exp(), (G[-1] - G).exp(), G[-1].exp()  # gate
        Gam = gdr.decay_mask(G)  # gate: Γ_ij = e^{G_i − G_j}, j ≤ i
        KK = K @ K.T
        eye = torch.eye(len(K), dtype=q.dtype)
        X = torch.linalg.inv(eye + (b[:, None] * KK * Gam).tril(-1))
        Tm = X * b
        W, U = Tm @ (gam[:, None] * K), Tm @ V  # gate: W = 𝒯 (γ ⊙ K)
        return K, V, b, gam, rho, decay, Gam, KK, X, Tm, W, U - W @ S

    S, kept = q.new_zeros(Dk, v.shape[1]), []
    for s in starts:  # the forward: keep S_[c] only
        kept.append(S)
        K, *_, rho, decay, _, _, _, _, _, U_new = chunk(s, S)
        S = decay * S + (rho[:, None] * K).T @ U_new  # gate: γ_C S + (ρ ⊙ K)ᵀ U'
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbeta, dg, dS = torch.zeros_like(beta), torch.zeros_like(g), dS_T.clone()
    for s, S in reversed(list(zip(starts, kept))):
        Q, dO = q[s:s + C], do[s:s + C]
        K, V, b, gam, rho, decay, Gam, KK, X, Tm, W, U_new = chunk(s, S)
        QK = Q @ K.T
        dU_new = (QK * Gam).T @ dO + (rho[:, None] * K) @ dS
        d_raw = dO @ U_new.T  # the gradient of the scores QKᵀ ⊙ Γ
        dQg = dO @ S.T  # gate: the gradient of γ ⊙ Q
        dKr = U_new @ dS.T  # gate: the gradient of ρ ⊙ K
        dW = -dU_new @ S.T
        dKg = Tm.T @ dW  # gate: the gradient of γ ⊙ K
        dT = dW @ (gam[:, None] * K).T + dU_new @ V.T
        G_ut = (-X.T @ dT @ Tm.T).tril(-1)
        dbeta[s:s + C] = (X.T @ dT).diagonal() + (G_ut * KK * Gam).sum(1)
        dKK = b[:, None] * G_ut  # the gradient of KKᵀ ⊙ Γ
        dq[s:s + C] = gam[:, None] * dQg + (d_raw * Gam) @ K
        dk[s:s + C] = ((d_raw * Gam).T @ Q + rho[:, None] * dKr + gam[:, None] * dKg
                       + (dKK * Gam + (dKK * Gam).T) @ K)
        dv[s:s + C] = Tm.T @ dU_new
        Z = ((d_raw * QK + dKK * KK) * Gam).tril(-1)  # gate: dΓ ⊙ Γ, pairs j < i
        dG = gam * ((dQg * Q).sum(1) + (dKg * K).sum(1)) + Z.sum(1) - Z.sum(0)  # gate
        d_rest = rho * (dKr * K).sum(1)  # gate: through ρ_i = e^{G_C − G_i}
        dG = dG - d_rest  # gate
        dG[-1] += d_rest.sum() + decay * (dS * S).sum()  # gate: G_C, in ρ and in γ_C
        dg[s:s + C] = dG.flip(0).cumsum(0).flip(0)  # gate: the reverse cumulative sum
        dS = decay * dS + (gam[:, None] * Q).T @ dO - W.T @ dU_new  # dS_[c]
    return dq, dk, dv, dbeta, dg


# %% [markdown]
# Against autograd through the token loop, float64, $T = 37$ in chunks of 8:

# %%
q, k, v, beta, g = gated_inputs(1, 1, 37, 8, 6, seed=3)
dO, dS = cotangents(1, 1, 37, 8, 6, seed=4)
reference = autograd_grads(gdr.recurrent, (q, k, v, beta, g), dO, dS)
one = [x[0, 0] for x in (q, k, v, beta, g, dO, dS)]
mine = gated_chunked_backward_one_head(*one, C=8)
for name, r, m in zip(NAMES, reference, mine):
    print(f"{name:>5s}: {max_diff(m, r[0, 0]):.1e}")

# %% [markdown]
# Written this way, with $\rho$'s gradient split between $G_i$ and $G_C$, the function shows
# every place the gate enters. The library's `gated_delta_rule.chunked_backward` computes the
# same for every chunk at once, with chapter 19's stages and its adjoint state pass
# (`decay=`$\gamma_C$), and takes the gradient of $\rho$ through the suffix sums of $g$ that
# its forward uses (an exclusive prefix sum of $\rho_i (k_i \cdot \mathrm{d}\bar k_i)$): the
# same numbers, without forming $G_C - G_i$ by subtraction.
#
# ## KDA: one gate per channel
#
# KDA's gate is a vector per token, so $\gamma_i$, $\rho_i$ and $\gamma_C$ are row vectors and
# the backward's products with them become elementwise per channel. The decayed scores are
# different in kind: $\Omega^{kk}_{ij} = \sum_d k_{id} k_{jd} e^{G_{id} - G_{jd}}$ is no longer
# a matrix product times a mask, and chapter 11 computed it in 16-token sub-chunks so that no
# factor overflows float32. Its backward needs, for a gradient $M = \mathrm{d}\Omega^{kk}$,
#
# $$
# \begin{gathered}
# \mathrm{d}x_{id} = \sum_j M_{ij}\, y_{jd}\, e^{G_{id} - G_{jd}}, \qquad
# \mathrm{d}y_{jd} = \sum_i M_{ij}\, x_{id}\, e^{G_{id} - G_{jd}}, \\
# \mathrm{d}G_{id} \mathrel{+}= x_{id}\, \mathrm{d}x_{id} - y_{id}\, \mathrm{d}y_{id} ,
# \end{gathered}
# $$
#
# for the rows $x$ and the columns $y$ of the scores (keys and keys, or queries and keys). Off
# the diagonal blocks the factor splits as in the forward, $e^{L_i} \cdot e^{r_a - r_b - L_j}$,
# both at most 1. Inside a diagonal block the forward's split $e^{L_i} \cdot e^{-L_j}$ has a
# second factor up to $e^{80}$, harmless when it multiplies keys but not when it multiplies a
# gradient of unknown size. `kda.pair_scores_backward` splits there at a reference point taken
# from the block's first token, $m = L_0 - 40$, so that both factors stay within $e^{\pm 40}$
# for gates down to $-5$ per token and channel. The reference is a past token's: a reference
# at the block's middle token would make the gradient of an early token depend, by rounding, on
# the gate of a later one (fla issue 1240):

# %%
tinyk3.notebook.show_source(kda.pair_scores_backward)

# %% [markdown]
# ## Check: float64, and code written by others
#
# Both rules' chunked backward against autograd through their token loops, in float64, at
# awkward shapes (T not a multiple of C, several heads, an initial state and a final-state
# gradient), and with gates down to $-20$ per step, where KDA's diagonal blocks take the exact
# pair-by-pair path:

# %%
worst = 0.0
for rule, per_channel in (("gated_delta_rule", False), ("kda", True)):
    mod = RULES[rule]
    for T, C_, low in ((37, 8, -1.0), (70, 32, -5.0), (50, 32, -20.0)):
        xs = gated_inputs(2, 2, T, 8, 5, seed=T, per_channel=per_channel, low=low)
        dO, dS = cotangents(2, 2, T, 8, 5, seed=T + 1)
        S0 = torch.randn(2, 2, 8, 5, dtype=F64)
        ref = autograd_grads(
            lambda *a, mod=mod: mod.recurrent(*a[:5], initial_state=a[5]),
            (*xs, S0), dO, dS)
        got = autograd_grads(lambda *a, mod=mod, C_=C_: mod.chunked(
            *a[:5], chunk_size=C_, initial_state=a[5]), (*xs, S0), dO, dS)
        dist = max(max_diff(a, b) for a, b in zip(got, ref))
        worst = max(worst, dist)
        print(f"{rule:>16s}: T={T} C={C_} gates down to {low:5.1f}: {dist:.1e}")
print(f"largest: {worst:.1e} (bound 1e-10)")
assert worst < 1e-10

# %% [markdown]
# Then the independent oracles: autograd through code written by others, in float32 (their
# dtype). flash-linear-attention's reference chunked forms, `naive_chunk_gated_delta_rule` and
# `naive_chunk_kda`, and transformers' torch forms of Qwen3-Next's and Kimi Linear's layers,
# `torch_chunk_gated_delta_rule` and `chunk_kimi_delta_attention`. Where one of them is not
# installed (fla is not, in Colab), the cell says so and skips it; the course's tests run all
# four. Their layout is `[B, T, H, D]`, their gate comes before $\beta$, and transformers scales
# the queries by $D^{-1/2}$ inside, so the queries go in multiplied by $\sqrt{D}$:

# %%
def oracles():
    """(name, rule, fn(q, k, v, beta, g, S0) -> (o, S)) for each oracle installed."""
    found = []

    def t(x):  # [B, H, T, ...] <-> [B, T, H, ...]
        return x.transpose(1, 2)

    try:
        with warnings.catch_warnings():  # "Triton is not supported on current platform"
            warnings.simplefilter("ignore")
            import fla.ops.gated_delta_rule.naive as fla_gdn
            import fla.ops.kda.naive as fla_kda

        found.append(("fla naive_chunk_gated_delta_rule", "gated_delta_rule",
                      lambda q, k, v, b, g, S0: fla_gdn.naive_chunk_gated_delta_rule(
                          t(q), t(k), t(v), t(g), t(b), chunk_size=64, scale=1.0,
                          initial_state=S0, output_final_state=True)))
        found.append(("fla naive_chunk_kda", "kda",
                      lambda q, k, v, b, g, S0: fla_kda.naive_chunk_kda(
                          t(q), t(k), t(v), t(g), t(b), scale=1.0, initial_state=S0,
                          output_final_state=True, chunk_size=64)))
    except ImportError as exc:
        print(f"fla is not installed here ({exc}): its references are skipped")
    try:
        import transformers

        from tinyk3.util import import_without_fla

        transformers.logging.set_verbosity_error()  # no "falling back" notices
        q3 = import_without_fla("transformers.models.qwen3_next.modeling_qwen3_next")
        kl = import_without_fla("transformers.models.kimi_linear.modeling_kimi_linear")
        found.append(("transformers torch_chunk_gated_delta_rule", "gated_delta_rule",
                      lambda q, k, v, b, g, S0: q3.torch_chunk_gated_delta_rule(
                          t(q) * q.shape[-1] ** 0.5, t(k), t(v), t(g), t(b),
                          chunk_size=64, initial_state=S0, output_final_state=True)))
        found.append(("transformers chunk_kimi_delta_attention", "kda",
                      lambda q, k, v, b, g, S0: kl.chunk_kimi_delta_attention(
                          t(q) * q.shape[-1] ** 0.5, t(k), t(v), t(g), t(b),
                          chunk_size=64, initial_state=S0, output_final_state=True)))
    except (ImportError, AttributeError) as exc:  # older transformers: no Kimi Linear
        print(f"transformers' forms cannot be imported here ({exc}): skipped")
    return found


for name, rule, fn in oracles():
    xs = gated_inputs(1, 2, 128, 16, 8, seed=5, per_channel=rule == "kda", low=-2.0,
                      dtype=torch.float32)
    dO, dS = cotangents(1, 2, 128, 16, 8, seed=6, dtype=torch.float32)
    S0 = torch.randn(1, 2, 16, 8)
    leaves = [x.clone().requires_grad_() for x in (*xs, S0)]
    o, S = fn(*leaves)
    ref = torch.autograd.grad((o.transpose(1, 2) * dO).sum() + (S * dS).sum(), leaves)
    got = RULES[rule].chunked_backward(*xs, dO, dS, chunk_size=64, initial_state=S0)
    dist = max(max_diff(a, b) / max(1.0, b.abs().max().item())
               for a, b in zip(got, ref))
    print(f"{name:>42s}: {dist:.1e} (relative to the largest gradient)")

# %% [markdown]
# ## Float32 at the lower-bound gate, and the diagonal pairs
#
# Kimi K3's gates go down to $-5$ per token (chapter 11's lower-bound gate), where a chunk of
# 64 tokens decays by $e^{-320}$, far below float32's smallest number. The derived backward
# only ever multiplies by factors of at most 1 (or, in KDA's diagonal blocks, within
# $e^{\pm 40}$), so it stays finite; the question is how accurate it is. The cell compares
# float32 with float64, for the derived backward and for autograd through the float32 chunked
# form, at a constant gate of $-5$ (for KDA, half the channels at $-5$ and half at 0), as
# relative Frobenius distances:

# %%
def lower_bound_errors(rule):
    per_channel = rule == "kda"
    xs = list(gated_inputs(1, 2, T_LOW, D, D, seed=7, per_channel=per_channel))
    xs[4] = (-5.0 * (torch.arange(D) % 2).to(F64).expand_as(xs[4]).clone()
             if per_channel else torch.full_like(xs[4], -5.0))
    dO, dS = cotangents(1, 2, T_LOW, D, D, seed=8)
    mod = RULES[rule]
    exact = mod.chunked_backward(*xs, dO, dS, chunk_size=C)
    derived = mod.chunked_backward(*(x.float() for x in xs), dO.float(), dS.float(),
                                   chunk_size=C)
    auto = autograd_grads(lambda *a: mod.chunked(*a, chunk_size=C, backward="autograd"),
                          [x.float() for x in xs], dO.float(), dS.float())

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    return {n: (rel(d, e), rel(a, e))
            for n, e, d, a in zip(NAMES, exact, derived, auto)}


for rule in ("gated_delta_rule", "kda"):
    errors = lower_bound_errors(rule)
    print(f"{rule} at g = −5, T = {T_LOW:,}: "
          + ", ".join(f"{n} {d:.1e} ({a:.1e})" for n, (d, a) in errors.items()))
    print("    derived backward (autograd through the float32 forward in brackets)")
    assert max(d for d, _ in errors.values()) < 1e-5

# %% [markdown]
# Every gradient of the derived backward is within $10^{-5}$ (the stated bound). Autograd's
# gate gradient for Gated DeltaNet has an error over a hundred times the others', and the suspect is
# the **diagonal of the decay mask**. $\Gamma_{ii} = e^{G_i - G_i} = 1$ whatever the gates, so
# the pairs $i = j$ contribute nothing to $\mathrm{d}G$. But written as a row term and a column
# term, $\sum_j Z_{ij} - \sum_j Z_{ji}$, each diagonal entry $Z_{ii}$ enters twice with opposite
# signs, in two sums whose roundings differ. At strong gates every other entry of $Z$ is tiny
# (the decays $e^{-5}$ and smaller), so the diagonal's $O(1)$ entries, which cancel exactly in
# exact arithmetic, leave a rounding error that is large next to what remains. Autograd,
# differentiating $e^{G_i - G_j}$ entry by entry, keeps the diagonal in.
#
# The mechanism alone, on one chunk's decay mask at $g = -5$: $\mathrm{d}G$ from a random
# $\mathrm{d}\Gamma$ in float32, with the diagonal kept and left out, against float64:

# %%
gen = torch.Generator().manual_seed(11)
g_mask = torch.full((256, C), -5.0, dtype=F64)  # 256 chunks at the lower-bound gate
d_mask = torch.randn(256, C, C, generator=gen, dtype=F64)
Gam64 = gdr.decay_mask(g_mask.cumsum(-1))
Z64 = (d_mask * Gam64).tril(-1)  # exact: the diagonal has no gradient
dG_exact = Z64.sum(-1) - Z64.sum(-2)
Z32 = d_mask.float() * gdr.decay_mask(g_mask.float().cumsum(-1))
for label, Z in (("diagonal kept", Z32), ("diagonal left out", Z32.tril(-1))):
    dG = Z.sum(-1) - Z.sum(-2)
    err = ((dG.double() - dG_exact).norm() / dG_exact.norm()).item()
    print(f"{label:>17s}: relative error of dG in float32 {err:.1e}")

# %% [markdown]
# Kept in, the diagonal alone raises the error about a hundredfold, as autograd's gate gradient
# showed against the derived backward's above. The derived backward
# leaves the diagonal out of $Z$ (`.tril(-1)`), and adds the diagonal pairs' gate-free share of
# $\mathrm{d}q$ and $\mathrm{d}k$ directly (attention-gym PR 461 made the same fix in its KDA
# kernels).
#
# A check that catches the diagonal pairs taken back in, where their rounding shows: one token
# from a zero state, whose gate decays nothing, so its gradient is exactly zero; the only pair
# in its chunk is the diagonal one. Through autograd, in float32 (for a single token Gated
# DeltaNet's two shares happen to round alike, so there only the comparison above shows it; the
# library's test runs both):

# %%
for rule in ("gated_delta_rule", "kda"):
    xs = [x.float()
          for x in gated_inputs(2, 2, 1, 16, 8, seed=9, per_channel=rule == "kda")]
    xs[4] = torch.full_like(xs[4], -5.0)
    dO, _ = cotangents(2, 2, 1, 16, 8, seed=10, dtype=torch.float32)
    mod = RULES[rule]
    derived = mod.chunked_backward(*xs, dO, chunk_size=16).dg
    leaves = [x.clone().requires_grad_() for x in xs]
    o, _ = mod.chunked(*leaves, chunk_size=16, backward="autograd")
    (auto,) = torch.autograd.grad((o * dO).sum(), leaves[4])
    print(f"{rule:>16s}, one token: largest |dg|, derived "
          f"{derived.abs().max().item():.1e}, autograd through the forward "
          f"{auto.abs().max().item():.1e}")
    assert torch.equal(derived, torch.zeros_like(derived))

# %% [markdown]
# The derived backward's gradient is exactly zero, as it must be; KDA's through autograd is
# not, and its residue is the diagonal's rounding. `tests/test_backward.py` runs this check on
# the library.
#
# ## Experiment: the three rules, bytes and time against the sequence length
#
# Chapter 19's measurement for the three rules in one run (`bench.bench_backward`): forward
# plus backward of `chunked` with each backward pass, one head of 64 channels, $C = 64$,
# float32, one thread, and the bytes each keeps between the passes:

# %%
rows = []
for rule in RULES:
    rows += bench.bench_backward(MEM_TS, B=1, H=1, D=D, C=C, repeats=REPEATS, rule=rule)
print(f"{'rule':>16s}  {'T':>6s}  {'autograd MiB':>12s}  {'derived MiB':>11s}  "
      f"{'autograd s':>10s}  {'derived s':>9s}  {'speed-up':>8s}")
for r_a, r_d in zip(rows[1::2], rows[0::2]):
    print(f"{r_a['rule']:>16s}  {r_a['T']:6,d}  {r_a['kept_bytes'] / MIB:12.2f}  "
          f"{r_d['kept_bytes'] / MIB:11.2f}  {float(r_a['seconds']):10.3f}  "
          f"{float(r_d['seconds']):9.3f}  {r_d['speedup']:8.2f}")
print(bench.stamp())

# %% mystnb={"figure": {"caption": "Left: the bytes kept between the forward and the backward pass against the sequence length, for the three chunked rules, with autograd through the PyTorch forward (solid) and with the derived backward (dashed; the three dashed lines coincide, since each keeps the same boundary states). Right: the time of forward plus backward on one CPU thread. The legend is below the panels.", "name": "fig-gates-backward-bytes-and-time"}, "image": {"alt": "Two log-log plots against sequence length from about one thousand to sixteen thousand tokens, with three colours for the delta rule, Gated DeltaNet and KDA. Left: three solid lines for autograd, KDA's highest, all well above one dashed line shared by the three derived backward passes. Right: at short lengths each rule's solid and dashed lines lie close together, and at the longest length every dashed line lies below the solid line of its rule."}}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.8, 3.3))
colours = dict(zip(RULES, ("C0", "C1", "C2")))
styles = {"autograd": "-", "derived": "--"}
for rule, colour in colours.items():
    for form, style in styles.items():
        rs = [r for r in rows if r["rule"] == rule and r["form"] == form]
        Ts = [r["T"] for r in rs]
        ax1.plot(Ts, [r["kept_bytes"] / MIB for r in rs], style, color=colour,
                 marker="o", ms=3)
        ax2.plot(Ts, [float(r["seconds"]) for r in rs], style, color=colour, marker="o",
                 ms=3)
titles = ("MiB kept for the backward", "seconds, forward + backward")
for ax, title in zip((ax1, ax2), titles):
    ax.set(xscale="log", yscale="log", xlabel="sequence length T", title=title)
    ax.grid(alpha=0.3)
keys = [plt.Line2D([], [], color=c, label=r) for r, c in colours.items()]
keys += [plt.Line2D([], [], color="k", ls=s, label=f) for f, s in styles.items()]
fig.legend(handles=keys, loc="lower center", ncol=5, fontsize=7, frameon=False)
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# The derived backward keeps the same bytes for the three rules: the boundary states, one per
# chunk. Autograd keeps more for the gated rules than for the delta rule, since the decay mask
# and the decayed keys and queries are kept too, and most for KDA, whose per-channel factors
# and sub-chunk blocks add more; the table gives both. At short lengths the two backward
# passes take about the same time (speed-ups near 1 in the table, within the noise of a shared
# machine). At the longest length the derived backward is the faster one for each rule, by the
# least for KDA, whose pair-score backward runs sub-chunk by sub-chunk in Python loops.
#
# ### A tiny Kimi Linear-shaped model
#
# Three KDA layers to one MLA layer, as in Kimi Linear (chapter 15), at width 64 with two heads
# per layer and a SwiGLU feed-forward (no experts, to keep it small), trained on the course's
# text at a context of `T_TRAIN` tokens. First, what one training step keeps, with each
# backward pass for the KDA layers:

# %%
def tiny_kimi_linear(T):
    kda_cfg = layers.KDAConfig(n_head=2, head_dim=32, conv_size=4)
    mla_cfg = layers.MLAConfig(n_head=2, kv_lora_rank=32, qk_nope_head_dim=32,
                               qk_rope_head_dim=0, v_head_dim=32, use_rope=False)
    cfg = models.LMConfig(vocab_size=data.VOCAB_SIZE, block_size=T, n_embd=64,
                          pattern=[kda_cfg, kda_cfg, kda_cfg, mla_cfg],
                          mlp=layers.SwiGLUConfig(hidden=128), pos_emb=False,
                          norm="rmsnorm", tie_embeddings=False)
    return models.LM(cfg)


torch.manual_seed(0)
model = tiny_kimi_linear(T_TRAIN)
kept = {mode: step_bytes(model, T_TRAIN, mode) for mode in ("autograd", "derived")}
for mode, b in kept.items():
    print(f"{mode:>8s}: one step at T = {T_TRAIN:,} keeps {b / MIB:7.1f} MiB")
print(f"the derived backward keeps {kept['derived'] / kept['autograd']:.2f} "
      "of autograd's")

# %% [markdown]
# The saving is smaller than for a model of linear layers only. Part of what is left is the
# model's projections, norms and feed-forwards, as in chapter 19; the rest is the MLA layer's
# scores, $T \times T$ per head, which autograd keeps and which grow with $T^2$, so that at
# long context they come to dominate. The derived backward removes
# the linear layers' share; the attention layer's needs a fused attention kernel, which keeps
# its softmax statistics instead of its scores (FlashAttention, on a GPU). Training with the
# derived backward, the default:

# %%
corpus = data.encode(data.load_corpus())
train_data, val_data = data.split(corpus)
before = train.evaluate_loss(model, val_data, 1, T_TRAIN)
start = time.perf_counter()
result = train.train_lm(model, train_data, val_data, steps=TRAIN_STEPS, batch_size=1,
                        block_size=T_TRAIN, lr=3e-3, warmup=5,
                        eval_every=max(1, TRAIN_STEPS // 3), progress=False)
seconds = time.perf_counter() - start
print(f"{TRAIN_STEPS} steps at T = {T_TRAIN:,} in {seconds:.0f} s; validation loss "
      f"{before:.2f} -> " + " -> ".join(f"{x:.2f}" for x in result.val_loss)
      + f" nats (the unigram baseline: {data.unigram_entropy(train_data):.2f})")

# %% [markdown]
# ## Exercises
#
# ```{exercise} The gate's gradient through the decay mask
# :label: ex-backward-decay-mask
#
# Write `decay_mask_backward(g, dGamma)`. For the log decays `g [..., C]` of one chunk, the
# decay mask is $\Gamma_{ij} = e^{G_i - G_j}$ for $j \le i$ and 0 above the diagonal, with
# $G_i = \sum_{s \le i} g_s$. Given `dGamma` $= \partial \mathcal{L} / \partial \Gamma$
# (`[..., C, C]`; its entries above the diagonal, where $\Gamma$ is the constant 0, carry
# nothing), return $\partial \mathcal{L} / \partial g$, `[..., C]`, in `g`'s dtype.
# ```

# %%
def decay_mask_backward_mine(g, dGamma):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("backward.decay_mask", decay_mask_backward_mine)

# %% [markdown]
# ```{solution-start} ex-backward-decay-mask
# :class: dropdown
# ```

# %%
def decay_mask_backward_solution(g, dGamma):
    G = g.cumsum(-1)
    C = g.shape[-1]
    below = torch.ones(C, C, dtype=torch.bool).tril(-1)  # j < i: Γ_ii = 1, no gradient
    diff = G[..., :, None] - G[..., None, :]
    Gamma = torch.where(below, diff, -torch.inf).exp()  # masked before the exponential
    Z = dGamma * Gamma  # ∂Γ_ij/∂G_i = Γ_ij, ∂Γ_ij/∂G_j = −Γ_ij
    dG = Z.sum(-1) - Z.sum(-2)  # + as row i, − as column i
    return dG.flip(-1).cumsum(-1).flip(-1)  # dg_s = Σ_{i ≥ s} dG_i


ok = checks.run("backward.decay_mask", decay_mask_backward_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} One step of Gated DeltaNet's adjoint
# :label: ex-backward-gated-token-step
#
# Write `gated_token_step_backward(q_t, k_t, v_t, beta_t, g_t, S_prev, dS, do_t)`, chapter 19's
# adjoint step with the gate: the forward step is $S' = e^{g_t} S_{t-1}$, $u_t = \beta_t (v_t -
# k_t S')$, $S_t = S' + k_t^\top u_t$, $o_t = q_t S_t$. `dS` is $\partial \mathcal{L} / \partial
# S_t$ through the later tokens only, `do_t` is $\partial \mathcal{L} / \partial o_t$. Return
# `(dq_t, dk_t, dv_t, dbeta_t, dg_t, dS_prev)`. Shapes: `q_t`, `k_t` `[B, H, Dk]`; `v_t`,
# `do_t` `[B, H, Dv]`; `beta_t`, `g_t` `[B, H]`; `S_prev`, `dS` `[B, H, Dk, Dv]`.
# ```

# %%
def gated_token_step_backward_mine(q_t, k_t, v_t, beta_t, g_t, S_prev, dS, do_t):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("backward.gated_token_step", gated_token_step_backward_mine)

# %% [markdown]
# ```{solution-start} ex-backward-gated-token-step
# :class: dropdown
# ```

# %%
def gated_token_step_backward_solution(q_t, k_t, v_t, beta_t, g_t, S_prev, dS, do_t):
    alpha = g_t.exp()[..., None, None]  # [B, H, 1, 1]
    b = beta_t[..., None]
    S_dec = alpha * S_prev  # forget before the error
    v_old = torch.einsum("bhk,bhkv->bhv", k_t, S_dec)
    u = b * (v_t - v_old)
    S_t = S_dec + k_t[..., :, None] * u[..., None, :]
    dS = dS + q_t[..., :, None] * do_t[..., None, :]
    dq = torch.einsum("bhv,bhkv->bhk", do_t, S_t)
    du = torch.einsum("bhk,bhkv->bhv", k_t, dS)
    d_old = -b * du
    dk = (torch.einsum("bhkv,bhv->bhk", dS, u)
          + torch.einsum("bhkv,bhv->bhk", S_dec, d_old))
    dS_dec = dS + k_t[..., :, None] * d_old[..., None, :]  # the gradient of S'
    dg = alpha[..., 0, 0] * (dS_dec * S_prev).sum((-2, -1))  # α ⟨dS', S_{t−1}⟩
    return dq, dk, b * du, (du * (v_t - v_old)).sum(-1), dg, alpha * dS_dec


ok = checks.run("backward.gated_token_step", gated_token_step_backward_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ## Summary
#
# - With a gate, the token loop's adjoint adds one line: the forget step $S'_t = \alpha_t
#   S_{t-1}$ gives $\mathrm{d}g_t = \alpha_t \langle \mathrm{d}S', S_{t-1} \rangle$ and
#   decays the adjoint state backward, $\mathrm{d}S_{t-1} = \alpha_t\, \mathrm{d}S'$ (row by
#   row for KDA).
# - In the chunked form the gates enter through their running sums $G_i$, in the factors
#   $\gamma_i$, $\Gamma_{ij}$, $\rho_i$ and $\gamma_C$. Each adds to $\mathrm{d}G$ a factor times
#   a gradient summed against what it multiplies, and the gates' gradient is the **reverse
#   cumulative sum** $\mathrm{d}g_s = \sum_{i \ge s} \mathrm{d}G_i$. Each of these factors is
#   at most 1, so the backward is as finite as the forward.
# - KDA's decayed scores need their own backward (`kda.pair_scores_backward`): the same
#   sub-chunk blocks, with the diagonal blocks split at a reference from their first token, so
#   that no factor exceeds $e^{40}$ and none depends on a later gate.
# - The diagonal pairs of the decay mask have no gradient. Left in, their two cancelling shares
#   leave rounding, which made the error of Gated DeltaNet's float32 gate gradient through
#   autograd over a hundred times the other gradients' at the lower-bound gate. Left out, the
#   derived backward is within $10^{-5}$ for every gradient, and exactly zero where it must be.
# - Both rules' derived backward equals autograd through the token loops in float64, and
#   autograd through fla's and transformers' reference code in float32. It keeps one state per
#   chunk for all three rules, where autograd keeps 15 to 22 times more for the gated ones (at
#   $C = 64$, $D = 64$). In a hybrid, much of what is left to keep is the attention layers'
#   $T \times T$ scores.
#
# **Next.** [Chapter 21](21_backward_kernels.ipynb) turns the stages derived here into GPU
# kernels, in Triton.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
