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
# # From the maths to a GPU kernel
#
# Chapter 8 ended with an exact chunkwise algorithm and a PyTorch implementation of it that does
# every chunk at once except one short sequential pass. On a GPU that implementation is still a
# string of separate framework calls: each intermediate ($W$, $U$, the scores, every chunk's
# state) goes out to the GPU's main memory and comes back, and the state pass launches two small
# matrix products per chunk, one after another. Kernel libraries such as flash-linear-attention
# (fla) write the same algorithm as a handful of GPU kernels instead. This chapter writes it
# as three kernels in Triton, `tinyk3.kernels.delta_rule.chunked`: one program per chunk computes
# the scaled $K K^\top$, the triangular solve and $W$, $U$; one program per head and block of state
# columns runs the sequential pass with the state held on chip; one program per chunk computes
# the outputs.
#
# **In this chapter** you see which stages a production kernel splits the work into, why only
# the state pass is sequential, and what is stored or recomputed for the backward pass; write a
# first small Triton kernel and check it; read the three kernels block by block, each next to
# the chapter-8 equation it implements; run them under the Triton interpreter on this CPU and
# check every stage against the PyTorch form (a sequence length that is not a multiple of the chunk
# size, a non-zero initial state, both the separate and the fused output pass); compile them for
# real NVIDIA GPUs without one and read what comes out (Triton's IR, PTX, the registers and
# shared memory each stage needs); and, where a GPU is present (Colab), time the compiled kernel.
#
# **Cost.** Under a minute on one CPU core at full size, most of it compiling the kernels for a
# GPU target and running them under the interpreter (the last cell prints the time);
# `SMOKE = True` runs in a few seconds. Triton is optional (Linux only): without it every Triton
# cell prints why it skipped and the rest of the chapter runs.

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
import inspect
import re
import subprocess
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import Code, display
from matplotlib.lines import Line2D

import tinyk3.kernels as kernels
from tinyk3 import checks
from tinyk3.kernels import delta_rule as kd
from tinyk3.ops import delta_rule, wy

GPU = torch.cuda.is_available()
if kernels.AVAILABLE:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    cuda_note = ("; CUDA tensors run compiled on " + torch.cuda.get_device_name() if GPU
                 else "; no CUDA GPU here")
    print(f"Triton {kernels.TRITON_VERSION}: CPU tensors run under its interpreter"
          + cuda_note)
else:
    print(f"{kernels.REASON}. The Triton cells below print this and skip; "
          "the rest of the chapter runs. "
          "To run them, install Triton (`pip install triton`, Linux).")

T_INTERP = 64 if SMOKE else 256  # sequence length of the interpreter timing
SWEEP_CS = [16] if SMOKE else [16, 32, 64]  # chunk sizes of the interpreter check
COMPILE_CS = [16] if SMOKE else [16, 32, 64]  # chunk sizes compiled for sm_90
COMPILE_D = 32 if SMOKE else 128  # head size compiled for sm_90 (Kimi Linear's is 128)
PRECISIONS = ["tf32"] if SMOKE else ["tf32", "ieee"]  # tl.dot input precisions compiled


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def inputs(B, H, T, Dk, Dv, seed, dtype=torch.float32):
    """Unit keys, β in (0, 1), standard normal queries and values,
    a random initial state."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=g), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    S0 = torch.randn(B, H, Dk, Dv, generator=g)
    return (*(x.to(dtype) for x in (q, k, v, beta)), S0.to(dtype))


def show_part(fn, first, last=None):
    """Display the lines of a lib function's source from the one containing `first`
    to the one containing `last` (to the end if None): the lib's text, in pieces."""
    lines = inspect.getsource(fn).splitlines()
    i = next(n for n, line in enumerate(lines) if first in line)
    if last:
        j = next(n for n, line in enumerate(lines) if n >= i and last in line)
    else:
        j = len(lines) - 1
    display(Code("\n".join(lines[i:j + 1]), language="python"))


# %% [markdown]
# ## A GPU kernel, in Triton's terms
#
# A GPU runs a kernel as a **grid of programs**. In Triton you write what *one* program does; the
# launch `kernel[grid](...)` runs it once for every point of the grid (up to three axes), in any
# order and largely in parallel. Inside, a program knows where it is from `tl.program_id(axis)`,
# and works on **tiles**, small blocks of numbers whose shapes are compile-time constants
# (`tl.constexpr`, powers of two):
#
# - `tl.arange(0, BC)` is the vector $0, 1, \dots, BC - 1$; index arithmetic on such vectors
#   (with `[:, None]` and `[None, :]` broadcasting) gives a tile of **offsets** into a tensor;
# - `tl.load(ptr + offsets, mask=..., other=0.0)` reads those elements from the GPU's main
#   (global) memory into **registers**; where the mask is false it reads nothing and yields
#   `other`. `tl.store` writes back, only where the mask is true;
# - `tl.dot(a, b)` multiplies two tiles (their shared inner dimension at least 16 for 16- and
#   32-bit inputs, in Triton 3.7 on NVIDIA GPUs) on the tensor cores, except in the exact `"ieee"`
#   float32 mode met below, staging the operands through **shared memory**, the small on-chip
#   memory of one streaming multiprocessor;
# - element-wise arithmetic, `tl.where`, reductions act on tiles in registers.
#
# Programs of one launch do not talk to each other (short of atomic operations). The only way one program's result reaches
# another is to store it to global memory and let a *later launch* read it, or to keep both pieces
# of work in the same program. That single fact decides how the chunked delta rule is cut into
# kernels.
#
# **Layout.** The tensors are `[B, H, T, D]` and contiguous, so the kernels see them as
# `[B·H, T, D]`: element $(bh, t, d)$ sits at offset $bh \cdot T D + t \cdot D + d$, and chunk $c$ of
# head $bh$ is the rows $t = cC, \dots, cC + C - 1$. The last chunk may run past $T$; its extra rows
# are masked (they load as $k = 0$, $\beta = 0$, which change nothing, and are never stored).

# %% [markdown]
# ## The stages, and why only one is sequential
#
# Chapter 8's equations for chunk $c$ (rows are tokens, $M$ the lower-triangular mask $j \le i$):
#
# $$
# \begin{aligned}
# A_c &= \operatorname{tril}(\operatorname{diag}(\beta_c) K_c K_c^\top, -1), &
# T_c &= (I + A_c)^{-1} \operatorname{diag}(\beta_c), &
# W_c &= T_c K_c, \quad U_c = T_c V_c, \\
# U'_c &= U_c - W_c S_c, &
# S_{c+1} &= S_c + K_c^\top U'_c, &
# O_c &= Q_c S_c + (Q_c K_c^\top \odot M)\, U'_c .
# \end{aligned}
# $$
#
# fla's forward for the delta rule runs five steps, and this chapter's kernel does the same
# work in three launches:
#
# | stage | computes | needs | fla | here | grid (programs) |
# |---|---|---|---|---|---|
# | scaled $KK^\top$ | $A_c$ | the chunk's $K_c$, $\beta_c$ | `chunk_scaled_dot_kkt_fwd` | `_wy_kernel` | chunks × heads |
# | triangular solve | $T_c = (I + A_c)^{-1} \operatorname{diag}(\beta_c)$ | $A_c$ | `solve_tril` | `_wy_kernel` | |
# | WY factors | $W_c$, $U_c$ | $T_c$, $K_c$, $V_c$ | `recompute_w_u_fwd` | `_wy_kernel` | |
# | **state pass** | $U'_c$, $S_{c+1}$, storing $S_c$ | $S_c$: **the chunk before** | `chunk_gated_delta_rule_fwd_h` | `_state_kernel` | value blocks × heads |
# | output pass | $O_c$ | $S_c$, $U'_c$ (stored) | `chunk_fwd_o` | `_output_kernel` | value blocks × chunks × heads |
#
# Read the "needs" column. The first three stages use only their own chunk's inputs: every chunk
# of every head is an independent program. The output of chunk $c$ needs $S_c$ and $U'_c$, but once
# the state pass has stored them, every chunk's output is independent again. Only
# $S_{c+1} = S_c + K_c^\top (U_c - W_c S_c)$ links a chunk to the one before, so only the state pass
# must walk the chunks in order, and it does so *inside one program*: a loop over the chunks that
# carries $S$ in registers. It has only $B \cdot H$ (times the number of value blocks, below)
# programs, each doing $\lceil T/C \rceil$ steps of two products with the state. Everything else
# runs on grids $\lceil T / C \rceil$ times larger.
#
# Why fuse the first three into one kernel here: $A_c$ and $T_c$ are $C \times C$ and stay in
# registers from the product $K K^\top$ to the solve to $W$ and $U$, so nothing but $W$ and $U$ goes to
# global memory. fla keeps them as separate kernels, each tuned on its own and shared with the
# gated variants, and stores $A_c$ and $(I + A_c)^{-1}$ in between.

