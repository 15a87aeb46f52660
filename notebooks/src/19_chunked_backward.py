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
# # The backward pass of chunked DeltaNet
#
# Every chapter so far built a forward pass and left the gradients to autograd. Chapters 12 to
# 18 trained their models that way, through chapter 8's chunked form. That is not how these
# models are trained at scale. Autograd keeps, between the forward and the backward pass, every
# intermediate a backward formula might read: each chunk's UT matrix, its WY factors, its scores,
# its deltas, its state. The bytes grow with the sequence, and for a long context they, not the
# weights, decide what fits. People who train Qwen3-Next, Kimi Linear or Kimi K3 layers off
# CUDA, where no fused kernel is available, run out of memory on the first backward pass.
#
# The way out is the one the kernel libraries take: write the backward pass by hand. The
# forward then keeps only its inputs and one state per chunk, and the backward recomputes the
# rest, chunk by chunk. This chapter derives that backward pass for the delta rule. First comes
# the token loop, where the gradient of the state runs backward in time. Then comes the chunked
# form: through the output, the deltas $U' = U - WS$, the state pass and the UT transform. The
# last step needs the gradient of a triangular inverse. Chapter 20 adds the decay gates of Gated
# DeltaNet and KDA.
#
# **In this chapter** you measure what autograd keeps for the chunked forward; derive and build
# the token loop's backward; derive the chunked backward, build it chunk by chunk in front of
# you and check it against autograd; read the library's version, which recomputes every chunk
# at once and runs one short backward pass over the chunks, and see how its names map to fla's
# kernels; check it in float64, in float32 at long context and by finite differences; measure
# the bytes kept and the time against the sequence length for both backward passes; and train
# a small DeltaNet language model at a context that autograd's bytes would not fit into a stated
# budget.
#
# **Cost.** Under a minute on one CPU core, most of it in the experiment (the last cell prints
# the time); `SMOKE = True` runs in a fraction of that.

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
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from tinyk3 import bench, checks, data, layers, models, train
from tinyk3.grad_memory import autograd_grads, cotangents, saved_bytes, step_bytes
from tinyk3.ops import chunks, delta_rule
from tinyk3.util import max_diff

F64 = torch.float64
MIB = 2**20
D = 64  # head size of the measurements (Dk = Dv)
C = 64  # chunk size
MEM_TS = [512, 1024, 2048] if SMOKE else [1024, 2048, 4096, 8192, 16384, 32768]
T_LONG = 1024 if SMOKE else 8192  # sequence length of the float32 check
REPEATS = 1 if SMOKE else 3  # timed runs per point: the median (tinyk3.timing.time_fn)
BUDGET_MIB = 16 if SMOKE else 64  # what one training step may keep, in MiB
STEP = 512  # contexts tried for the training experiment: multiples of STEP
TRAIN_STEPS = 3 if SMOKE else 40


