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
# # From the derived backward to GPU kernels
#
# Chapter 9 turned the chunked forward of the delta rule into three Triton kernels, and the
# appendix did the same for the gated rules. Chapters 19 and 20 derived the backward pass and
# ran it in PyTorch, one batched matrix product at a time. This chapter does for the backward
# what chapter 9 did for the forward: it turns chapters 19 and 20's stages into kernels. That is
# what fla ships, forward *and* backward kernels for `chunk_delta_rule`,
# `chunk_gated_delta_rule` and `chunk_kda`, here with the derivation next to every line.
#
# The kernels live in `tinyk3.kernels.backward`: one code path for the three rules, the rule a
# compile-time constant `GATE` (0 the delta rule, 1 Gated DeltaNet, 2 KDA), as in the forward.
# `tinyk3.kernels.<rule>.chunked` is an autograd function whose backward launches them, so a
# model whose mixers use `form="triton"` trains through them.
#
# **In this chapter** you map chapters 19 and 20's stages onto five kernel launches and see
# which one is sequential and why; decide what the forward keeps and what the backward
# recomputes, and compare with fla's choice; read the adjoint pass next to the forward's state
# pass; check every stage, then every gradient of the three rules, against the derived backward
# in float64 under the Triton interpreter, in both precision modes and at the lower-bound gate;
# compile the kernels for two GPUs without one and read what ptxas reports; train a tiny
# Kimi K3-shaped model through the kernels and through the PyTorch backward and compare the
# losses; measure the bytes each backward keeps against the sequence length; and work out the
# grid of every launch and complete the adjoint pass yourself, in Triton.
#
# **Cost.** About a minute on one CPU core (the last cell prints the time): the kernels run
# under the Triton interpreter, which executes every program instance in Python. `SMOKE = True`
# runs in a fraction of that. Without Triton the kernel cells say so and move on.

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

from tinyk3 import checks, data, kernels, layers, models
from tinyk3.checks import ch21_kernel_backward as check_backward
from tinyk3.grad_memory import saved_bytes
from tinyk3.ops import delta_rule, kda
from tinyk3.ops import gated_delta_rule as gdr

if kernels.AVAILABLE:
    import triton.language as tl

    from tinyk3.kernels import backward as kb
    from tinyk3.kernels import delta_rule as kd
    from tinyk3.kernels import gated_delta_rule as kg
    from tinyk3.kernels import kda as kk
    from tinyk3.kernels import runtime
else:  # the kernel cells say so and move on; the exercise's annotations need a name
    from types import SimpleNamespace

    tl = SimpleNamespace(constexpr=None)
    print(f"The kernel cells need Triton: {kernels.REASON}")

F64 = torch.float64
MIB = 2**20
RULES = ["delta_rule", "gated_delta_rule", "kda"]
OPS = {"delta_rule": delta_rule, "gated_delta_rule": gdr, "kda": kda}
GATE = {"delta_rule": 0, "gated_delta_rule": 1, "kda": 2}
NAMES = ["dq", "dk", "dv", "dbeta", "dg", "dS0"]
TRAIN_T = 64 if SMOKE else 128  # the tiny model's context
TRAIN_STEPS = 2 if SMOKE else 6
BYTES_TS = [128, 256] if SMOKE else [256, 512, 1024, 2048]


def rule_inputs(rule, B, H, T, Dk, Dv, seed, *, low=-1.0, stress=False):
    """float32 q, k (unit rows), v, β, the gate (uniform in [low, 0]; stress: −5 per
    step but the first three tokens, and for KDA a third of the channels near 0), S_0,
    and the cotangents dO and dS of the loss ⟨o, dO⟩ + ⟨S_T, dS⟩."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, Dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen)
    beta = torch.rand(B, H, T, generator=gen)
    shape = (B, H, T) if rule == "gated_delta_rule" else (B, H, T, Dk)
    g = None if rule == "delta_rule" else low * torch.rand(shape, generator=gen)
    if stress and g is not None:
        g = torch.full(shape, -5.0)
        g[:, :, :3] = -1e-3
        if rule == "kda":
            g[..., 1::3] = -1e-2
    S0 = torch.randn(B, H, Dk, Dv, generator=gen)
    dO = torch.randn(B, H, T, Dv, generator=gen)
    dS = torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, beta, g, S0, dO, dS


def reference(rule, q, k, v, beta, g, S0, dO, dS, C):
    """Chapters 19-20's derived backward in float64, as a list in NAMES order."""
    x = [t.double() for t in (q, k, v, beta, g) if t is not None]
    r = OPS[rule].chunked_backward(*x, dO.double(), dS.double(), chunk_size=C,
                                   initial_state=S0.double())
    return list(r[:4]) + ([r[4]] if g is not None else [None]) + [r[-1]]