# %% [markdown]
# ## A first kernel: the scaled $KK^\top$
#
# Before reading the lib's kernels, one small kernel built here: the first stage alone, one
# program per chunk and head, writing
#
# $$
# A_c = \operatorname{tril}(\operatorname{diag}(\beta_c) K_c K_c^\top, -1), \qquad (A_c)_{ij} = \beta_i\, (k_i \cdot k_j) \text{ for } j < i, \text{ else } 0,
# $$
#
# into an output `a` of shape `[B·H, T, C]`: row $t$ holds its chunk's row of $A_c$ (fla's layout
# for this intermediate). Each line maps to a piece of the equation: `program_id` picks the
# chunk and head, `arange` builds the row and column indices, the mask cuts the last chunk and
# the padding columns (a head size $D$ that is not a power of two is padded to `BD`), `tl.dot`
# is $K_c K_c^\top$, the row scaling is $\operatorname{diag}(\beta_c)$, and `tl.where` with
# $i > j$ is $\operatorname{tril}(\cdot, -1)$.

# %%
if kernels.AVAILABLE:

    def scaled_kkt_kernel(k, beta, a, T, D, BC: tl.constexpr, BD: tl.constexpr):
        i_c = tl.program_id(0)  # which chunk
        i_bh = tl.program_id(1)  # which (batch, head)
        o_i = tl.arange(0, BC)  # row (and column) index inside the chunk   [C]
        o_t = i_c * BC + o_i  # token index of each row                       [C]
        o_d = tl.arange(0, BD)  # column of k, padded to a power of two      [BD]
        m_t = o_t < T  # rows past the end of the sequence are padding
        m_td = m_t[:, None] & (o_d[None, :] < D)
        p_k = k + i_bh * T * D + o_t[:, None] * D + o_d[None, :]  # addresses of K_c
        b_k = tl.load(p_k, mask=m_td, other=0.0)  # K_c                     [C, BD]
        b_beta = tl.load(beta + i_bh * T + o_t, mask=m_t, other=0.0)  # β_c   [C]
        # diag(β) K Kᵀ   [C, C]
        b_A = b_beta[:, None] * tl.dot(b_k, tl.trans(b_k), input_precision="ieee")
        b_A = tl.where(o_i[:, None] > o_i[None, :], b_A, 0.0)  # keep j < i
        p_a = a + i_bh * T * BC + o_t[:, None] * BC + o_i[None, :]  # addresses in a
        tl.store(p_a, b_A, mask=m_t[:, None])

    def scaled_kkt(k, beta, C):
        """Launch it: compiled for CUDA tensors, interpreted for CPU tensors."""
        B, H, T, D = k.shape
        a = torch.empty(B, H, T, C, dtype=torch.float32, device=k.device)
        if k.is_cuda:
            kernel = triton.jit(scaled_kkt_kernel)
        else:
            kernel = InterpretedFunction(scaled_kkt_kernel)
        grid = (triton.cdiv(T, C), B * H)  # one program per (chunk, head)
        BD = max(16, triton.next_power_of_2(D))
        kernel[grid](k.contiguous(), beta.contiguous(), a, T, D, BC=C, BD=BD)
        return a
else:
    print(kernels.REASON)

# %% [markdown]
# `triton.jit` is what `@triton.jit` does; `InterpretedFunction` is what it does when the variable
# `TRITON_INTERPRET=1` is set: it runs the same function on NumPy arrays, one program after
# another, in Python. The lib chooses per call in the same way, so one process can interpret on
# the CPU and compile for a GPU. The check, against chapter 7's `wy.ut_matrix` ($I + A_c$) on
# zero-padded chunks, for $T = 37$ (the third chunk has 5 tokens) and $D = 20$ (padded to 32):