def unit_inputs(B, H, T, Dk, Dv, seed, dtype=F64):
    """Unit queries and keys, standard normal values, β uniform in (0, 1), as DeltaNet
    layers make them (chapter 8's inputs)."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    return q, k, v, beta


# %% [markdown]
# ## What autograd keeps
#
# In the forward pass, every operation whose backward will need something hands it to autograd
# (a matrix product $AB$ needs $A$ to form $\partial \mathcal{L}/\partial B$, and $B$ for
# $\partial \mathcal{L}/\partial A$). Autograd keeps those tensors until the backward pass has used them.
# `tinyk3.grad_memory.saved_bytes` runs a function under PyTorch's saved-tensor hooks and adds
# up what is kept: each storage is counted once, and the inputs' own storages are left out,
# because the caller holds them anyway.
#
# Here is chapter 8's chunked form, differentiated by autograd (`backward="autograd"`), for one
# head of 64 channels in float32 at $C = 64$:

# %%
def by_autograd_fn(*xs):
    return delta_rule.chunked(*xs, chunk_size=C, backward="autograd")


kept_autograd = {}
for T in MEM_TS:
    xs = [x.float().requires_grad_() for x in unit_inputs(1, 1, T, D, D, seed=T)]
    kept = saved_bytes(by_autograd_fn, *xs)
    kept_autograd[T] = kept
    print(f"T = {T:6,d}: autograd keeps {kept.bytes / MIB:7.2f} MiB in "
          f"{kept.tensors:5,d} tensors, {kept.bytes / kept.input_bytes:4.2f} x the "
          f"inputs' {kept.input_bytes / MIB:6.2f} MiB")

# %% [markdown]
# The bytes grow in proportion to $T$ and come to several times the inputs themselves. What
# is kept is what the backward formulas of chapter 8's operations read: the matrix the UT
# transform inverts and its result, the WY factors $W$ and $U$, the scores, the deltas $U'$ and
# the chunk states, which the state pass's products save one chunk at a time (hence the
# hundreds to over a thousand tensors at long $T$) and the output's product saves again,
# stacked.
#
# Now take a model's worth. Kimi Linear 48B has linear layers of 32 heads of 128 channels (its
# configuration is in the library). If each head kept what autograd keeps here per token (KDA
# keeps more, chapter 20), one training sequence of 128k tokens would need:

# %%
cfg = models.presets.kimi_linear_48b()
linear = [m for m in cfg.pattern if isinstance(m, layers.KDAConfig)]
heads, head_dim = linear[0].n_head, linear[0].head_dim
xs = [x.float().requires_grad_()
      for x in unit_inputs(1, 1, 4096, head_dim, head_dim, seed=0)]
per_token = saved_bytes(by_autograd_fn, *xs).bytes / 4096  # bytes per token and head
T_MODEL = 128 * 1024
model_bytes = per_token * heads * len(linear) * T_MODEL
print(f"{len(linear)} linear layers x {heads} heads of {head_dim}: "
      f"{per_token:,.0f} bytes per token and head; {model_bytes / 2**30:,.0f} GiB for "
      f"one sequence of {T_MODEL:,} tokens, in the linear mixers' chunked form alone")

# %% [markdown]
# That is memory for the mixers' internals alone, before any activation of the projections,
# the MLPs or the attention layers. It is the memory this chapter cuts down.
#
# ## The token loop's backward
#
# Start where the definition is, with the token loop of chapter 5. Each token computes
#
# $$
# u_t = \beta_t\,(v_t - k_t S_{t-1}), \qquad S_t = S_{t-1} + k_t^\top u_t, \qquad
# o_t = q_t S_t ,
# $$
#
# and the loss $\mathcal{L}$ depends on every output $o_t$ and on the final state $S_T$. Write
# $\mathrm{d}X$ for $\partial \mathcal{L} / \partial X$, a tensor of $X$'s shape. The state $S_t$ reaches the loss in
# two ways: through $o_t$, and through $S_{t+1}$ and every later token. So its gradient can be
# formed only once $\mathrm{d}S_{t+1}$ is known: the **adjoint state** $\mathrm{d}S_t$ runs
# backward in time, from $\mathrm{d}S_T$ (zero, or the gradient of a loss on the final state) to
# $\mathrm{d}S_0$.
#
# One step, undoing the forward's three lines from the last. With $\mathrm{d}S$ holding the
# gradient of $S_t$ through the later tokens:
#
# - $o_t = q_t S_t$ adds its share, $\mathrm{d}S \mathrel{+}= q_t^\top\, \mathrm{d}o_t$, and gives
#   $\mathrm{d}q_t = \mathrm{d}o_t\, S_t^\top$.
# - $S_t = S_{t-1} + k_t^\top u_t$ passes $\mathrm{d}S$ on to $S_{t-1}$ unchanged, and gives
#   $\mathrm{d}u_t = k_t\, \mathrm{d}S$ and a first part of $\mathrm{d}k_t$,
#   $\mathrm{d}S\, u_t^\top$.
# - $u_t = \beta_t (v_t - k_t S_{t-1})$ gives $\mathrm{d}v_t = \beta_t\, \mathrm{d}u_t$,
#   $\mathrm{d}\beta_t = \mathrm{d}u_t \cdot (v_t - k_t S_{t-1})$, and, through the read-back
#   $k_t S_{t-1}$ with $\mathrm{d}(k_t S_{t-1}) = -\beta_t\, \mathrm{d}u_t$, a second part of
#   $\mathrm{d}k_t$, $-S_{t-1}(\beta_t\, \mathrm{d}u_t)^\top$, and a correction to the state's
#   gradient, $\mathrm{d}S \mathrel{-}= k_t^\top\, \beta_t\, \mathrm{d}u_t$.
#
# After the step, $\mathrm{d}S$ is $\mathrm{d}S_{t-1}$. The correction is the backward face of
# the delta rule's overwrite: what the state held at $k_t$ is replaced, so it no longer
# reaches the loss through this token's write.
#
# One head, in front of you. The forward keeps every state (a reference may spend memory);
# the backward walks the tokens in reverse:

# %%
def loop_backward(q, k, v, beta, do, dS_T):
    """One head: q, k [T, Dk], v, do [T, Dv], beta [T], dS_T [Dk, Dv].
    Returns dq, dk, dv, dbeta and dS_0, from S_0 = 0."""
    T, Dk = k.shape
    S = q.new_zeros(Dk, v.shape[1])
    states, deltas = [S], []
    for t in range(T):  # the forward, keeping S_0 .. S_T
        u = beta[t] * (v[t] - k[t] @ S)
        S = S + torch.outer(k[t], u)
        states.append(S)
        deltas.append(u)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbeta, dS = torch.zeros_like(beta), dS_T.clone()
    for t in reversed(range(T)):  # the backward, from the last token
        S_prev, S_t, u = states[t], states[t + 1], deltas[t]
        dS = dS + torch.outer(q[t], do[t])  # o_t = q_t S_t
        dq[t] = do[t] @ S_t.T
        du = k[t] @ dS  # S_t = S_{t−1} + k_tᵀ u_t
        d_old = -beta[t] * du  # u_t = β_t (v_t − k_t S_{t−1})
        dk[t] = dS @ u + S_prev @ d_old
        dv[t] = beta[t] * du
        dbeta[t] = du @ (v[t] - k[t] @ S_prev)
        dS = dS + torch.outer(k[t], d_old)  # now dS_{t−1}
    return dq, dk, dv, dbeta, dS


# %% [markdown]
# The check is autograd itself, through the library's token loop
# `tinyk3.ops.delta_rule.recurrent`, in float64. The loss $\mathcal{L} = \langle O, \mathrm{d}O
# \rangle + \langle S_T, \mathrm{d}S_T \rangle$ has exactly the chosen $\mathrm{d}O$ and $\mathrm{d}S_T$
# as its gradients with respect to the outputs and the final state (`tinyk3.grad_memory`
# holds the loss's two helpers, `cotangents` draws $\mathrm{d}O$ and $\mathrm{d}S_T$,
# `autograd_grads` differentiates it through any rule):

# %%
q, k, v, beta = unit_inputs(1, 1, 40, 8, 6, seed=1)
dO, dS = cotangents(1, 1, 40, 8, 6, seed=2)
reference = autograd_grads(delta_rule.recurrent, (q, k, v, beta), dO, dS)
mine = loop_backward(q[0, 0], k[0, 0], v[0, 0], beta[0, 0], dO[0, 0], dS[0, 0])
lib = delta_rule.recurrent_backward(q, k, v, beta, dO, dS)
for name, r, m, lb in zip(["dq", "dk", "dv", "dbeta"], reference, mine, lib):
    print(f"{name:>5s}: this loop {max_diff(m, r[0, 0]):.1e}, "
          f"delta_rule.recurrent_backward {max_diff(lb, r):.1e}")

# %% [markdown]
# The loop is exact but sequential, and its forward kept $T$ states. The chunked form must do
# better on both counts.
#
# ## The chunked backward, derived
#
# Chapter 8's chunk $c$, in the course's notation (rows are tokens; $M$ keeps $j \le i$):
#
# $$
# \begin{aligned}
# A &= I + A_{<}, \quad A_{<} = \operatorname{tril}(\operatorname{diag}(\beta) K K^\top, -1),
#   \quad X = A^{-1}, \\
# \mathcal{T} &= X \operatorname{diag}(\beta), \quad W = \mathcal{T} K, \quad U = \mathcal{T} V, \\
# U' &= U - W S, \quad O = Q S + \Omega U', \quad \Omega = Q K^\top \odot M, \\
# S^{+} &= S + K^\top U' ,
# \end{aligned}
# $$
#
# with $S = S_{[c]}$ the state the chunk starts from and $S^{+} = S_{[c+1]}$ the one it hands
# on. The backward pass receives $\mathrm{d}O$ for the chunk's outputs and
# $\mathrm{d}S^{+}$ from the chunks after it, and undoes the lines in reverse order, with the
# rules of the token loop (a product $Y = AB$ sends $\mathrm{d}A = \mathrm{d}Y B^\top$ and
# $\mathrm{d}B = A^\top \mathrm{d}Y$; a mask passes through as a mask):
#
# 1. **The state update** $S^{+} = S + K^\top U'$: $\mathrm{d}U' \mathrel{+}= K\,
#    \mathrm{d}S^{+}$, $\mathrm{d}K \mathrel{+}= U' (\mathrm{d}S^{+})^\top$, and $\mathrm{d}S$
#    starts at $\mathrm{d}S^{+}$.
# 2. **The output** $O = QS + \Omega U'$: $\mathrm{d}U' \mathrel{+}= \Omega^\top \mathrm{d}O$,
#    $\mathrm{d}S \mathrel{+}= Q^\top \mathrm{d}O$, $\mathrm{d}Q = \mathrm{d}O\, S^\top +
#    \mathrm{d}\Omega\, K$ and $\mathrm{d}K \mathrel{+}= \mathrm{d}\Omega^\top Q$, with
#    $\mathrm{d}\Omega = (\mathrm{d}O\, U'^\top) \odot M$.
# 3. **The deltas** $U' = U - WS$: $\mathrm{d}U = \mathrm{d}U'$, $\mathrm{d}W = -\mathrm{d}U'
#    S^\top$, and $\mathrm{d}S \mathrel{-}= W^\top \mathrm{d}U'$.
# 4. **The WY factors** $W = \mathcal{T}K$, $U = \mathcal{T}V$: $\mathrm{d}\mathcal{T} =
#    \mathrm{d}W K^\top + \mathrm{d}U V^\top$, $\mathrm{d}K \mathrel{+}= \mathcal{T}^\top
#    \mathrm{d}W$, $\mathrm{d}V = \mathcal{T}^\top \mathrm{d}U$.
# 5. **The UT transform** $\mathcal{T} = X \operatorname{diag}(\beta)$: $\mathrm{d}X =
#    \mathrm{d}\mathcal{T} \operatorname{diag}(\beta)$, and $\beta$'s first share,
#    $\mathrm{d}\beta_j \mathrel{+}= (X^\top \mathrm{d}\mathcal{T})_{jj}$.
# 6. **The inverse** $X = A^{-1}$, $A = I + A_{<}$. Differentiate $X A = I$:
#    $\delta X\, A + X\, \delta A_{<} = 0$, so $\delta X = -X\, \delta A_{<}\, X$. A loss
#    changes by $\langle \mathrm{d}X, \delta X \rangle = \langle -X^\top \mathrm{d}X X^\top,
#    \delta A_{<} \rangle$, and $A_{<}$ has entries only below the diagonal (the ones of $I$ are
#    constants), so its gradient is
#    $G = \mathrm{d}A_{<} = \operatorname{tril}(-X^\top \mathrm{d}X\, X^\top, -1)
#    = \operatorname{tril}(-X^\top \mathrm{d}\mathcal{T}\, \mathcal{T}^\top, -1)$, the second
#    form because $\operatorname{diag}(\beta) X^\top = \mathcal{T}^\top$.
# 7. **The key scores** $(A_{<})_{ij} = \beta_i (KK^\top)_{ij}$ for $j < i$: $\beta$'s second
#    share, $\mathrm{d}\beta_i \mathrel{+}= \sum_j G_{ij} (KK^\top)_{ij}$, and
#    $\mathrm{d}(KK^\top) = \operatorname{diag}(\beta)\, G$, which gives the keys' last share,
#    $\mathrm{d}K \mathrel{+}= (\mathrm{d}(KK^\top) + \mathrm{d}(KK^\top)^\top) K$.
#
# Only steps 1 to 3 link one chunk to the next: $\mathrm{d}S_{[c]}$ needs
# $\mathrm{d}S_{[c+1]}$. Collecting them gives the **adjoint state pass**, the forward's state
# pass run backward, two matrix products per chunk:
#
# $$
# \mathrm{d}U'_{[c]} = \Omega_{[c]}^\top \mathrm{d}O_{[c]} + K_{[c]}\, \mathrm{d}S_{[c+1]},
# \qquad
# \mathrm{d}S_{[c]} = \mathrm{d}S_{[c+1]} + Q_{[c]}^\top \mathrm{d}O_{[c]} - W_{[c]}^\top
# \mathrm{d}U'_{[c]} .
# $$
#
# Everything else is local to a chunk once its $\mathrm{d}S_{[c+1]}$ and $\mathrm{d}U'_{[c]}$ are
# known, and every quantity it reads ($\mathcal{T}$, $W$, $U$, $U'$, $\Omega$) can be
# recomputed from the chunk's inputs and its starting state $S_{[c]}$. So the forward keeps
# the inputs and the $N = \lceil T / C \rceil$ boundary states, $N \cdot D_k D_v$ numbers per
# head, which is $T \cdot D$ at $C = D$: the size of one of the inputs.
#
# ## Build it: the chunked backward, one chunk at a time
#
# One head again. The forward walks the chunks and keeps only each chunk's starting state; the
# backward walks them in reverse, recomputes the chunk, and applies steps 1 to 7:

# %%
def chunked_backward_one_head(q, k, v, beta, do, dS_T, C):
    """One head, S_0 = 0: q, k [T, Dk], v, do [T, Dv], beta [T], dS_T [Dk, Dv].
    Returns dq, dk, dv, dbeta and dS_0. The last chunk may be short."""
    T, Dk = k.shape
    starts = list(range(0, T, C))
    S, kept = q.new_zeros(Dk, v.shape[1]), []
    for s in starts:  # the forward: keep S_[c] only
        K, V, b = k[s:s + C], v[s:s + C], beta[s:s + C]
        I = torch.eye(len(K), dtype=q.dtype)  # noqa: E741 - the identity
        Tm = torch.linalg.inv(I + (b[:, None] * (K @ K.T)).tril(-1)) * b  # X diag(β)
        kept.append(S)
        S = S + K.T @ (Tm @ V - Tm @ K @ S)  # S_[c+1] = S_[c] + Kᵀ U'
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbeta, dS = torch.zeros_like(beta), dS_T.clone()
    for s, S in reversed(list(zip(starts, kept))):
        Q, K, V, b, dO = q[s:s + C], k[s:s + C], v[s:s + C], beta[s:s + C], do[s:s + C]
        I = torch.eye(len(K), dtype=q.dtype)  # noqa: E741
        KK = K @ K.T
        X = torch.linalg.inv(I + (b[:, None] * KK).tril(-1))  # recomputed
        Tm = X * b  # 𝒯 = X diag(β): column j times β_j
        W, U = Tm @ K, Tm @ V
        U_new = U - W @ S
        Om = (Q @ K.T).tril()
        dU_new = Om.T @ dO + K @ dS  # steps 1 and 2 (dS is dS_[c+1])
        d_Om = (dO @ U_new.T).tril()
        dq[s:s + C] = dO @ S.T + d_Om @ K
        dK = U_new @ dS.T + d_Om.T @ Q
        dW = -dU_new @ S.T  # step 3
        dT = dW @ K.T + dU_new @ V.T  # step 4
        dK = dK + Tm.T @ dW
        dv[s:s + C] = Tm.T @ dU_new
        G = (-X.T @ dT @ Tm.T).tril(-1)  # steps 5 and 6
        dbeta[s:s + C] = (X.T @ dT).diagonal() + (G * KK).sum(1)  # and 7
        dKK = b[:, None] * G  # the gradient of K Kᵀ
        dk[s:s + C] = dK + (dKK + dKK.T) @ K
        dS = dS + Q.T @ dO - W.T @ dU_new  # the adjoint state pass: now dS_[c]
    return dq, dk, dv, dbeta, dS


# %% [markdown]
# Against autograd through the token loop, in float64, at $T = 37$ with chunks of 8 (the last
# one has 5 tokens):

# %%
q, k, v, beta = unit_inputs(1, 1, 37, 8, 6, seed=3)
dO, dS = cotangents(1, 1, 37, 8, 6, seed=4)
reference = autograd_grads(delta_rule.recurrent, (q, k, v, beta), dO, dS)
one = [x[0, 0] for x in (q, k, v, beta, dO, dS)]  # batch 0, head 0
mine = chunked_backward_one_head(*one, C=8)
for name, r, m in zip(["dq", "dk", "dv", "dbeta"], reference, mine):
    print(f"{name:>5s}: {max_diff(m, r[0, 0]):.1e}")

# %% [markdown]
# The gradients agree to float64's rounding: the seven steps are the whole backward pass.
#
# ## In the library
#
# `tinyk3.ops.delta_rule.chunked_backward` is the same computation, arranged as chapter 8
# arranged the forward: every chunk of every head at once, except one sequential pass. Its five
# stages are (1) the UT transform and WY factors, recomputed (`ut_parts` keeps $X$ as well as
# $\mathcal{T}$: dividing $\mathcal{T}$ by $\beta$ would divide by the zero $\beta$ of padded
# tokens); (2) the scores; (3) $U'$ from the boundary states; (4) the adjoint state pass; (5)
# every chunk's gradients at once:

# %%
tinyk3.notebook.show_source(delta_rule.chunked_backward)

# %% [markdown]
# The adjoint state pass mirrors chapter 8's `state_pass`: `torch.baddbmm` twice per chunk,
# with $\Omega^\top \mathrm{d}O$ and $Q^\top \mathrm{d}O$ formed for every chunk beforehand. The
# `decay` argument is for chapter 20's gated rules:

# %%
tinyk3.notebook.show_source(delta_rule.adjoint_state_pass)

# %% [markdown]
# And steps 5 to 7, the UT transform's backward, which chapter 20 reuses with decayed scores:

# %%
tinyk3.notebook.show_source(delta_rule.ut_transform_backward)

# %% [markdown]
# `delta_rule.chunked` is now differentiable through this backward pass. The helper
# `chunks.with_derived_backward` wraps the forward in a `torch.autograd.Function` whose
# `save_for_backward` receives the inputs and the boundary states, nothing else, and whose
# backward calls `chunked_backward` with those states. `backward="autograd"` keeps the old way,
# autograd through the forward's PyTorch operations, for comparison; `chunks.backward_mode`
# switches a whole model from one to the other:

# %%
tinyk3.notebook.show_source(chunks.with_derived_backward)

# %% [markdown]
# **What to keep is a choice.** fla's `chunk_delta_rule` (the kernels behind
# `fla.layers.DeltaNet`) makes the other one. Its forward keeps the UT matrices (its `A`,
# $\mathcal{T}$ without the $\operatorname{diag}(\beta)$, $C$ numbers per token), and its
# backward recomputes the boundary states by running
# the forward's state pass again. This course keeps the boundary states and recomputes
# $\mathcal{T}$. At $C = D$ both keep $T \cdot D$ numbers per head, and fla's choice costs a
# second sequential pass. Its backward has the same stages, in kernels:
#
# | this course (`delta_rule.chunked_backward`) | fla (`fla/ops/delta_rule/chunk.py`, `chunk_delta_rule_bwd`) |
# |---|---|
# | $\mathcal{T}$, $W$, $U$ recomputed (`ut_parts`) | `A` kept by the forward; `w`, `u` from `recompute_w_u_fwd` |
# | $S_{[c]}$ kept, $U'$ recomputed | `h` and `v_new` recomputed by `chunk_gated_delta_rule_fwd_h` |
# | $\Omega^\top \mathrm{d}O$ | `dv` from `chunk_bwd_dv_local` |
# | the adjoint state pass: $\mathrm{d}S_{[c]}$, $\mathrm{d}U'$, $\mathrm{d}S_{[0]}$ | `dh`, `dv`, `dh0` from `chunk_gated_delta_rule_bwd_dhu` |
# | $\mathrm{d}Q$, the output's and state's share of $\mathrm{d}K$, $\mathrm{d}W$ | `dq`, `dk`, `dw` from `chunk_bwd_dqkwg` |
# | steps 4 to 7: $\mathrm{d}V$, the WY share of $\mathrm{d}K$, $\mathrm{d}\beta$ | `dk2`, `dv`, `db` from `prepare_wy_repr_bwd` |
# | `d_state`, the final state's gradient | `dht` |
#
# The notation page lists the same correspondence.

# %% [markdown]
# ## Check: float64, float32 and finite differences
#
# First, float64 against autograd through the token loop, at shapes chosen to be awkward: $T$
# not a multiple of $C$, $D_k \ne D_v$, several heads, with and without an initial state and a
# gradient on the final state. Each line is the largest difference over the four gradients (and
# the initial state's, when there is one) of `chunked` differentiated through the derived
# backward:

# %%
SHAPES = [(1, 2, 37, 8, 5, 8, True, True), (2, 1, 16, 4, 6, 16, False, False),
          (1, 3, 70, 6, 4, 16, False, True), (1, 1, 5, 3, 3, 8, True, False),
          (2, 2, 129, 16, 16, 64, True, True)]
worst_f64 = 0.0
for B, H, T, Dk, Dv, C_, init, final in SHAPES:
    xs = unit_inputs(B, H, T, Dk, Dv, seed=T)
    dO, dS = cotangents(B, H, T, Dk, Dv, seed=T + 1)
    dS = dS if final else torch.zeros_like(dS)
    S0 = torch.randn(B, H, Dk, Dv, dtype=F64) if init else None
    inputs = xs + ((S0,) if init else ())

    def loop(*a, init=init):
        return delta_rule.recurrent(*a[:4], initial_state=a[4] if init else None)

    def chunk(*a, init=init, C_=C_):
        return delta_rule.chunked(*a[:4], chunk_size=C_,
                                  initial_state=a[4] if init else None)

    ref = autograd_grads(loop, inputs, dO, dS)
    got = autograd_grads(chunk, inputs, dO, dS)
    dist = max(max_diff(a, b) for a, b in zip(got, ref))
    worst_f64 = max(worst_f64, dist)
    yes = {True: "yes", False: "no"}
    print(f"B={B} H={H} T={T:3d} Dk={Dk:2d} Dv={Dv:2d} C={C_:2d} S0={yes[init]:3s} "
          f"dS_T={yes[final]:3s}: {dist:.1e}")
print(f"largest: {worst_f64:.1e} (bound 1e-10)")
assert worst_f64 < 1e-10

# %% [markdown]
# Then float32 at $T =$ `T_LONG` tokens, against the same computation in float64. For scale,
# the same comparison is made for autograd through the float32 chunked form: the derived
# backward should round about as well as autograd does. The numbers are relative Frobenius
# distances, and the stated bound is $10^{-5}$:

# %%
xs = unit_inputs(1, 2, T_LONG, D, D, seed=5)
dO, dS = cotangents(1, 2, T_LONG, D, D, seed=6)
exact = delta_rule.chunked_backward(*xs, dO, dS, chunk_size=C)
derived = delta_rule.chunked_backward(*(x.float() for x in xs), dO.float(), dS.float(),
                                      chunk_size=C)
by_autograd = autograd_grads(
    lambda *a: delta_rule.chunked(*a, chunk_size=C, backward="autograd"),
    [x.float() for x in xs], dO.float(), dS.float())


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


worst_f32 = 0.0
for name, e, d, a in zip(["dq", "dk", "dv", "dbeta"], exact, derived, by_autograd):
    worst_f32 = max(worst_f32, rel(d, e))
    print(f"{name:>5s}: derived {rel(d, e):.1e}, autograd {rel(a, e):.1e}")
print(f"T = {T_LONG:,}: largest {worst_f32:.1e} (bound 1e-5)")
assert worst_f32 < 1e-5

# %% [markdown]
# Last, `torch.autograd.gradcheck` compares the backward pass with finite differences of the
# forward, for every input at once, with nothing of the derivation in between:

# %%
xs = [x.requires_grad_() for x in unit_inputs(1, 1, 7, 3, 2, seed=7)]
S0 = torch.randn(1, 1, 3, 2, dtype=F64, requires_grad=True)
ok = torch.autograd.gradcheck(
    lambda q, k, v, b, S: delta_rule.chunked(q, k, v, b, chunk_size=4, initial_state=S),
    (*xs, S0), eps=1e-6, atol=1e-7)
print("gradcheck:", ok)

# %% [markdown]
# ## Experiment: bytes and time against the sequence length
#
# `python -m tinyk3.bench --backward` times forward plus backward of `chunked` with each
# backward pass, in the same run, and records the bytes each keeps. Here it runs for one head
# of 64 channels, $C = 64$, float32, on one thread, up to $T =$ `MEM_TS[-1]`:

# %%
rows = bench.bench_backward(MEM_TS, B=1, H=1, D=D, C=C, repeats=REPEATS,
                            rule="delta_rule")
print(f"{'T':>6s}  {'backward':>8s}  {'kept MiB':>8s}  {'seconds':>8s}  "
      f"{'tokens/s':>9s}")
for r in rows:
    print(f"{r['T']:6,d}  {r['form']:>8s}  {r['kept_bytes'] / MIB:8.2f}  "
          f"{float(r['seconds']):8.3f}  {r['tokens_per_s']:9,.0f}")
derived_rows = [r for r in rows if r["form"] == "derived"]
for r in derived_rows:
    print(f"T = {r['T']:6,d}: the derived backward keeps {r['kept_ratio']:.3f} of "
          f"autograd's bytes and runs {r['speedup']:.2f} x as fast")
print(bench.stamp())

# %% mystnb={"figure": {"caption": "Left: the bytes kept between the forward and the backward pass of the chunked delta rule, one head of 64 channels at C = 64 in float32, against the sequence length, for autograd through the PyTorch forward and for the derived backward, with the inputs' own size for scale. Right: the time of forward plus backward on one CPU thread, for both.", "name": "fig-backward-bytes-and-time"}, "image": {"alt": "Two log-log line plots against sequence length from about one thousand to thirty-two thousand tokens. Left, megabytes kept: both lines are straight with slope one; autograd's lies highest, a few times above a dashed line for the inputs, and the derived backward's lies lowest, below the inputs. Right, seconds for forward plus backward: the derived backward's line lies below autograd's at every length; autograd's bends upward from about ten thousand tokens on and ends several times higher, while the derived backward's rises less steeply."}}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.8, 2.9))
for form, style in (("autograd", "o-"), ("derived", "s-")):
    rs = [r for r in rows if r["form"] == form]
    Ts = [r["T"] for r in rs]
    ax1.plot(Ts, [r["kept_bytes"] / MIB for r in rs], style, label=form)
    ax2.plot(Ts, [float(r["seconds"]) for r in rs], style, label=form)
ax1.plot(Ts, [r["input_bytes"] / MIB for r in rs], "k--", lw=1, label="the inputs")
titles = ("MiB kept for the backward", "seconds, forward + backward")
for ax, title in zip((ax1, ax2), titles):
    ax.set(xscale="log", yscale="log", xlabel="sequence length T", title=title)
    ax.grid(alpha=0.3)
ax1.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# The bytes grow in proportion to $T$ for both, with a constant gap. The derived backward
# keeps the boundary states alone, one $64 \times 64$ state per chunk of 64 tokens, so its bytes
# come to one input's worth; the table prints its share of autograd's.
#
# The time is measured, not assumed. The derived backward does more arithmetic: it recomputes
# each chunk's UT transform, WY factors and scores. It also skips the allocation and the
# bookkeeping of every intermediate autograd keeps, and at short $T$ it is already somewhat
# faster (the table's first rows). From about 8,192 tokens on, autograd's time grows faster
# than the sequence, and the derived backward's more slowly than autograd's. A likely cause is
# memory traffic: autograd's kept tensors, tens of MiB, are far larger than the processor's
# caches, while the derived backward works on one chunk's recomputed intermediates at a time.
#
# ### Training at a context autograd could not fit
#
# Now a small DeltaNet language model: two layers of width 64 with two heads of 32, the
# chunked form at $C = 64$, trained on the course's text (chapter 1's bytes). The budget is
# `BUDGET_MIB` for everything one training step keeps between its forward and backward passes,
# the whole model's activations included. For each backward pass, the cell measures what one
# step keeps at contexts in steps of `STEP` tokens and finds the longest that fits:

# %%
def small_deltanet(T):
    mixer = layers.DeltaNetConfig(n_head=2, form="chunked", chunk_size=C)
    cfg = models.LMConfig(vocab_size=data.VOCAB_SIZE, block_size=T, n_embd=64,
                          pattern=("delta", "delta"), mixers={"delta": mixer},
                          pos_emb=False)
    return models.LM(cfg)


torch.manual_seed(0)
probe = small_deltanet(STEP)
fits = {}
for mode in ("autograd", "derived"):
    T, kept = STEP, step_bytes(probe, STEP, mode)
    while kept <= BUDGET_MIB * MIB:  # the bytes grow with T: stop once over budget
        fits[mode] = T
        T, kept = T + STEP, step_bytes(probe, T + STEP, mode)
    print(f"{mode:>8s}: {kept / T:,.0f} bytes per token; the longest context within "
          f"{BUDGET_MIB} MiB: {fits.get(mode, 0):,} tokens "
          f"({kept / MIB:.1f} MiB at {T:,})")
T_TRAIN = fits["derived"]
assert T_TRAIN > fits.get("autograd", 0)

# %% [markdown]
# The whole model keeps more per token than its mixers alone (projections, norms, the MLPs,
# the logits all keep their inputs), so the gain is smaller than for the mixer, but the context
# that fits grows. Before training at it, one check that the model's gradients are the same
# with either backward pass (float32; the parameters' largest difference):

# %%
model = small_deltanet(T_TRAIN)
corpus = data.encode(data.load_corpus())
train_data, val_data = data.split(corpus)
x, y = data.get_batch(train_data, 1, T_TRAIN, torch.Generator().manual_seed(0))
grads = {}
for mode in ("autograd", "derived"):
    model.zero_grad()
    with chunks.backward_mode(mode):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    grads[mode] = [p.grad.clone() for p in model.parameters()]
diff = max(max_diff(a, b) for a, b in zip(grads["derived"], grads["autograd"]))
scale = max(g.abs().max().item() for g in grads["autograd"])
print(f"largest parameter-gradient difference: {diff:.1e} "
      f"(largest gradient {scale:.1e})")
model.zero_grad()

# %% [markdown]
# Then `TRAIN_STEPS` steps of AdamW at that context, one window of `T_TRAIN` tokens per step,
# with the derived backward (the default):

# %%
before = train.evaluate_loss(model, val_data, 1, T_TRAIN)  # the untrained model
start = time.perf_counter()
result = train.train_lm(model, train_data, val_data, steps=TRAIN_STEPS, batch_size=1,
                        block_size=T_TRAIN, lr=3e-3, warmup=5,
                        eval_every=max(1, TRAIN_STEPS // 4), progress=False)
seconds = time.perf_counter() - start
unigram = data.unigram_entropy(train_data)
print(f"{TRAIN_STEPS} steps at T = {T_TRAIN:,} in {seconds:.0f} s; validation loss "
      f"{before:.2f} -> " + " -> ".join(f"{x:.2f}" for x in result.val_loss)
      + f" nats (the unigram baseline: {unigram:.2f})")

# %% [markdown]
# The model learns at a context that, with autograd's bytes, would not have fitted the same
# budget. Nothing else changed: the same layers, the same optimiser, gradients equal to
# float32's rounding. What changed is what the forward pass hands to the backward pass.
#
# ## Exercises
#
# ```{exercise} One step of the token loop's adjoint
# :label: ex-backward-token-step
#
# Write `token_step_backward(q_t, k_t, v_t, beta_t, S_prev, dS, do_t)`: one step of the delta
# rule's backward pass, for a batch of heads. The forward step is $u_t = \beta_t (v_t - k_t
# S_{t-1})$, $S_t = S_{t-1} + k_t^\top u_t$, $o_t = q_t S_t$. `dS` is $\partial \mathcal{L} /
# \partial S_t$ through the later tokens only ($o_t$'s share not yet added), `do_t` is
# $\partial \mathcal{L} / \partial o_t$. Return `(dq_t, dk_t, dv_t, dbeta_t, dS_prev)`, the
# last being $\partial \mathcal{L} / \partial S_{t-1}$. Shapes: `q_t`, `k_t` `[B, H, Dk]`; `v_t`, `do_t` `[B, H, Dv]`; `beta_t` `[B, H]`;
# `S_prev`, `dS` `[B, H, Dk, Dv]`; the inputs' dtype.
# ```

# %%
def token_step_backward_mine(q_t, k_t, v_t, beta_t, S_prev, dS, do_t):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("backward.token_step", token_step_backward_mine)

# %% [markdown]
# ```{solution-start} ex-backward-token-step
# :class: dropdown
# ```

# %%
def token_step_backward_solution(q_t, k_t, v_t, beta_t, S_prev, dS, do_t):
    b = beta_t[..., None]  # [B, H, 1]
    v_old = torch.einsum("bhk,bhkv->bhv", k_t, S_prev)  # k_t S_{t−1}
    u = b * (v_t - v_old)
    S_t = S_prev + k_t[..., :, None] * u[..., None, :]
    dS = dS + q_t[..., :, None] * do_t[..., None, :]  # o_t's share
    dq = torch.einsum("bhv,bhkv->bhk", do_t, S_t)  # do_t S_tᵀ
    du = torch.einsum("bhk,bhkv->bhv", k_t, dS)  # k_t dS
    d_old = -b * du  # through the read-back k_t S_{t−1}
    dk = (torch.einsum("bhkv,bhv->bhk", dS, u)
          + torch.einsum("bhkv,bhv->bhk", S_prev, d_old))
    dbeta = (du * (v_t - v_old)).sum(-1)
    dS_prev = dS + k_t[..., :, None] * d_old[..., None, :]
    return dq, dk, b * du, dbeta, dS_prev


ok = checks.run("backward.token_step", token_step_backward_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The gradient of the UT transform's inverse
# :label: ex-backward-unit-lower-inverse
#
# Write `inverse_backward(A_low, dX)`: for $X = (I + A_{<})^{-1}$ with $A_{<}$ (`A_low`)
# strictly lower triangular (`[..., C, C]`, a batch of chunks), and $\mathrm{d}X = \partial
# \mathcal{L} / \partial X$, return $\partial \mathcal{L} / \partial A_{<}$, `[..., C, C]`, zero
# on and above the diagonal, in the inputs' dtype. Derive it from $X(I + A_{<}) = I$.
# ```

# %%
def inverse_backward_mine(A_low, dX):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("backward.unit_lower_inverse", inverse_backward_mine)

# %% [markdown]
# ```{solution-start} ex-backward-unit-lower-inverse
# :class: dropdown
# ```

# %%
def inverse_backward_solution(A_low, dX):
    eye = torch.eye(A_low.shape[-1], dtype=A_low.dtype).expand_as(A_low)
    X = torch.linalg.solve_triangular(eye + A_low, eye, upper=False, unitriangular=True)
    Xt = X.transpose(-1, -2)
    # δX = −X δA X, so the gradient is −Xᵀ dX Xᵀ, kept below the diagonal
    return (-Xt @ dX @ Xt).tril(-1)


ok = checks.run("backward.unit_lower_inverse", inverse_backward_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ## Summary
#
# - Autograd through the chunked forward keeps every chunk's intermediates until the backward
#   pass: several times the inputs' size, growing with $T$. For a model of Kimi Linear's shape
#   at a long context this runs to many GiB for the linear mixers alone.
# - The token loop's backward runs the **adjoint state** $\mathrm{d}S_t$ backward in time. The
#   delta rule's read-back $k_t S_{t-1}$ adds a correction, $-k_t^\top \beta_t\, \mathrm{d}u_t$,
#   the backward face of the overwrite.
# - The chunked backward undoes the chunk's lines in reverse: the state update, the output,
#   $U' = U - WS$, the WY factors and the UT transform. The inverse's gradient comes from
#   $XA = I$: $\mathrm{d}A_{<} = \operatorname{tril}(-X^\top \mathrm{d}X\, X^\top, -1)$, and
#   $\beta$ receives two shares. Only the **adjoint state pass**, two matrix products per
#   chunk, is sequential:
#   $\mathrm{d}U'_{[c]} = \Omega_{[c]}^\top \mathrm{d}O_{[c]} + K_{[c]} \mathrm{d}S_{[c+1]}$,
#   $\mathrm{d}S_{[c]} = \mathrm{d}S_{[c+1]} + Q_{[c]}^\top \mathrm{d}O_{[c]} - W_{[c]}^\top
#   \mathrm{d}U'_{[c]}$.
# - The forward keeps the inputs and one state per chunk. The backward recomputes the rest
#   from them (fla keeps the UT matrices and recomputes the states instead).
# - `delta_rule.chunked_backward` equals autograd through the token loop to float64's rounding
#   at awkward shapes, rounds in float32 at long context as autograd does, and passes
#   `gradcheck`. `delta_rule.chunked` is differentiable through it by default;
#   `backward="autograd"` and `chunks.backward_mode` keep the old way for comparison.
# - Measured here: the bytes kept fall to a fixed fraction of autograd's at every length (the
#   boundary states, one input's worth), and forward plus backward runs faster than through
#   autograd at every length measured, by far more at long $T$. A small DeltaNet model trains,
#   to below the unigram baseline, at a context that autograd's bytes would not fit into the
#   same budget.
#
# **Next.** [Chapter 20](20_gated_backward.ipynb) carries the derivation through the gates:
# Gated DeltaNet's scalar decay and KDA's per-channel one, whose gradient becomes a reverse
# cumulative sum.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