def max_rel(a, b):
    """max |a − b| / max(1, max |b|), the kernels' tests' measure."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


# %% [markdown]
# ## Five launches
#
# Chapter 19 computed the backward in five stages: (1) recompute each chunk's UT transform and
# WY factors, (2) the scores, (3) the deltas $U'$ from the kept boundary states, (4) the adjoint
# state pass backward over the chunks, (5) every chunk's gradients at once. Chapter 20 added the
# gate's factors and the reverse cumulative sum. On a GPU each stage becomes a launch, a grid of
# programs that each own one tile of the work. What decides the split is what can run in
# parallel: a stage that needs the result of the previous *chunk* must loop over the chunks
# inside one program, while a stage that needs only its own chunk runs on a grid of
# $\lceil T / C \rceil \times BH$ programs (times the blocks of a head dimension).
#
# | launch | computes | grid | fla |
# |---|---|---|---|
# | 1 `_wy_kernel` (the forward's) | $W = \mathcal{T} \tilde K$, $U = \mathcal{T} V$ | chunks × heads | `recompute_w_u_fwd` |
# | 2 `_dv_local_kernel` | $P = \Omega^\top \mathrm{d}O$ | $D_v$ blocks × chunks × heads | `chunk_bwd_dv_local` |
# | 3 `_adjoint_kernel` | $\mathrm{d}S_{[c]}$ backward over the chunks | $D_v$ blocks × heads | `chunk_gated_delta_rule_bwd_dhu` |
# | 4 `_ut_backward_kernel` | $\mathrm{d}\mathcal{T}$, the UT backward, $\mathrm{d}V$ | chunks × heads | part of `prepare_wy_repr_bwd` |
# | 5 `_dqk_kernel` | $\mathrm{d}Q$, $\mathrm{d}K$, $\mathrm{d}\beta$, $\mathrm{d}g$ | $D_k$ blocks × chunks × heads | `chunk_bwd_dqkwg`, the rest of `prepare_wy_repr_bwd`, `chunk_local_cumsum` |
#
# What each launch reads and writes:
#
# 1. reads $K, V, \beta, g$ and the kept $X$; writes $W$, $U$.
# 2. reads $Q, K, g, \mathrm{d}O$; writes $P$.
# 3. reads $W, U, S_{[c]}, P, Q, K, g, \mathrm{d}O$ and $\partial \mathcal{L} / \partial S_T$;
#    writes $U'$, $\mathrm{d}U'$, $\mathrm{d}S_{[c+1]}$ and $\mathrm{d}S_0$.
# 4. reads $K, V, \beta, g, X, S_{[c]}, \mathrm{d}U'$; writes $G_m$, the diagonal part of
#    $\mathrm{d}\beta$, and $\mathrm{d}V$.
# 5. reads $Q, K, \beta, g, \mathrm{d}O, X, G_m, S_{[c]}, U', \mathrm{d}U', \mathrm{d}S_{[c+1]}$;
#    writes $\mathrm{d}Q$, $\mathrm{d}K$, the rest of $\mathrm{d}\beta$, and $\mathrm{d}g$.
#
# Here $\tilde K = \gamma \odot K$ are the keys $W$ is made of and $\bar K = \rho \odot K$ the
# keys written into the next state (chapter 20), $\tilde Q = \gamma \odot Q$, and
# $G_m = \operatorname{tril}(-X^\top \mathrm{d}\mathcal{T}\, \mathcal{T}^\top, -1)$ is chapter
# 19's gradient through the inverse (called $G$ there; here $G$ is the gates' running sum), with
# $\mathrm{d}A = \operatorname{diag}(\beta)\, G_m$. The fla names are those of its delta-rule and
# Gated DeltaNet backward (`chunk_kda` has `chunk_kda_bwd_*` kernels of its own, with the same
# stages).
#
# Only launch 3 is sequential, for the reason the forward's state pass is: $\mathrm{d}S_{[c]}$
# needs $\mathrm{d}S_{[c+1]}$, so the state's gradient flows from the last chunk to the first
# as the state flows from the first to the last. Like the forward's state pass, it splits a
# head's $D_v$ columns over programs, because the columns of $\mathrm{d}S$ evolve independently.
# Its loop holds the two products with the state's gradient per chunk
# ($\bar K\, \mathrm{d}S$ and $W^\top \mathrm{d}U'$), and forms $\tilde Q^\top \mathrm{d}O$ and
# the recomputed $U' = U - W S_{[c]}$ in place, which do not depend on it (chapter 19 formed
# $Q^\top \mathrm{d}O$ for every chunk beforehand; here that would be one more $D_k \times D_v$
# tile per chunk through memory). Everything that can wait for $\mathrm{d}U'$ and
# $\mathrm{d}S_{[c+1]}$ to be known runs after it on the wide grids of launches 4 and 5.
#
# Launch 4 needs all of $D_k$ and $D_v$ at once: $\mathrm{d}\mathcal{T} = \mathrm{d}W \tilde
# K^\top + \mathrm{d}U' V^\top$ is a $C \times C$ matrix summed over both, so one program holds
# a whole chunk. Launch 5 splits $D_k$ into blocks: every gradient it forms is a row of $D_k$
# numbers per token, and KDA's gate gradient is one per channel. $\mathrm{d}\beta$ (every rule)
# and Gated DeltaNet's $\mathrm{d}g$ are sums over $D_k$, so each block writes its partial sum,
# and the host adds the blocks and launch 4's diagonal part of $\mathrm{d}\beta$, as fla adds
# its blocks' `dg`. Those sums are the only arithmetic outside the kernels.
#
# The tiles of each launch for the largest heads (C = 64, D = 128):

# %%
if kernels.AVAILABLE:
    for rule in RULES:
        cfg = kb.launch_config(64, 128, 128, GATE[rule])
        print(f"{rule:17s}" + "  ".join(
            f"{name} BK={c['BK']}, BV={c['BV']}, {c['num_warps']} warps"
            for name, c in cfg.items() if name != "wy"))

# %% [markdown]
# ## What the forward keeps, and what the backward recomputes
#
# A backward pass can read only what the forward kept or what it computes again. Three choices
# meet here, for a head of $T$ tokens in chunks of $C$, with $D_k = D_v = D$:
#
# | who | keeps beyond the inputs | recomputes in the backward |
# |---|---|---|
# | chapter 19's PyTorch backward | $S_{[c]}$: $(T/C)\, D^2$ | $\mathcal{T}$ (the solve), $W$, $U$, $U'$ |
# | these kernels | $S_{[c]}$ and $X = (I + A_{<})^{-1}$: $(T/C)\, D^2 + T C$ | $W$, $U$ from $X$; $U'$ |
# | fla | $X$ (its `A`): $T C$ | $W$, $U$ from $X$; every $S_{[c]}$ and $U'$ (a second state pass) |
#
# The two things worth keeping are the two that take a loop to compute: the states (the
# sequential pass over chunks) and $X$ (a $C$-step forward substitution inside each chunk).
# fla keeps the cheaper one, $TC$ numbers, and runs the state pass twice. Chapter 19 kept the
# states and solved again. The kernels keep both, since the forward has written them anyway: the
# backward's launch 1 then has no solve left (`_wy_kernel` with `LOAD_X`), and no state pass
# runs twice. The price is $TC$ numbers more per head, the same as one more head dimension of
# $C$ values per token; the measurement at the end of the chapter shows what that costs.
# Chapter 9's delta-rule forward keeps only the states, so for the delta rule launch 1 solves
# again.
#
# ## The adjoint pass, next to the state pass
#
# Chapter 9's state pass, for one block of the state's columns, loops forward:
#
# $$
# U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}, \qquad
# S_{[c+1]} = \gamma_C \odot S_{[c]} + \bar K_{[c]}^\top U'_{[c]} .
# $$
#
# The adjoint pass loops backward, from $\mathrm{d}S_{[N]} = \partial \mathcal{L} / \partial
# S_T$, and each of its lines is the transpose of one of those products:
#
# $$
# \mathrm{d}U'_{[c]} = P_{[c]} + \bar K_{[c]}\, \mathrm{d}S_{[c+1]}, \qquad
# \mathrm{d}S_{[c]} = \gamma_C \odot \mathrm{d}S_{[c+1]} + \tilde Q_{[c]}^\top \mathrm{d}O_{[c]}
# - W_{[c]}^\top \mathrm{d}U'_{[c]} ,
# $$
#
# with $\bar K = \rho \odot K$ the keys decayed to the chunk's end, $\tilde Q = \gamma \odot Q$
# the queries decayed from its start, and $P = \Omega^\top \mathrm{d}O$ from launch 2. Where
# the state pass *stores* $S_{[c]}$ before updating it, the adjoint pass stores
# $\mathrm{d}S_{[c+1]}$ before updating it: launch 5 reads both. The kernel, with the rule a
# constant (`GATE`), so that the compiler removes the branches a rule does not take:

# %%
if kernels.AVAILABLE:
    tinyk3.notebook.show_source(kb._adjoint_kernel)

# %% [markdown]
# Three details carry over from the forward. The carried $\mathrm{d}S$ stays in float32
# registers, and in the bf16 mode it is rounded only as the operand of a product and when
# stored. $U'$ is recomputed from the kept state with the forward's own line, so it is the
# forward's $U'$ to the last bit (checked below). And every load is masked, since the last
# chunk may be partial and the interpreter does not check addresses.
#
# ## Check: what each stage wrote
#
# `kb.backward(..., return_stages=True)` returns what every launch wrote. One awkward case for
# each rule ($T = 45$ in chunks of 16, so the last chunk has 13 tokens; $D_k = 20$, $D_v = 12$,
# padded to 32 and 16; a random initial state and final-state gradient), each stage from launch
# 2 on against its equation, computed with chapters 19 and 20's PyTorch pieces in float64
# (the reference adjoint pass takes launch 1's $W$ as its input; $W$ and $U$ are the forward's
# stage 1, checked in chapter 9 and the appendix, and $G_m$ is checked through $\mathrm{d}\beta$,
# $\mathrm{d}K$ and $\mathrm{d}g$):

# %%
def stage_checks(rule):
    """Distances of the kernels' stages from their equations (float64 PyTorch)."""
    B, H, T, Dk, Dv, C = 1, 2, 45, 20, 12, 16
    q, k, v, beta, g, S0, dO, dS = rule_inputs(rule, B, H, T, Dk, Dv, seed=3)
    x = [t for t in (q, k, v, beta, g) if t is not None]
    fwd = {"delta_rule": kd, "gated_delta_rule": kg, "kda": kk}[rule].forward_stages(
        *x, chunk_size=C, initial_state=S0)
    st = kb.backward(q, k, v, beta, g, dO, dS, gate=GATE[rule], chunk_size=C,
                     initial_state=S0, states=fwd["states"], x=fwd.get("x"),
                     return_stages=True)
    N, pad = -(-T // C), -T % C

    def chunks(t):  # [B, H, T, D] -> [B·H, N, C, D], zero-padded, float64
        return F.pad(t.double(), (0, 0, 0, pad)).reshape(B * H, N, C, -1)

    Q, K, dOc = chunks(q), chunks(k), chunks(dO)
    if g is None:
        G = torch.zeros(B * H, N, C, 1, dtype=F64)
    else:
        gg = g.double() if g.dim() == 4 else g.double().unsqueeze(-1)
        G = chunks(gg).cumsum(2)  # G_i inside each chunk, [BH, N, C, 1 or Dk]
    pair = torch.exp((G.unsqueeze(3) - G.unsqueeze(2)).clamp(max=0))  # e^{G_i − G_j}
    pair = pair.expand(-1, -1, -1, -1, Q.shape[-1])
    Om = torch.einsum("znid,znjd,znijd->znij", Q, K, pair)
    Om = Om.tril()
    Kt = K * torch.exp(G[:, :, -1:] - G)  # ρ ⊙ K
    Qt = Q * torch.exp(G)  # γ ⊙ Q
    W = chunks(st["w"])
    P = Om.mT @ dOc
    decay = None if g is None else torch.exp(G[:, :, -1]).unsqueeze(-1)  # γ_C, by rows
    dU, dS_next, dS0 = delta_rule.adjoint_state_pass(
        P, Qt.mT @ dOc, W, Kt, dS.double().reshape(B * H, Dk, Dv), decay)
    ref = reference(rule, q, k, v, beta, g, S0, dO, dS, C)
    rows = {
        "P = Ωᵀ dO (launch 2)": max_rel(chunks(st["p"]), P),
        "U' = the forward's U' (launch 3)": max_rel(st["u_new"], fwd["u_new"]),
        "dU' (launch 3)": max_rel(chunks(st["du_new"]), dU),
        "dS_[c+1] (launch 3)": max_rel(st["ds_next"].reshape(B * H, N, Dk, Dv),
                                       dS_next),
        "dS_0 (launch 3)": max_rel(st["dS0"].reshape(B * H, Dk, Dv), dS0),
        "dV (launch 4)": max_rel(st["dv"], ref[2]),
        "dQ, dK (launch 5)": max(max_rel(st["dq"], ref[0]), max_rel(st["dk"], ref[1])),
        "dβ (launches 4, 5)": max_rel(st["dbeta"], ref[3]),
    }
    if g is not None:
        rows["dg (launch 5)"] = max_rel(st["dg"], ref[4])
    return rows


if kernels.AVAILABLE:
    for rule in RULES:
        print(rule)
        for name, err in stage_checks(rule).items():
            print(f"  {name:34s} {err:.1e}")

# %% [markdown]
# Every stage is within float32 rounding of its equation, and $U'$ is the forward's exactly.
# The equations' side here is built from different code than the kernels: the decayed scores
# from an explicit $e^{G_i - G_j}$ per pair, the adjoint pass from chapter 19's
# `adjoint_state_pass`, the last gradients from `chunked_backward`.
#
# ## Check: every gradient, every rule
#
# Now the whole backward, through autograd: the gradients of $\langle o, \mathrm{d}O \rangle +
# \langle S_T, \mathrm{d}S \rangle$ with respect to every input of `kernels.<rule>.chunked`,
# against the derived backward in float64 on the same inputs. The cases: $T$ never a multiple
# of $C$, $D_k \ne D_v$, several $D_k$ blocks in launch 5 ($D_k = 80$), and the gates at
# $-5$ per step (Kimi K3's lower bound) for the gated rules. Both precision modes: float32
# operands with exact products, and bf16 operands with float32 accumulation (fla's mode,
# emulated exactly by the interpreter).

# %%
def through_kernels(rule, q, k, v, beta, g, S0, dO, dS, C, operands):
    """Gradients by autograd through kernels.<rule>.chunked, in NAMES order."""
    mod = {"delta_rule": kd, "gated_delta_rule": kg, "kda": kk}[rule]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, beta, g) if t is not None]
    s0 = S0.clone().requires_grad_()
    o, S = mod.chunked(*leaves, chunk_size=C, initial_state=s0, operands=operands)
    ((o * dO).sum() + (S * dS).sum()).backward()
    grads = [t.grad for t in leaves]
    return grads[:4] + ([grads[4]] if len(grads) == 5 else [None]) + [s0.grad]