# %%
if kernels.AVAILABLE:
    B, H, T, D, C = 2, 3, 37, 20, 16
    _, k, _, beta, _ = inputs(B, H, T, D, D, seed=0)
    a = scaled_kkt(k, beta, C)  # [B, H, T, C]
    N, pad = -(-T // C), -T % C
    # chunks, zero-padded   [B, H, N, C, D]
    kc = F.pad(k, (0, 0, 0, pad)).view(B, H, N, C, D)
    bc = F.pad(beta, (0, pad)).view(B, H, N, C)
    # tril(diag(β) K Kᵀ, −1) per chunk   [B, H, N, C, C]
    A_ref = wy.ut_matrix(kc, bc) - torch.eye(C)
    d_A = max_diff(a, A_ref.flatten(2, 3)[:, :, :T])
    print(f"max |A from my kernel - wy.ut_matrix - I| = {d_A:.1e} "
          f"({N} chunks x {B * H} heads = {N * B * H} programs)")
else:
    print(kernels.REASON)

# %% [markdown]
# ## Stage 1: `_wy_kernel`, every chunk at once
#
# The lib's first kernel starts exactly like the small one: program $(i_c, i_{bh})$ owns tokens
# $i_c C, \dots, i_c C + C - 1$ of head $i_{bh}$, and loads its $\beta_c$. (The head index is cast to
# 64-bit integers: $B \cdot H \cdot T \cdot D$ can exceed $2^{31}$, and an `int32` offset would wrap.)

# %%
show_part(kd._wy_kernel, "i_c = tl.program_id(0)", "b_beta = tl.load")

# %% [markdown]
# Then $A_c = \operatorname{tril}(\operatorname{diag}(\beta_c) K_c K_c^\top, -1)$. For a large head
# size the kernel does not load all of $K_c$ at once: it walks $D_k$ in blocks of `BK` columns and
# accumulates, $K_c K_c^\top = \sum_{b} K_c^{(b)} K_c^{(b)\top}$ (a sum over column blocks), so the tiles
# stay small.

# %%
show_part(kd._wy_kernel, "b_A = tl.full", "b_A = tl.where")

# %% [markdown]
# **The triangular solve, one row at a time, in registers.** Write $(I + A)^{-1} = I + N$. Row $i$ of
# $X = (I + A)^{-1}$ solves $X_i + \sum_{j<i} A_{ij} X_j = e_i$, so, with $X_j = e_j + N_j$,
#
# $$
# N_i = -A_i - \sum_{j<i} A_{ij} N_j , \qquad T_c = (I + N)\operatorname{diag}(\beta_c) .
# $$
#
# The kernel starts from $N = -A$ (so row $i$ still holds $-A_i$ when its turn comes), and at step $i$
# reads that row out with a masked sum, adds $\sum_j A_{ij} N_j$ as one product of the row with the
# whole tile (the terms $j \ge i$ vanish because $A_{ij} = 0$ there), and writes the row back with
# `tl.where`. A tile has no "row $i$" to index in registers; selecting and writing rows by masks
# over the whole tile is how a kernel does it.

# %%
show_part(kd._wy_kernel, "b_N = -b_A", "b_T = ")

# %% [markdown]
# The same loop written with PyTorch operations on one chunk (each line the tile operation
# above: masked row sum, row-times-tile reduction, masked write), against chapter 7's
# `wy.ut_transform`:

# %%
C = 16
_, k, _, beta, _ = inputs(1, 1, C, 32, 32, seed=1)
k_c, b_c = k[0, 0], beta[0, 0]  # one chunk: [C, Dk], [C]
o_i = torch.arange(C)
# A_c   [C, C]
A = torch.where(o_i[:, None] > o_i[None, :], b_c[:, None] * (k_c @ k_c.T), 0.0)
N = -A
for i in range(1, C):
    row = torch.where(o_i[:, None] == i, N, 0.0).sum(0)  # −A_i, read out by a mask  [C]
    row = row + (row[:, None] * N).sum(0)  # −A_i − Σ_j A_ij N_j                     [C]
    N = torch.where(o_i[:, None] == i, row[None, :], N)  # write row i back
T_c = (N + torch.eye(C)) * b_c[None, :]  # (I + N) diag(β): scale column j by β_j
print(f"max |T from the row loop - wy.ut_transform| = "
      f"{max_diff(T_c, wy.ut_transform(k_c, b_c)):.1e}")

# %% [markdown]
# ($-A_i - \sum_j A_{ij} N_j$ is computed as $r + \sum_j r_j N_j$ with $r = -A_i$: the signs cancel.) The
# substitution costs $C$ dependent steps of $O(C^2)$ vector work, about $3C^3$ flops, against $C^3/3$
# for an optimal triangular inverse. fla's `solve_tril` does better: it inverts $16 \times 16$
# diagonal blocks and fills in the rest with block matrix products, chapter 7's block forward
# substitution (by default in `"ieee"` precision, so not on the tensor cores). Finally $W_c = T_c K_c$ and $U_c = T_c V_c$, again block by block, stored as
# float32:

# %%
show_part(kd._wy_kernel, "# -- W = T K")

# %% [markdown]
# **What lives where.** $A_c$, $N$ and $T_c$ ($C \times C$ each) never leave the program: they are
# registers (and shared memory while `tl.dot` uses them). Global memory sees the reads of
# $K_c$ (twice: once for $KK^\top$, once for $W$; a reload is cheaper than keeping a $C \times D_k$ tile alive
# through the solve), $V_c$, $\beta_c$ and the writes of $W_c$, $U_c$.

# %% [markdown]
# ## Stage 2: `_state_kernel`, the one sequential loop
#
# $$
# U'_c = U_c - W_c S_c, \qquad S_{c+1} = S_c + K_c^\top U'_c, \qquad c = 0, 1, \dots, N - 1 .
# $$
#
# **Why the columns of $S$ can be split over programs.** Take any set $J$ of the state's $D_v$
# columns. Both equations act on $S$ column by column, $U'_c[:, J] = U_c[:, J] - W_c\, S_c[:, J]$
# and $S_{c+1}[:, J] = S_c[:, J] + K_c^\top U'_c[:, J]$: columns $J$ of the next state need only columns
# $J$ of this one (and all of $W_c$, $K_c$). So the state of one head can be cut into blocks of `BV`
# columns, each carried by its own program, with no communication. That multiplies the
# parallelism of the sequential stage by $D_v / BV$, and shrinks what each program keeps in
# registers to a $D_k \times BV$ block. Checked with the lib's PyTorch state pass
# (`delta_rule._state_pass`, chapter 8) on the whole state and on column blocks of 8:

# %%
B, H, T, Dk, Dv, C = 1, 2, 64, 16, 24, 16
q, k, v, beta, S0 = inputs(B, H, T, Dk, Dv, seed=2)
Kc, Vc = (x.unflatten(2, (-1, C)).flatten(0, 1) for x in (k, v))  # [B·H, N, C, D]
bc = beta.unflatten(2, (-1, C)).flatten(0, 1)[..., None]  # [B·H, N, C, 1]
Wc, Uc = delta_rule._wy_stage(Kc, Vc, bc)
S_start = S0.flatten(0, 1)  # [B·H, Dk, Dv]
whole = delta_rule._state_pass(Wc, Uc, Kc.mT, S_start)  # every S_c, every U'_c, S_N
# columns j, ..., j + 7 of the state, one block at a time
blocks = [delta_rule._state_pass(Wc, Uc[..., j:j + 8], Kc.mT, S_start[..., j:j + 8])
          for j in range(0, Dv, 8)]
names = ("states S_c", "deltas U'_c", "final state")
for name, full, parts in zip(names, whole, zip(*blocks)):
    side_by_side = torch.cat(parts, dim=-1)
    print(f"{name:>12s}: max |blocks side by side - whole| = "
          f"{max_diff(side_by_side, full):.1e}")

# %% [markdown]
# The grid is therefore (value blocks, heads). A program loads its columns of $S_0$ (or starts
# from zero) into a float32 register tile `b_S` of shape $[D_k, BV]$, where `BK` is all of $D_k$:

# %%
show_part(kd._state_kernel, "i_v = tl.program_id(0)", "b_S += tl.load")

# %% [markdown]
# and then loops over the chunks. Per chunk it stores $S_c$ *before* updating (the output pass
# needs the state the chunk starts from), computes $U'_c$, stores it, and updates the register tile
# with `b_S += tl.dot(tl.trans(b_k), b_du)`. Nothing about $S$ touches global memory inside the loop
# except that one store of $S_c$. (With `FUSE_OUTPUT`, the output of the chunk is computed right
# here instead, from the same tiles: nothing is stored, but that work then runs on the few
# programs of the sequential pass.)

# %%
show_part(kd._state_kernel, "for i_c in range(0, NT)", "tl.store(s_out")

# %% [markdown]
# ## Stage 3: `_output_kernel`, every chunk at once again
#
# $$
# O_c = Q_c S_c + (Q_c K_c^\top \odot M)\, U'_c
# $$
#
# One program per (value block, chunk, head) reads the stored $S_c$ and $U'_c$. Both $Q_c S_c$ and
# $Q_c K_c^\top$ are sums over $D_k$, so they are accumulated together block by block; the mask keeps
# $j \le i$ (diagonal included: $o_t$ reads the state after token $t$ wrote), and one more product adds
# the intra-chunk part:

# %%
show_part(kd._output_kernel, "# -- Q_c S_c and Q_c K_c")

# %% [markdown]
# Note the recomputation: the scores $Q_c K_c^\top$ are computed again by each of the $D_v / BV$ value
# blocks of a chunk rather than stored once ($C$ numbers per token) and read back. fla's
# `chunk_fwd_o` makes the same choice (one program per value block and chunk, each forming its own
# $Q_c K_c^\top$): the bet is that at these tile sizes a $C \times D_k$ by $D_k \times C$ product costs
# less than the memory traffic it would save.
#
# ## The host side: three launches
#
# `chunked` validates the inputs and calls `_forward`, which allocates the intermediates and
# launches the three grids. `launch_config` picks the tile sizes and launch options (chosen by
# compiling for a GPU target and reading the compiler's resource report, as done below):

# %%
show_part(kd._forward, "# stage 1: W, U", "o = o.to(out_dtype)")
for C_, D_ in ((64, 128), (16, 32)):
    print(f"launch_config(C={C_}, Dk=Dv={D_}):", kd.launch_config(C_, D_, D_))
cfg = kd.launch_config(64, 128, 128)["state"]
n_programs = -(-128 // cfg["BV"])  # per head
per_thread = cfg["BK"] * cfg["BV"] // (cfg["num_warps"] * 32)  # float32 registers
print(f"state pass at C = 64, D = 128: {n_programs} programs per head, "
      f"each a [{cfg['BK']}, {cfg['BV']}] float32 state tile "
      f"over {cfg['num_warps']} warps = {per_thread} registers per thread")

# %% [markdown]
# At $C = 64$, $D = 128$ a head's state is carried by several programs (the last line), and the
# state tile that each keeps in registers for its whole loop, spread over the threads of its
# warps (32 threads each), costs only a small part of a thread's registers. The rest go to the
# tiles of $W_c$, $K_c$ and $U'_c$ that each chunk's products need.

# %% [markdown]
# ## What goes through memory, and what the backward pass recomputes
#
# Everything a later launch reads must be stored, so the split has a price in global memory. Per
# token and head, at $C = 64$, $D_k = D_v = 128$, with bfloat16 inputs (2 bytes) and float32
# intermediates (4 bytes), where the per-chunk states $S_c$ ($D_k D_v$ numbers per chunk) count
# $D_k D_v / C$ numbers per token:

# %%
C_, Dk_, Dv_ = 64, 128, 128
per_token = {  # numbers per token and head, bytes per number
    "inputs q, k, v, beta (bf16)": (Dk_ + Dk_ + Dv_ + 1, 2),
    "stage 1 -> 2: W, U (fp32)": (Dk_ + Dv_, 4),
    "stage 2 -> 3: S_c (fp32)": (Dk_ * Dv_ / C_, 4),
    "stage 2 -> 3: U' (fp32)": (Dv_, 4),
    "(I + A_c)^-1 (bf16), kept by fla": (C_, 2),
}
for name, (n, nbytes) in per_token.items():
    print(f"{name:>34s}: {n:6.0f} numbers = {n * nbytes:6.0f} bytes per token and head")

# %% [markdown]
# The per-chunk states alone take more bytes than the inputs, and with $W$, $U$, $U'$ the
# intermediates outweigh the inputs several times over. That is why the **backward pass stores
# little and recomputes**: fla's `chunk_delta_rule` saves only $q, k, v, \beta$, the initial state and
# the $C \times C$ inverses $(I + A_c)^{-1}$ (64 numbers a token here; $T_c$ is one scaling by $\beta$
# away); its backward recomputes $W$ and $U$ from them
# (`recompute_w_u_fwd`) and runs the state pass again (`chunk_gated_delta_rule_fwd_h`) to get every
# $S_c$ and $U'_c$, then runs its gradient kernels. Recomputing the state pass costs one more
# sequential sweep; storing its output would cost the memory above for every layer of the model
# until the backward reaches it. (This is the same trade activation checkpointing makes, built
# into the kernel.)
#
# The lib's kernel is forward-only; its `autograd.Function` stores only the inputs, and its
# backward recomputes everything with the PyTorch chunked form under autograd and differentiates
# that:

# %%
tinyk3.notebook.show_source(kd._ChunkedFunction.backward)

# %% [markdown]
# Gradients through the Triton forward against gradients of the PyTorch form, for the same
# incoming gradients (the interpreter runs the forward, at a small size):

# %%
if kernels.AVAILABLE:
    q, k, v, beta, S0 = inputs(1, 2, 37, 16, 16, seed=3)
    g = torch.Generator().manual_seed(3)
    d_o = torch.randn(1, 2, 37, 16, generator=g)  # incoming gradients
    d_S = torch.randn(1, 2, 16, 16, generator=g)
    grads = {}
    for name, fn in (("triton", kd.chunked), ("pytorch", delta_rule.chunked)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, S0)]
        o, S = fn(*leaves[:4], chunk_size=16, initial_state=leaves[4])
        ((o * d_o).sum() + (S * d_S).sum()).backward()
        grads[name] = [x.grad for x in leaves]
    names = ("q", "k", "v", "beta", "S0")
    dists = ", ".join(f"{n} {max_diff(a, b):.1e}"
                      for n, a, b in zip(names, *grads.values()))
    largest = max(x.abs().max().item() for x in grads["pytorch"])
    print("max |grad (Triton forward) - grad (PyTorch)|: " + dists
          + f" (gradients up to {largest:.0f})")
else:
    print(kernels.REASON)

# %% [markdown]
# ## Check: the kernels under the interpreter, stage by stage
#
# `kd.forward_stages` runs the three launches and returns what each wrote. On CPU tensors they run
# under the Triton interpreter: the kernels' own code, masks and loops, on NumPy. One awkward case:
# $T = 37$ with $C = 16$ (a 5-token last chunk), head sizes $D_k = 20$, $D_v = 12$ (tiles padded to 32
# and 16), two batch entries, and a non-zero initial state. Each stage against its equation,
# computed with the PyTorch pieces of chapters 7 and 8 on zero-padded chunks:

# %%
if kernels.AVAILABLE:
    B, H, T, Dk, Dv, C = 2, 2, 37, 20, 12, 16
    q, k, v, beta, S0 = inputs(B, H, T, Dk, Dv, seed=4)
    st = kd.forward_stages(q, k, v, beta, chunk_size=C, initial_state=S0)
    N, pad = -(-T // C), -T % C

    def chunks(x):  # [B, H, T, D] -> [B, H, N, C, D], zero-padded
        return F.pad(x, (0, 0, 0, pad)).view(B, H, N, C, -1)

    beta_c = F.pad(beta, (0, pad)).view(B, H, N, C)
    W_ref, U_ref = wy.wy_factors(chunks(k), chunks(v), beta_c)
    S_all, U_new, S_N = delta_rule._state_pass(W_ref.flatten(0, 1), U_ref.flatten(0, 1),
                                               chunks(k).flatten(0, 1).mT,
                                               S0.flatten(0, 1))
    o_ref, S_ref = delta_rule.chunked(q, k, v, beta, chunk_size=C, initial_state=S0)
    print({name: tuple(x.shape) for name, x in st.items()})
    print(f"stage 1: max |W - T K| = {max_diff(chunks(st['w']), W_ref):.1e}, "
          f"max |U - T V| = {max_diff(chunks(st['u']), U_ref):.1e}")
    d_states = max_diff(st["states"].flatten(0, 1), S_all)
    d_u_new = max_diff(chunks(st["u_new"]).flatten(0, 1), U_new)
    print(f"stage 2: max |S_c - state pass| = {d_states:.1e}, "
          f"max |U' - state pass| = {d_u_new:.1e}, "
          f"max |S_N| diff = {max_diff(st['S'].flatten(0, 1), S_N):.1e}")
    print(f"stage 3: max |o - delta_rule.chunked| = {max_diff(st['o'], o_ref):.1e} "
          f"(outputs up to {o_ref.abs().max():.1f}), "
          f"final state {max_diff(st['S'], S_ref):.1e}")
else:
    print(kernels.REASON)

# %% [markdown]
# Every stage agrees to float32 round-off. Now the end result over a small grid of cases: the three
# chunk sizes the kernel supports, $T$ a multiple of $C$ or not, a zero or a random initial state,
# the separate output pass and the fused one, against the PyTorch form in float32 (same inputs, same
# chunk size) and in float64. Several seconds at full size (the cell prints its time).

# %%
if kernels.AVAILABLE:
    t0 = time.perf_counter()
    print(f"{'C':>3s} {'T':>4s} {'S_0':>6s} {'output':>8s} {'|o - fp32|':>11s} "
          f"{'|S - fp32|':>11s} {'|o - fp64|':>11s} {'|S - fp64|':>11s}")
    worst = 0.0
    for C in SWEEP_CS:
        for T in (2 * C, 2 * C + 5):
            q, k, v, beta, S0 = inputs(1, 2, T, 32, 32, seed=C + T)
            q64, k64, v64, beta64 = (x.double() for x in (q, k, v, beta))
            for init in (None, S0):
                init64 = None if init is None else init.double()
                o32, S32 = delta_rule.chunked(q, k, v, beta, chunk_size=C,
                                              initial_state=init)
                o64, S64 = delta_rule.chunked(q64, k64, v64, beta64, chunk_size=C,
                                              initial_state=init64)
                for fuse in (False, True):
                    o, S = kd.chunked(q, k, v, beta, chunk_size=C, initial_state=init,
                                      fuse_output=fuse)
                    errs = (max_diff(o, o32), max_diff(S, S32),
                            max_diff(o, o64), max_diff(S, S64))
                    worst = max(worst, *errs)
                    init_name = "random" if init is not None else "zero"
                    pass_name = "fused" if fuse else "separate"
                    print(f"{C:3d} {T:4d} {init_name:>6s} {pass_name:>8s} "
                          + " ".join(f"{e:11.1e}" for e in errs))
    print(f"largest distance {worst:.1e} ({time.perf_counter() - t0:.0f} s)")
else:
    print(kernels.REASON)

# %% [markdown]
# In the run shown here every distance is at the level of float32 round-off (the largest is printed
# last), for the partial last chunks, the initial states and the fused pass alike (`tests/test_kernels.py`
# asserts $2 \cdot 10^{-6}$ relative against float32 and $10^{-5}$ against float64, and checks
# bfloat16 and float16 inputs and gradients too).
#
# **The interpreter is for checking, not for speed.** Each program is Python over NumPy arrays, one
# after another. One call at a larger size, against the PyTorch chunked form on the same inputs
# (about two seconds at full size):

# %%
if kernels.AVAILABLE:
    q, k, v, beta, S0 = inputs(1, 4, T_INTERP, 64, 64, seed=5)
    t0 = time.perf_counter()
    o_k, S_k = kd.chunked(q, k, v, beta, chunk_size=64, initial_state=S0)
    t_interp = time.perf_counter() - t0
    t0 = time.perf_counter()
    o_p, S_p = delta_rule.chunked(q, k, v, beta, chunk_size=64, initial_state=S0)
    t_torch = time.perf_counter() - t0
    print(f"T = {T_INTERP}, 4 heads of 64: interpreter {t_interp:.2f} s, "
          f"PyTorch chunked {t_torch * 1e3:.1f} ms "
          f"({t_interp / t_torch:.0f}x); max |o| diff {max_diff(o_k, o_p):.1e}")
else:
    print(kernels.REASON)

# %% [markdown]
# ## On a GPU: the compiled kernel
#
# On CUDA tensors the same call compiles the kernels (`triton.jit`) and runs them on the GPU. The
# next cell runs only where a CUDA GPU is present (on Colab: *Runtime → Change runtime type*, an
# L4 or A100 GPU for the kernels as they are designed; the free T4 is outside Triton's supported
# range, see {ref}`which-gpu` below). It checks the compiled kernel against the PyTorch form in
# float64 (float32 inputs, `input_precision="ieee"`), then times the forward pass with
# half-precision inputs (bfloat16 on GPUs of compute capability 8.0 and later, float16 on older
# ones such as the T4) for the Triton kernel (tensor cores, tf32, where the GPU has them), the
# PyTorch chunked form (`delta_rule.chunked`) and causal softmax
# attention (`F.scaled_dot_product_attention`) on the same $q, k, v$, using `triton.testing.do_bench`.
# No GPU number appears in this text: none was measured for it. `python tools/gpu_check_kernels.py`
# in a checkout of the repository is the full check (more shapes and precisions, gradients, fla if
# installed, the time share of each stage).

# %%
if not kernels.AVAILABLE:
    print(kernels.REASON)
elif not GPU:
    print("No CUDA GPU here: the compiled kernels were not run and nothing was timed. "
          "On a GPU machine this cell checks and times them; "
          "`python tools/gpu_check_kernels.py` runs the full check.")
else:
    dev = torch.device("cuda")
    bf16_ok = torch.cuda.get_device_capability() >= (8, 0)  # compute capability 8.0 on
    half = torch.bfloat16 if bf16_ok else torch.float16
    B, H, T, D = (1, 2, 512, 64) if SMOKE else (4, 16, 4096, 128)
    q, k, v, beta, S0 = (x.to(dev) for x in inputs(B, H, T, D, D, seed=6))
    o, S = kd.chunked(q, k, v, beta, chunk_size=64, initial_state=S0,
                      input_precision="ieee")
    o64, S64 = delta_rule.chunked(*(x.double() for x in (q, k, v, beta)), chunk_size=64,
                                  initial_state=S0.double())
    print(f"{torch.cuda.get_device_name()}, B={B}, H={H}, T={T}, D={D}: "
          f"compiled kernel (float32, ieee) against PyTorch float64: "
          f"max |o| diff {max_diff(o, o64):.1e}, max |S| diff {max_diff(S, S64):.1e}")
    qh, kh, vh, bh = (x.to(half) for x in (q, k, v, beta))
    forms = {
        "Triton kernel (tf32)":
            lambda: kd.chunked(qh, kh, vh, bh, chunk_size=64),
        "PyTorch chunked form":
            lambda: delta_rule.chunked(qh, kh, vh, bh, chunk_size=64),
        "softmax attention (SDPA, causal)":
            lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True),
    }
    with torch.no_grad():
        ms = {name: triton.testing.do_bench(fn) for name, fn in forms.items()}
    for name, t_ms in ms.items():
        print(f"{name:>34s}: {t_ms:8.3f} ms ({B * T / t_ms:10.0f} tokens/ms, {half})")

# %% [markdown]
# ## Compiling for real GPUs, without one
#
# The interpreter runs the kernels' logic, but not the compiler: it accepts tiles that are not
# powers of two, dtype mismatches in `tl.dot`, operations a GPU backend lacks, and it cannot say how
# many registers or how much shared memory a program needs. Triton can compile for a *named* target
# without a GPU present: `kd.compile_for_gpu(arch)` calls `triton.compile` with
# `GPUTarget("cuda", arch, 32)` (90: H100, 80: A100), which runs the whole tool chain, Triton IR →
# TritonGPU IR → LLVM IR → PTX → the `ptxas` assembler shipped inside the Triton wheel → a cubin.
# One compile at the production size, $C = 64$, $D_k = D_v = 128$, bfloat16 inputs, tf32 products, for
# sm_90 (a few seconds; less when Triton's on-disk cache already holds the result):

# %%
reason = None if not kernels.AVAILABLE else kd.cannot_compile_reason()
if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    t0 = time.perf_counter()
    compiled = kd.compile_for_gpu(90, chunk_size=64 if not SMOKE else 16,
                                  Dk=COMPILE_D, Dv=COMPILE_D,
                                  dtype=torch.bfloat16, input_precision="tf32")
    print(f"compiled {list(compiled)} for sm_90 in {time.perf_counter() - t0:.1f} s")
    state = compiled["_state_kernel"]
    print("stages of the tool chain:", list(state.asm))

    def strip(line, width=150):
        line = re.sub(r"\s*loc\(#loc\d*\)\s*$", "", line.strip())
        return line if len(line) <= width else line[:width] + " …"

    print("\nTriton IR (ttir) of the state pass: "
          "the loop over chunks and its two tl.dot")
    for line in state.asm["ttir"].splitlines():
        if "scf.for" in line or "tt.dot" in line:
            print("   ", strip(line))
    print("\nTritonGPU IR (ttgir): the same loop after layout assignment")
    for line in state.asm["ttgir"].splitlines():
        is_dot = "warp_group_dot " in line or "tt.dot " in line
        if "scf.for" in line or is_dot or "local_alloc %b_S" in line:
            print("   ", strip(line))
    ptx = state.asm["ptx"]
    mma = [strip(line) for line in ptx.splitlines()
           if "mma_async" in line or "mma.sync" in line]
    target = re.search(r"[.]target (\S+)", ptx).group(1)
    print(f"\nPTX: {len(ptx.splitlines())} lines for target {target}, "
          f"{len(mma)} tensor-core instructions, e.g.")
    for line in mma[:2]:
        print("   ", line)
    print("\nshared memory per program (bytes, from the metadata):",
          {name: c.metadata.shared for name, c in compiled.items()})

# %% [markdown]
# What to read in it:
#
# - **Triton IR**: the state pass is a loop (`scf.for`) from 0 to the number of chunks that carries
#   one value, the state tile `tensor<Dk x BV x f32>` (`iter_args`), and does the two products of
#   the equations, $W_c S_c$ and $K_c^\top U'_c$, as `tt.dot` with `inputPrecision = tf32`.
# - **TritonGPU IR**: the compiler has given every tile a *layout* (which thread holds which
#   element). The loop-carried state has an `nvidia_mma` layout, the layout of an accumulator of
#   the tensor cores: it stays in registers from one chunk to the next. For $W_c S_c$, where it is
#   the right operand, it is copied into shared memory (`local_alloc`), because Hopper's
#   `warp_group_dot` (the `wgmma` instruction) reads that operand from there; in $K_c^\top U'_c$ it
#   is the accumulator and stays in registers.
# - **PTX**: the NVIDIA virtual instruction set, with `wgmma.mma_async` instructions working on
#   tf32 operands and float32 accumulators.
# - **Shared memory**: the bytes each program reserves; a streaming multiprocessor runs as many
#   programs at once as its shared memory and registers allow.
#
# Registers and spills come from `ptxas`, the assembler that turns PTX into machine code: run with
# `-v` it reports the registers each thread uses and the bytes it *spills* to (slow, off-chip)
# local memory when the registers a thread may use are not enough. It ships in the Triton wheel:

# %%
MAX_REGISTERS = 255  # per thread, the architectural limit of NVIDIA GPUs


def ptxas_report(ptx):
    """Registers per thread and spill-store bytes, from ptxas -v
    (the one shipped with Triton)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    arch = re.search(r"[.]target (\S+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [str(ptxas), "-v", f"--gpu-name={arch}", str(src),
               "-o", str(Path(tmp) / "k.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    report = out.stdout + out.stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return regs, spills, report


if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    regs, spills, report = ptxas_report(state.asm["ptx"])
    print("\n".join(line for line in report.splitlines()
                    if "registers" in line or "spill" in line))
    print(f"(an NVIDIA thread can address at most {MAX_REGISTERS} registers)")

# %% [markdown]
# (which-gpu)=
# ### Which GPU: a free T4, or an L4 or A100
#
# Colab's free GPU is a T4, an NVIDIA GPU of compute capability 7.5 (Turing). Triton states its
# support as NVIDIA GPUs of compute capability 8.0 and later (A100 is 8.0, L4 8.9, H100 9.0),
# and a T4's tensor cores take float16 but neither tf32 nor bfloat16. Nothing in this chapter
# was run on a T4 (or on any GPU). What the compiler does for one can be measured without it:
# the next cell compiles the state pass for sm_75 (T4), sm_80 (A100) and sm_89 (L4), float16
# inputs, asking for tf32 products and for exact `"ieee"` ones, and counts in the PTX the
# tensor-core instructions (`mma`) and the scalar float32 multiply-adds (`fma.rn.f32`).

# %%
TARGETS = {75: "T4", 80: "A100", 89: "L4"}
if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    print(f"{'GPU':>5s} {'arch':>6s} {'asked':>6s} {'mma':>5s} {'fma.f32':>8s}")
    same_as_ieee = {}
    for arch, gpu in TARGETS.items():
        ptx = {}
        for precision in ("tf32", "ieee"):
            compiled_arch = kd.compile_for_gpu(
                arch, chunk_size=16 if SMOKE else 64, Dk=64, Dv=64,
                dtype=torch.float16, input_precision=precision)
            ptx[precision] = compiled_arch["_state_kernel"].asm["ptx"]
            n_mma = len(re.findall(r"\b(?:mma\.sync|wgmma)\.\S+", ptx[precision]))
            n_fma = ptx[precision].count("fma.rn.f32")
            target = f"sm_{arch}"
            print(f"{gpu:>5s} {target:>6s} {precision:>6s} {n_mma:5d} {n_fma:8d}")
        same_as_ieee[gpu] = ptx["tf32"] == ptx["ieee"]
    for gpu, same in same_as_ieee.items():
        verdict = ("the same PTX as ieee: no tensor cores" if same
                   else "tensor-core code, unlike ieee")
        print(f"{gpu}: tf32 asked, {verdict}")

# %% [markdown]
# In the run shown here the sm_75 build asked for tf32 comes out as the same PTX as the exact
# one: every tile product becomes scalar float32 multiply-adds on the T4's CUDA cores, while
# sm_80 and sm_89 get tensor-core `mma` instructions. So, on Colab:
#
# - **the free T4** runs every PyTorch form of the course on its GPU (float32 or float16). The
#   Triton kernels compile for it and the GPU cell above runs them there with float16 inputs,
#   but outside Triton's supported range and without tensor cores for their products: use it to
#   check the compiled kernels, not to judge their speed;
# - **an L4 or A100 runtime** (compute capability 8.9 or 8.0, tf32 and bfloat16 tensor cores)
#   runs the kernels as designed, and the GPU cell's and `tools/gpu_check_kernels.py`'s timings
#   mean what they say there.

# %% [markdown]
# ## Experiment: what each stage needs, against the chunk size
#
# `launch_config`'s choices come from reports like that one. The experiment compiles the three
# kernels for sm_90 at $D_k = D_v = 128$ (bfloat16 inputs) for each chunk size the kernel supports, with
# tf32 products (tensor cores, the fast mode) and with `"ieee"` float32 products (the exact mode used
# for checking), and reads each stage's registers per thread, spilled bytes, shared memory and
# number of tensor-core (`mma`) instructions in its PTX.
# Several seconds at full size (the cell prints its time: six compiles of three kernels, then
# `ptxas -v` on each), longer when Triton's cache does not hold them yet.
#
# Next to it, a number no compiler reports: the **arithmetic intensity** of each stage, its flops
# per byte of global memory traffic, counted from the kernels' loads, stores and `tl.dot`s per chunk
# and head (bfloat16 inputs, float32 intermediates, $D_v / BV$ value blocks each re-reading their
# operands). A GPU reaches its peak rate only on work that does many flops per byte it moves; below
# that the memory system sets the pace.

# %%
def stage_traffic(C, Dk, Dv, BV, in_bytes=2, f32=4):
    """(flops, bytes) per chunk and head of each stage, counted from the kernels."""
    nV = -(-Dv // BV)  # value blocks: each re-reads what it needs of W, K, Q
    # flops: KKᵀ, substitution, TK, TV
    wy_ = (2 * C * C * Dk + 3 * C**3 + 2 * C * C * Dk + 2 * C * C * Dv,
           2 * C * Dk * in_bytes + C * Dv * in_bytes + C * in_bytes
           + C * (Dk + Dv) * f32)
    # flops: W_c S_c and K_cᵀ U'_c
    state = (2 * 2 * C * Dk * Dv,
             nV * C * Dk * (f32 + in_bytes) + C * Dv * f32 + Dk * Dv * f32
             + C * Dv * f32)
    # flops: Q S, Q Kᵀ (per block), (QKᵀ⊙M) U'
    output = (2 * C * Dk * Dv + nV * 2 * C * C * Dk + 2 * C * C * Dv,
              nV * 2 * C * Dk * in_bytes + Dk * Dv * f32 + C * Dv * f32
              + C * Dv * in_bytes)
    return {"_wy_kernel": wy_, "_state_kernel": state, "_output_kernel": output}


def count_mma(ptx):
    """The tensor-core (mma) instructions in a PTX listing."""
    return sum("mma_async" in line or "mma.sync" in line for line in ptx.splitlines())


# launch_config's name for each kernel
CONFIG_KEYS = {"_wy_kernel": "wy", "_state_kernel": "state", "_output_kernel": "output"}
# (precision, C) -> {stage: (registers, spill bytes, shared bytes, mma instructions)}
resources = {}
if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    t0 = time.perf_counter()
    for prec in PRECISIONS:
        for C in COMPILE_CS:
            out = kd.compile_for_gpu(90, chunk_size=C, Dk=COMPILE_D, Dv=COMPILE_D,
                                     dtype=torch.bfloat16, input_precision=prec)
            resources[prec, C] = {}
            for name, c in out.items():
                n_regs, n_spill, _ = ptxas_report(c.asm["ptx"])
                resources[prec, C][name] = (n_regs, n_spill, c.metadata.shared,
                                            count_mma(c.asm["ptx"]))
    print(f"compiled and assembled {3 * len(resources)} kernels "
          f"in {time.perf_counter() - t0:.0f} s; "
          f"sm_90, Dk = Dv = {COMPILE_D}, bf16 inputs")
    print(f"{'precision':>9s} {'C':>3s} {'stage':>15s} {'warps':>5s} {'registers':>9s} "
          f"{'spill B':>8s} {'shared KB':>9s} {'mma instr.':>10s}")
    for (prec, C), stages in resources.items():
        cfg = kd.launch_config(C, COMPILE_D, COMPILE_D)
        for name, (r, s, sh, n_mma) in stages.items():
            warps = cfg[CONFIG_KEYS[name]]["num_warps"]
            print(f"{prec:>9s} {C:3d} {name:>15s} {warps:5d} {r:9d} {s:8d} "
                  f"{sh / 1024:9.0f} {n_mma:10d}")

print(f"\narithmetic intensity (flops per byte), Dk = Dv = {COMPILE_D}:")
intensity = {}
for C in (16, 32, 64):
    if kernels.AVAILABLE:
        BV = kd.launch_config(C, COMPILE_D, COMPILE_D)["state"]["BV"]
    else:
        BV = 32
    traffic = stage_traffic(C, COMPILE_D, COMPILE_D, BV)
    intensity[C] = {name: fl / by for name, (fl, by) in traffic.items()}
    print(f"  C = {C:2d}: "
          + ", ".join(f"{name} {x:5.1f}" for name, x in intensity[C].items()))

# %% mystnb={"figure": {"caption": "What each of the three Triton stages needs when compiled for sm_90 at $D_k = D_v = 128$ with bfloat16 inputs, against the chunk size $C$: registers per thread, spilled bytes and shared memory per program as the compiler reports them, with tf32 (solid) and exact ieee (dashed) products, and the arithmetic intensity counted from the kernels' loads, stores and products.", "name": "fig-kernel-stage-resources"}, "image": {"alt": "Four line plots in a two-by-two grid against chunk size 16, 32 and 64, one colour per stage (wy, state, output), solid lines with circles for tf32 products and dashed lines with squares for ieee products. Registers per thread: the state pass rises to the dotted 255-register limit at C = 64 with tf32. Spill stores: zero with tf32; with ieee the state pass spills hundreds to thousands of bytes and the wy stage spills at C = 64. Shared memory grows with C for every stage, most for the state pass. Arithmetic intensity: the wy and output stages grow from under 10 to 30 to 35 flops per byte, the state pass only to about 13."}}
stage_names = ["_wy_kernel", "_state_kernel", "_output_kernel"]
colors = ("C0", "C1", "C2")
fig, axes = plt.subplots(2, 2, figsize=(6.7, 6.6), layout="constrained")
axes = axes.flatten()
for name, color in zip(stage_names, colors):
    for prec, ls in (("tf32", "o-"), ("ieee", "s--")):
        Cs = [C for (p, C) in resources if p == prec]
        if not Cs:
            continue
        vals = [resources[prec, C][name] for C in Cs]
        axes[0].plot(Cs, [x[0] for x in vals], ls, color=color)
        axes[1].plot(Cs, [x[1] for x in vals], ls, color=color)
        axes[2].plot(Cs, [x[2] / 1024 for x in vals], ls, color=color)
    axes[3].plot(list(intensity), [intensity[C][name] for C in intensity], "o-",
                 color=color)
axes[0].axhline(MAX_REGISTERS, color="k", ls=":", lw=1)
titles = ("registers per thread (ptxas)", "spill stores (bytes, ptxas)",
          "shared memory per program (KB)", "arithmetic intensity (flops / byte)")
for ax, title in zip(axes, titles):
    ax.set_title(title, fontsize=10)
    ax.set(xlabel="chunk size C")
    ax.set_xscale("log", base=2)
    ax.set_xticks([16, 32, 64], ["16", "32", "64"])
# one legend below the panels: colour = stage, line style = precision of the products
by_stage = [Line2D([], [], color=color, label=name.strip("_").replace("_kernel", ""))
            for name, color in zip(stage_names, colors)]
by_style = [Line2D([], [], color="k", marker="o", ls="-", label="tf32 products"),
            Line2D([], [], color="k", marker="s", ls="--", label="ieee products"),
            Line2D([], [], color="k", ls=":", lw=1,
                   label=f"limit: {MAX_REGISTERS} registers")]
key = [h for pair in zip(by_stage, by_style) for h in pair]  # columns fill first
fig.legend(handles=key, loc="outside lower center", ncol=3, fontsize=8)
fig.suptitle(f"The three stages compiled for sm_90, Dk = Dv = {COMPILE_D}, bf16 inputs",
             fontsize=11)
plt.show()

# %% [markdown]
# In the run shown here:
#
# - **Registers.** With tf32 products nothing spills, and the state pass uses the most registers
#   of the three stages, more as $C$ grows, up to the 255-register ceiling at $C = 64$ (the state
#   tile itself takes only 16 of them per thread there, as computed above; the operand tiles of
#   $W_c$, $K_c$ and $U'_c$ take the rest). `launch_config` gives every stage 8 warps at these sizes
#   (with 4, each thread would hold twice as much of every tile; its docstring lists where 4 warps
#   spill, found from reports like these). With
#   `"ieee"` products there are no tensor-core instructions at all (the last column): every product
#   becomes float32 fused multiply-adds on the ordinary cores, the state pass spills at every chunk
#   size (hundreds of bytes to kilobytes of spill stores), and stage 1 spills at $C = 64$. This is
#   the measured reason the module
#   calls `"ieee"` the mode for checking and tf32 the mode for speed.
# - **Shared memory** grows with $C$, and the state pass needs at least as much as either other
#   stage: the operand
#   tiles of its products pass through it at every step (one pipeline stage, `num_stages=1`, keeps
#   it small enough for every GPU Triton supports; prefetching the next chunk's tiles would need a
#   second copy of them).
# - **Arithmetic intensity** is low for every stage: tens of flops per byte at most, in this count.
#   Stages 1 and 3 do $O(C^2 D)$ work per chunk on $O(C D)$ bytes, so their intensity grows about in
#   proportion to $C$. The state pass gains much less: it writes one $D_k \times D_v$ state per chunk
#   (traffic that shrinks per token as $C$ grows), but every one of a head's $D_v / BV$ programs also
#   reloads $W_c$ and $K_c$, traffic that grows with $C$ as fast as its flops. That is the price of
#   splitting the state's columns over programs: more parallelism for the sequential stage, paid for
#   by re-reading its inputs. A GPU needs far more flops per byte than any of these to keep its
#   tensor cores busy (divide its peak rate by its memory bandwidth), so all three stages are bound
#   by memory traffic, and chunk sizes of 64 rather than chapter 8's flop-minimal small chunks are
#   a way to move fewer bytes (fewer states written, fewer sequential steps, larger tiles), up to
#   the limit the first two panels set.

# %% [markdown]
# ## Exercises
#
# Both exercises are what one program of a kernel does, written in PyTorch (no Triton needed).
#
# ```{exercise} The addresses of a chunk's tile
# :label: ex-kernel-tile-offsets
#
# Write `tile_offsets(i_bh, i_c, T, D, C, BD)`: for a contiguous tensor of shape `[B·H, T, D]`, the
# element offsets (an `int64` tensor of shape `[C, BD]`) of the tile that program `(i_c, i_bh)` loads,
# the rows of tokens $i_c C, \dots, i_c C + C - 1$ of head `i_bh` and the columns $0, \dots, BD - 1$
# ($BD \ge D$, a power of two), and the mask (a `bool` tensor `[C, BD]`) of the entries that lie inside
# the tensor's row, $t < T$ and $d < D$. Compute the offsets for every entry, masked or not, as the
# kernel's `arange` arithmetic does.
# ```

# %%
def tile_offsets_mine(i_bh, i_c, T, D, C, BD):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kernel.tile_offsets", tile_offsets_mine)

# %% [markdown]
# ```{solution-start} ex-kernel-tile-offsets
# :class: dropdown
# ```

# %%
def tile_offsets_solution(i_bh, i_c, T, D, C, BD):
    o_t = i_c * C + torch.arange(C)  # tokens of the chunk                         [C]
    o_d = torch.arange(BD)  # columns, padded                                      [BD]
    # head, row and column strides   [C, BD]
    offsets = i_bh * T * D + o_t[:, None] * D + o_d[None, :]
    mask = (o_t[:, None] < T) & (o_d[None, :] < D)
    return offsets, mask


ok = checks.run("kernel.tile_offsets", tile_offsets_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# A load is `x.flatten()[offsets]` where the mask holds and `other` elsewhere. Without the row mask,
# the last chunk of head 0 reads the first tokens of head 1 (heads of $T = 37$ tokens of $D = 4$,
# chunk 2 of $C = 16$):

# %%
# [B·H, T, D]: each entry its own offset
x = torch.arange(2 * 37 * 4, dtype=torch.float32).view(2, 37, 4)
offsets, mask = tile_offsets_solution(0, 2, 37, 4, 16, 4)
# tl.load(..., mask, other=0)
tile = torch.where(mask, x.flatten()[offsets.clamp(max=x.numel() - 1)], 0.0)
unmasked = x.flatten()[offsets]  # no mask: every address is read
print(f"masked load equals x[0, 32:37] zero-padded: "
      f"{max_diff(tile[:5], x[0, 32:37]):.1e} and "
      f"{tile[5:].abs().max():.0f} after; without the mask rows 5.. hold x[1, 0:11]: "
      f"{max_diff(unmasked[5:], x[1, :11]):.1e}")

# %% [markdown]
# ```{exercise} The state pass of one program
# :label: ex-kernel-state-pass-block
#
# Write `state_pass_block(w, u, k, s0, chunk_size, i_v, BV)`: the work of one program of the state
# pass, for one head. Inputs: `w [T, Dk]` and `u [T, Dv]` (the WY factors of every chunk, as stage 1
# writes them), `k [T, Dk]`, the whole initial state `s0 [Dk, Dv]`, and the program's block: columns
# `i_v·BV` up to `min(Dv, i_v·BV + BV)` of the state. Walk the $\lceil T/C \rceil$ chunks (the last may
# be short) with $U'_c = U_c - W_c S_c$ and $S_{c+1} = S_c + K_c^\top U'_c$ on those columns, and return
# `(states [N, Dk, n], u_new [T, n], s_final [Dk, n])`: the state each chunk *starts* from, the
# deltas, and the final state, for the block's `n` columns.
# ```

# %%
def state_pass_block_mine(w, u, k, s0, chunk_size, i_v, BV):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kernel.state_pass_block", state_pass_block_mine)

# %% [markdown]
# ```{solution-start} ex-kernel-state-pass-block
# :class: dropdown
# ```

# %%
def state_pass_block_solution(w, u, k, s0, chunk_size, i_v, BV):
    # this program's columns of S
    cols = slice(i_v * BV, min(u.shape[1], i_v * BV + BV))
    S = s0[:, cols]  # S_0, in "registers"                                   [Dk, n]
    states, deltas = [], []
    # the sequential loop; the last chunk may be short
    for start in range(0, u.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        states.append(S)  # store S_c before the update
        du = u[rows, cols] - w[rows] @ S  # U'_c = U_c − W_c S_c                [C, n]
        deltas.append(du)
        S = S + k[rows].T @ du  # S_{c+1} = S_c + K_cᵀ U'_c                     [Dk, n]
    return torch.stack(states), torch.cat(deltas), S


ok = checks.run("kernel.state_pass_block", state_pass_block_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# Run over every block of columns (here blocks of 8) and every head, as the kernel's grid runs
# its programs, the function rebuilds what `_state_kernel` stored, on the inputs of the
# stage-by-stage check above (the kernel's own block width does not change the numbers: the
# columns never mix):

# %%
if kernels.AVAILABLE:
    B, H, T, Dk, Dv, C = 2, 2, 37, 20, 12, 16
    BV = 8
    q, k, v, beta, S0 = inputs(B, H, T, Dk, Dv, seed=4)
    st = kd.forward_stages(q, k, v, beta, chunk_size=C, initial_state=S0)
    worst = 0.0
    for b in range(B):
        for h in range(H):
            # the programs (i_v, head)
            parts = [state_pass_block_solution(st["w"][b, h], st["u"][b, h], k[b, h],
                                               S0[b, h], C, i_v, BV)
                     for i_v in range(-(-Dv // BV))]
            states, u_new, S_T = (torch.cat(p, dim=-1) for p in zip(*parts))
            worst = max(worst, max_diff(states, st["states"][b, h]),
                        max_diff(u_new, st["u_new"][b, h]),
                        max_diff(S_T, st["S"][b, h]))
    print(f"{-(-Dv // BV)} blocks of BV = {BV} columns x {B * H} heads: "
          f"max distance to the kernel's stored S_c, U' and S_N = {worst:.1e}")
else:
    print(kernels.REASON)

# %% [markdown]
# ## Summary
#
# - A production kernel for the chunked delta rule splits chapter 8's algorithm into the scaled
#   $KK^\top$, the triangular solve, the WY factors $W$ and $U$, the state pass and the output pass
#   (fla's five kernels; three launches here). Only the state pass is sequential, because only
#   $S_{c+1} = S_c + K_c^\top (U_c - W_c S_c)$ links a chunk to the one before; it runs as a loop inside
#   one program per head and block of state columns, carrying the state in registers. The columns
#   of $S$ evolve independently, which is what lets one head's state be split over programs.
# - Every intermediate one launch hands to the next goes through global memory: $W$, $U$, $U'$ and
#   every chunk's starting state, more bytes than the inputs. So the backward pass stores little
#   (fla: the inputs and $(I + A_c)^{-1}$) and recomputes $W$, $U$ and the state pass; the lib's kernel
#   recomputes through the PyTorch form.
# - The kernels map line by line onto the equations: `program_id` picks the chunk, head and value
#   block, `arange` and masks build the tiles (the last chunk and padded head sizes masked),
#   `tl.dot` does the products, and the triangular solve is a row loop of masked tile operations.
# - Under the Triton interpreter on a CPU, each stage and the end result equal the PyTorch chunked
#   form to float32 round-off, for partial last chunks, non-zero initial states, padded head sizes
#   and the fused output pass; gradients through it equal the PyTorch form's.
# - Compiling for sm_90 without a GPU shows the kernels as the GPU will run them: the state as a
#   loop-carried tile in a tensor-core accumulator layout, `wgmma` instructions, and per-stage
#   registers, spills and shared memory: in the run shown here the state pass reaches the register
#   ceiling at $C = 64$ with tf32 products, without spilling, and spills in the exact `"ieee"` mode,
#   which does without tensor cores.
#
# **Next.** Chapter 10 adds a forgetting gate: Gated DeltaNet multiplies the state by a decay
# $\alpha_t$ at every step, $S_t = \alpha_t (I - \beta_t k_t^\top k_t) S_{t-1} + \beta_t k_t^\top v_t$. The
# chunked form keeps the stages of this chapter but every product inside a chunk gains a decay mask,
# and a published formula that forgot it is measurably wrong.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