CASES = [((1, 2, 45, 20, 12), 16, False), ((1, 1, 100, 80, 24), 64, False),
         ((1, 2, 100, 32, 16), 64, True)]
if SMOKE:
    CASES = [((1, 1, 37, 16, 16), 16, False), ((1, 1, 40, 16, 16), 32, True)]
worst = {"float32": 0.0, "bfloat16": 0.0}
if kernels.AVAILABLE:
    print(f"{'rule':17s}{'B, H, T, Dk, Dv':>20s}{'C':>4s}  {'gates':8s}"
          f"{'float32':>9s}{'bf16':>9s}   worst gradient (bf16)")
    for rule in RULES:
        for shape, C, stress in CASES:
            if stress and rule == "delta_rule":
                continue
            inputs = rule_inputs(rule, *shape, seed=sum(shape), stress=stress)
            ref = reference(rule, *inputs, C)
            errs = {}
            for operands in ("float32", "bfloat16"):
                got = through_kernels(rule, *inputs, C, operands)
                errs[operands] = {n: max_rel(a, b) for n, a, b in zip(NAMES, got, ref)
                                  if b is not None}
            f32, b16 = (max(e.values()) for e in errs.values())
            worst = {"float32": max(worst["float32"], f32),
                     "bfloat16": max(worst["bfloat16"], b16)}
            gates = ("-5/step" if stress else "none" if rule == "delta_rule"
                     else "[-1, 0]")
            name = max(errs["bfloat16"], key=errs["bfloat16"].get)
            print(f"{rule:17s}{str(shape):>20s}{C:4d}  {gates:8s}{f32:9.1e}{b16:9.1e}"
                  f"   {name}")
    print(f"largest: float32 {worst['float32']:.1e} (the tests' bound: 1e-5), "
          f"bf16 {worst['bfloat16']:.1e} (the tests' bound: 3e-2)")

# %% [markdown]
# In float32 the kernels agree with the float64 derivation to the rounding of float32, for every
# rule, at the lower-bound gate too: the factors of chapter 20 are all at most 1, KDA's diagonal
# blocks take their reference point from their first token, and the decay mask's diagonal pairs
# stay out of the gate's terms, in the kernels as in PyTorch. In the bf16 mode the operands of
# every product are rounded to 8 significant bits (7 stored) and the kept intermediates ($W$, $U$, $U'$,
# $\mathrm{d}U'$, $P$, $\mathrm{d}S_{[c+1]}$) are stored in bf16, so the gradients carry errors
# of bf16's size, the size the forward's bf16 mode has (chapter 9).
#
# ## What ptxas reports
#
# The interpreter runs the kernels' code; it says nothing about whether they fit a GPU. As in
# chapter 9, Triton can compile them for a named GPU without one, down to the assembler ptxas,
# which reports the registers each thread uses and what did not fit and was **spilled** to
# local memory (off-chip, slow when it misses the cache). Every backward kernel of each rule,
# compiled for the H100 (sm_90) at $C = 64$, $D = 128$ with bf16 operands, and for the A100
# (sm_80) for KDA:

# %%
def ptxas_rows(targets, C, D):
    rows = []
    for rule, arch in targets:
        out = kb.compile_for_gpu(GATE[rule], arch, chunk_size=C, Dk=D, Dv=D,
                                 dtype=torch.bfloat16, operands="bfloat16")
        for name, compiled in out.items():
            r = runtime.ptxas_report(compiled.asm["ptx"])
            rows.append((rule, f"sm_{arch}", name, r["registers"], r["spill_stores"],
                         compiled.metadata.shared))
    return rows


if kernels.AVAILABLE and runtime.cannot_compile_reason() is None:
    if SMOKE:
        targets, C_PTX, D_PTX = [("kda", 90)], 32, 32
    else:
        targets, C_PTX, D_PTX = [(r, 90) for r in RULES] + [("kda", 80)], 64, 128
    start = time.perf_counter()
    rows = ptxas_rows(targets, C_PTX, D_PTX)
    print(f"C = {C_PTX}, Dk = Dv = {D_PTX}, bf16 operands "
          f"(compiled in {time.perf_counter() - start:.0f} s)")
    print(f"{'rule':17s}{'target':7s}{'kernel':21s}{'registers':>10s}{'spilled B':>10s}"
          f"{'shared B':>10s}")
    for rule, arch, name, regs, spill, shared in rows:
        print(f"{rule:17s}{arch:7s}{name:21s}{regs:10d}{spill:10d}{shared:10d}")
elif kernels.AVAILABLE:
    print(runtime.cannot_compile_reason())

# %% [markdown]
# A thread has at most 255 registers. With bf16 operands, on the H100 the kernels of the delta
# rule and Gated DeltaNet fit at these tiles; KDA's adjoint pass spills a little (next to the
# state's gradient it holds $C \times D_k$ float32 tiles of $\rho \odot K$, $\gamma \odot Q$,
# the gates and their reverse sums, and $W$). On the A100 KDA's kernels spill more, above all
# launch 4, the UT transform's backward (the stored record in `benchmarks/` has launch 4
# spilling about 500 bytes for the other two rules as well, and their other kernels not at
# all), which holds several $C \times C$ float32 tiles ($X$, $\mathcal{T}$,
# $\mathrm{d}\mathcal{T}$, $X^\top \mathrm{d}\mathcal{T}$, $G_m$): the A100's tensor cores
# take both operands of a product from registers, the H100's at least one from shared memory.
# With float32 operands more kernels spill, on both GPUs (the record).
# The tiles were chosen from such reports for both targets (one-off sweeps of tile sizes and
# warps; sixteen warps cap a thread at 128 registers and spill more). fla splits its $C \times C$
# work into $16 \times 16$ blocks, which is the next step if the spills cost time. Whether they
# do is a measurement on a GPU: `tools/gpu_check_kernels.py` runs these kernels compiled, checks
# their gradients against the float64 token loops and times forward + backward against fla's
# `chunk_*` kernels with peak memory; its record format is fixed, for the first GPU run to fill
# in.
#
# ## Experiment: a tiny K3-shaped model trained through the kernels
#
# Kimi K3 puts one MLA layer after every three KDA layers (chapter 17). A tiny model of that
# shape (width 32, two heads of 16, KDA with K3's lower-bound gate, chunks of 64, a SwiGLU
# feed-forward), built twice from the same seed: once with `form="triton"` for its KDA layers,
# so that every forward and backward of a KDA layer runs the kernels under the interpreter, and
# once with `form="chunked"`, the PyTorch form with chapter 20's derived backward. Both are
# trained with AdamW on the same batches of the course's text:

# %%
def tiny_k3_shaped(form, T):
    kda_cfg = layers.KDAConfig(n_head=2, head_dim=16, conv_size=4, gate="lower_bound",
                               chunk_size=64, form=form)
    mla_cfg = layers.MLAConfig(n_head=2, kv_lora_rank=16, qk_nope_head_dim=16,
                               qk_rope_head_dim=0, v_head_dim=16, use_rope=False)
    cfg = models.LMConfig(vocab_size=data.VOCAB_SIZE, block_size=T, n_embd=32,
                          pattern=[kda_cfg, kda_cfg, kda_cfg, mla_cfg],
                          mlp=layers.SwiGLUConfig(hidden=64), pos_emb=False,
                          norm="rmsnorm", tie_embeddings=False)
    torch.manual_seed(0)
    return models.LM(cfg)


def train_losses(form, batches):
    model = tiny_k3_shaped(form, TRAIN_T)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x in batches:
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


corpus = data.encode(data.load_corpus())
gen = torch.Generator().manual_seed(1)
starts = torch.randint(0, len(corpus) - TRAIN_T - 1, (TRAIN_STEPS, 2), generator=gen)
batches = [torch.stack([corpus[s:s + TRAIN_T + 1] for s in row.tolist()])
           for row in starts]
losses, seconds = {}, {}
if kernels.AVAILABLE:
    for form in ("triton", "chunked"):
        start = time.perf_counter()
        losses[form] = train_losses(form, batches)
        seconds[form] = time.perf_counter() - start
        print(f"{form:8s} {TRAIN_STEPS} steps at T = {TRAIN_T} in "
              f"{seconds[form]:5.1f} s: " + " ".join(f"{x:.4f}" for x in losses[form]))
    gap = max(abs(a - b) / b for a, b in zip(losses["triton"], losses["chunked"]))
    ratio = seconds["triton"] / seconds["chunked"]
    print(f"largest relative difference of the losses: {gap:.1e}; the interpreted "
          f"kernels took {ratio:.0f}x the PyTorch form's time")

# %% mystnb={"figure": {"caption": "The training loss of the tiny K3-shaped model at every step, trained once through the Triton kernels under the interpreter (crosses) and once through the PyTorch form with the derived backward (circles), from the same weights on the same batches.", "name": "fig-kernels-train"}, "image": {"alt": "A line plot of training loss against step, falling from about 5.55 nats. Two series, circles for the PyTorch backward and crosses for the Triton kernels, lie on top of each other at every step."}}
if losses:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps = range(1, TRAIN_STEPS + 1)
    ax.plot(steps, losses["chunked"], "o-", label="PyTorch form, derived backward")
    ax.plot(steps, losses["triton"], "x--", ms=9, label="Triton kernels (interpreter)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title("A tiny K3-shaped model, trained two ways")
    ax.legend()
    plt.show()

# %% [markdown]
# The two runs agree to float32 rounding at every step, within $10^{-5}$ relative (the bound
# the unit tests hold the same comparison to), after several optimizer updates (each
# step's weights come from the previous step's gradients, so a wrong gradient anywhere would
# show as a drift that grows). The kernels' time here is the interpreter's, many times the
# PyTorch form's (the ratio printed above): the point of running them on a CPU is to check
# them, not to train with them.
#
# ## Experiment: what each backward keeps
#
# One KDA call at $B = 1$, $H = 2$, $D = 64$, $C = 64$, float32: the bytes autograd holds
# between the forward and the backward beyond the inputs' own storages, for plain autograd
# through the PyTorch form, the PyTorch form with the derived backward, and the kernels, against
# $T$:

# %%
def kept_bytes(rule_fn, T):
    gen = torch.Generator().manual_seed(T)
    q = F.normalize(torch.randn(1, 2, T, 64, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, 2, T, 64, generator=gen), dim=-1)
    v = torch.randn(1, 2, T, 64, generator=gen)
    beta = torch.rand(1, 2, T, generator=gen)
    g = -torch.rand(1, 2, T, 64, generator=gen)
    leaves = [t.requires_grad_() for t in (q, k, v, beta, g)]
    return saved_bytes(rule_fn, *leaves).bytes


WAYS = {"autograd through the PyTorch form":
        lambda *x: kda.chunked(*x, chunk_size=64, backward="autograd"),
        "PyTorch form, derived backward": lambda *x: kda.chunked(*x, chunk_size=64)}
if kernels.AVAILABLE:
    WAYS["Triton kernels"] = lambda *x: kk.chunked(*x, chunk_size=64)
kept = {name: [kept_bytes(fn, T) for T in BYTES_TS] for name, fn in WAYS.items()}
print(f"{'T':>6s}" + "".join(f"{name:>36s}" for name in kept))
for i, T in enumerate(BYTES_TS):
    print(f"{T:6d}" + "".join(f"{kept[name][i] / MIB:33.2f} MiB" for name in kept))

# %% mystnb={"figure": {"caption": "What one KDA call keeps for its backward beyond its inputs, against the sequence length, at B = 1, H = 2, D = 64, C = 64, float32: autograd through the PyTorch form, the PyTorch form with the derived backward (the chunk states), and the Triton kernels (the chunk states and the inverses X). Both axes are logarithmic.", "name": "fig-kernels-kept-bytes"}, "image": {"alt": "A log-log plot of mebibytes kept against sequence length. Three parallel straight lines: autograd's highest, the Triton kernels' about a tenth of it, the derived backward's half of the kernels'."}}
fig, ax = plt.subplots(figsize=(6, 3.2))
for (name, values), marker in zip(kept.items(), "os^"):
    ax.plot(BYTES_TS, [b / MIB for b in values], marker + "-", label=name)
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xlabel("sequence length T")
ax.set_ylabel("kept for the backward (MiB)")
ax.set_title("One KDA call, B = 1, H = 2, D = 64, C = 64")
ax.legend(fontsize=8)
plt.show()

# %%
if kernels.AVAILABLE:
    last = {name: values[-1] for name, values in kept.items()}
    states = 2 * (BYTES_TS[-1] // 64) * 64 * 64 * 4
    inverses = 2 * BYTES_TS[-1] * 64 * 4
    ours = last["Triton kernels"]
    derived = ours / last["PyTorch form, derived backward"]
    plain = ours / last["autograd through the PyTorch form"]
    print(f"at T = {BYTES_TS[-1]}: the kernels keep {derived:.2f}x the derived "
          f"backward's bytes and {plain:.3f}x autograd's")
    print(f"  the chunk states: {states / MIB:.2f} MiB, "
          f"the inverses X: {inverses / MIB:.2f} MiB")
for D in (64, 128):  # numbers kept per token and head, at C = 64
    per_state, per_x = D * D / 64, 64
    print(f"D = {D}: chunk states {per_state:.0f} numbers per token, X {per_x}: the "
          f"kernels keep {(per_state + per_x) / per_state:.2f}x the derived backward's "
          "bytes")

# %% [markdown]
# All three grow linearly with $T$. The derived backward keeps only the chunk states; the
# kernels keep the states and the inverses $X$, twice as much at $C = D = 64$ (the states are
# $D^2 / C = 64$ numbers per token and head, the inverses $C = 64$), and still a small fraction
# of what autograd keeps, which holds every chunk's intermediates. At $D = 128$ the states are
# four times the inverses, and the kernels keep 1.25 times the derived backward's bytes (the
# last line above).
#
# ## Exercises
#
# ```{exercise} The grids of the backward launches
# :label: ex-backward-launch-grids
#
# Write `launch_grids(B, H, T, Dk, Dv, C, cfg)`: the grid of each of the five backward
# launches, in launch order `(wy, dv_local, adjoint, ut_backward, dqk)`, for $B \cdot H$ heads
# of $T$ tokens in chunks of $C$, each grid a tuple of ints with the program axes in the order
# the kernels read them (`program_id(0)` first). `cfg` maps each launch's name to its tiles,
# `{"BK": ..., "BV": ...}`, as `kb.launch_config` returns them. The table at the top of the
# chapter has what each launch splits; the check's messages are in English.
# ```

# %%
def launch_grids_mine(B, H, T, Dk, Dv, C, cfg):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("backward.launch_grids", launch_grids_mine)

# %% [markdown]
# ```{solution-start} ex-backward-launch-grids
# :class: dropdown
# ```

# %%
def launch_grids_solution(B, H, T, Dk, Dv, C, cfg):
    NT, BH = -(-T // C), B * H  # a partial last chunk still needs its programs

    def blocks(D, stage, tile):
        return -(-D // cfg[stage][tile])

    return ((NT, BH),  # 1: one program per chunk
            (blocks(Dv, "dv_local", "BV"), NT, BH),  # 2: P has Dv columns
            (blocks(Dv, "adjoint", "BV"), BH),  # 3: sequential, no chunk axis
            (NT, BH),  # 4: dT sums over all of Dk and Dv
            (blocks(Dk, "dqk", "BK"), NT, BH))  # 5: blocks of Dk columns


ok = checks.run("backward.launch_grids", launch_grids_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The adjoint state pass, in Triton
# :label: ex-backward-adjoint-kernel
#
# Complete `adjoint_kernel_mine`, one program per head on a grid `(B·H,)`: the delta rule's
# adjoint pass (launch 3 with `GATE = 0` and the state's gradient in one block). Start from
# `b_dS` $= \partial \mathcal{L} / \partial S_T$ (`ds_T`, `[BK, BV]` at `i_bh·Dk·Dv`), and
# for the chunks $c = N-1, \dots, 0$ form $\mathrm{d}U'_{[c]} = P_{[c]} + K_{[c]}\,
# \mathrm{d}S$, store it in `du_new`, and update
# $\mathrm{d}S \leftarrow \mathrm{d}S + Q_{[c]}^\top \mathrm{d}O_{[c]} - W_{[c]}^\top
# \mathrm{d}U'_{[c]}$. After the loop store $\mathrm{d}S$ (now $\partial \mathcal{L} / \partial
# S_0$) in `ds0`. Tensors are contiguous float32: `k, w, q [B·H, T, Dk]`,
# `p, do, du_new [B·H, T, Dv]`, `ds_T, ds0 [B·H, Dk, Dv]`; `BK` and `BV` are $D_k$ and $D_v$
# padded to powers of two, so every load and store needs a mask.
# `check_backward.check_adjoint_kernel` launches your kernel under the Triton interpreter on
# five fixed random cases against `delta_rule.adjoint_state_pass`, with every tensor between
# NaN margins, so an unmasked load reads NaN and an unmasked store is seen. The messages are
# in English.
# ```

# %%
def adjoint_kernel_mine(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT,
                        BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_bh = tl.program_id(0)  # which (batch, head)
    o_i = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    # your code here: load dS, loop backward over the chunks, store dU' and dS_0
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = check_backward.check_adjoint_kernel(adjoint_kernel_mine)

# %% [markdown]
# ```{solution-start} ex-backward-adjoint-kernel
# :class: dropdown
# ```

# %%
tinyk3.notebook.show_source(check_backward.adjoint_kernel_solution)
ok = check_backward.check_adjoint_kernel(check_backward.adjoint_kernel_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# A typical slip, the loop written forward as the state pass's is, fails on the second case,
# the first with more than one chunk, and the check names it:

# %%
if kernels.AVAILABLE:

    def adjoint_kernel_forward(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT,
                               BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        i_bh = tl.program_id(0)
        o_i, o_k, o_v = tl.arange(0, BC), tl.arange(0, BK), tl.arange(0, BV)
        m_kv = (o_k[:, None] < Dk) & (o_v[None, :] < Dv)
        p_s = i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        b_dS = tl.load(ds_T + p_s, mask=m_kv, other=0.0)
        for i_c in range(0, NT):  # the slip: forward over the chunks
            o_t = i_c * BC + o_i
            m_tk = (o_t[:, None] < T) & (o_k[None, :] < Dk)
            m_tv = (o_t[:, None] < T) & (o_v[None, :] < Dv)
            p_tk = i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
            p_tv = i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
            b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
            b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
            b_q = tl.load(q + p_tk, mask=m_tk, other=0.0)
            b_du = tl.load(p + p_tv, mask=m_tv, other=0.0)
            b_du += tl.dot(b_k, b_dS, input_precision="ieee")
            tl.store(du_new + p_tv, b_du, mask=m_tv)
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
            b_dS += tl.dot(tl.trans(b_q), b_do, input_precision="ieee")
            b_dS -= tl.dot(tl.trans(b_w), b_du, input_precision="ieee")
        tl.store(ds0 + p_s, b_dS, mask=m_kv)

    result = check_backward.check_adjoint_kernel(adjoint_kernel_forward)

# %% [markdown]
# ## Summary
#
# - The backward of the chunked rules maps onto five launches: the forward's stage 1 again,
#   $\Omega^\top \mathrm{d}O$, the adjoint state pass, the UT transform's backward with
#   $\mathrm{d}V$, and $\mathrm{d}Q$, $\mathrm{d}K$, $\mathrm{d}\beta$, $\mathrm{d}g$ with the
#   reverse cumulative sum. One code path serves the three rules, the rule a compile-time
#   constant, as in the forward. The launches map onto fla's delta-rule and Gated DeltaNet
#   backward kernels (launches 4 and 5 share the work of its `prepare_wy_repr_bwd`).
# - Only the adjoint pass is sequential, for the reason the state pass is: the state's
#   gradient flows from the last chunk to the first. Its loop holds the products with the
#   state's gradient and forms $\tilde Q^\top \mathrm{d}O$ and $U'$ in passing; everything else
#   runs on grids as wide as the forward's.
# - What to keep is a choice between two loops. The kernels keep the chunk states and the
#   inverses $X$, both written by the forward, so no state pass runs twice and, for the gated
#   rules, no solve either; fla keeps only $X$ and runs its state pass again; chapter 19's
#   PyTorch backward keeps only the states. The kernels keep 0.09 of autograd's bytes for a KDA
#   call at $T = 2048$, the derived backward half that.
# - Under the Triton interpreter the kernels' gradients equal the float64 derivation to float32
#   rounding for the three rules, the lower-bound gate included, and to bf16 rounding in fla's
#   precision mode; a tiny K3-shaped model trains through them to the PyTorch backward's losses.
# - Compiled without a GPU with bf16 operands, the kernels fit the H100's registers but for
#   KDA's adjoint pass; on the A100 the UT transform's backward spills. Whether that costs time, and how the kernels
#   compare with fla's, is what `tools/gpu_check_kernels.py` measures on a GPU.
#
# **Next.** The course ends here. The [where to go next](../book/next.md) page lists what it
# leaves out (among them fla's tuned backward kernels, for the times these kernels have yet to
# be compared with on a GPU).

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
