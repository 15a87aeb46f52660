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
# Chapter 8 ended with an exact chunkwise algorithm whose PyTorch implementation does every
# chunk at once except one short sequential pass. On a GPU it is still a string of framework
# calls: every intermediate ($W$, $U$, the scores, every chunk's state) goes out to the GPU's
# main memory and comes back, and the state pass launches two small matrix products per chunk,
# one after another. Kernel libraries such as flash-linear-attention (fla) write the algorithm as
# a handful of GPU kernels instead. This chapter writes it as three Triton kernels,
# `tinyk3.kernels.delta_rule.chunked`: one program per chunk computes the scaled $K K^\top$, the
# triangular solve and $W$, $U$; one program per head and block of state columns runs the
# sequential pass with the state on chip; one program per chunk computes the outputs.
#
# **In this chapter** you see which stages a production kernel splits the work into and why only
# the state pass is sequential; write a first Triton kernel; read the three kernels next to the
# chapter-8 equations; check every stage under the Triton interpreter on this CPU, in float32 and
# in fla's bfloat16-operand mode; compile them for NVIDIA GPUs without one and read the
# compiler's report; and write the output stage yourself, in Triton.
#
# **Cost.** Up to about a minute on one CPU core, most of it compiling for a GPU target (far less
# once Triton's on-disk cache holds the kernels) and running the interpreter (the last cell prints
# the time); `SMOKE = True` runs in seconds. Triton is optional (Linux only): without it every
# Triton cell prints why it skipped.

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
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import Code, display
from matplotlib.lines import Line2D

import tinyk3.kernels as kernels
from tinyk3 import checks
from tinyk3.bench import stamp
from tinyk3.checks import ch09_kernel as check_kernel
from tinyk3.kernels import delta_rule as kd
from tinyk3.kernels import runtime
from tinyk3.ops import delta_rule, wy
from tinyk3.timing import time_fn
from tinyk3.util import max_diff

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
    # a stand-in, so that the Triton exercise's kernel can still be defined
    tl = SimpleNamespace(constexpr=None)

T_INTERP = 64 if SMOKE else 256  # sequence length of the interpreter timing
SWEEP_CS = [16] if SMOKE else [16, 32, 64]  # chunk sizes of the interpreter check
COMPILE_CS = [16] if SMOKE else [16, 32, 64]  # chunk sizes compiled for sm_90
COMPILE_D = 32 if SMOKE else 128  # head size compiled for sm_90 (Kimi Linear's is 128)
# designs compiled: (operands, tl.dot input precision of float32 operands)
DESIGNS = ([("bfloat16", "tf32")] if SMOKE
           else [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "tf32")])


def kernel_inputs(B, H, T, Dk, Dv, seed, dtype=torch.float32):
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
# order and largely in parallel. A program knows where it is from `tl.program_id(axis)` and works
# on **tiles**, blocks of numbers whose shapes are compile-time constants (`tl.constexpr`, powers
# of two):
#
# - `tl.arange(0, BC)` is the vector $0, 1, \dots, BC - 1$; index arithmetic on such vectors
#   (with `[:, None]` and `[None, :]` broadcasting) gives a tile of **offsets** into a tensor;
# - `tl.load(ptr + offsets, mask=..., other=0.0)` reads those elements from the GPU's main
#   (global) memory into **registers**, yielding `other` where the mask is false; `tl.store`
#   writes back where the mask is true;
# - `tl.dot(a, b)` multiplies two tiles (inner dimension at least 16) on the **tensor cores**,
#   the matrix units of NVIDIA GPUs, staging operands through **shared memory**, the small
#   on-chip memory of one streaming multiprocessor (SM);
# - element-wise arithmetic, `tl.where` and reductions act on tiles in registers.
#
# Three terms the chapter uses. A program runs on a number of **warps**, groups of 32 threads
# that execute in lockstep (`num_warps`, 4 or 8 here); a tile is spread over their threads, so
# more warps means fewer elements, and fewer registers, per thread. **Occupancy** is how many
# warps an SM holds at once, limited by the registers and shared memory each program needs; more
# resident warps hide more memory latency. **TF32** is a tensor-core format for float32 operands:
# an 8-bit exponent and a 10-bit mantissa (float32 has 23), accumulated in float32. Tensor cores
# run bfloat16 operands (7-bit mantissa) at twice the TF32 rate on A100 and H100.
#
# Programs of one launch do not talk to each other (short of atomics): one program's result
# reaches another only through global memory and a *later launch*, or by keeping both pieces of
# work in one program. That decides how the chunked delta rule is cut into kernels.
#
# **Layout.** The tensors are `[B, H, T, D]` and contiguous, so the kernels see them as
# `[B·H, T, D]`: element $(bh, t, d)$ sits at offset $bh \cdot T D + t \cdot D + d$, and chunk $c$
# of head $bh$ is rows $t = cC, \dots, cC + C - 1$. The last chunk may run past $T$; its extra
# rows are masked (they load as $k = 0$, $\beta = 0$, which change nothing, and are never stored).

# %% [markdown]
# ## The stages, and why only one is sequential
#
# Chapter 8's equations for chunk $c$ (rows are tokens, $M$ the lower-triangular mask $j \le i$):
#
# $$
# \begin{aligned}
# A_{[c]} &= I + \operatorname{tril}(\operatorname{diag}(\beta_{[c]}) K_{[c]} K_{[c]}^\top, -1), &
# \mathcal{T}_{[c]} &= A_{[c]}^{-1} \operatorname{diag}(\beta_{[c]}), \\
# W_{[c]} &= \mathcal{T}_{[c]} K_{[c]}, \quad U_{[c]} = \mathcal{T}_{[c]} V_{[c]}, &
# U'_{[c]} &= U_{[c]} - W_{[c]} S_{[c]}, \\
# S_{[c+1]} &= S_{[c]} + K_{[c]}^\top U'_{[c]}, &
# \Omega_{[c]} &= Q_{[c]} K_{[c]}^\top \odot M, \\
# O_{[c]} &= Q_{[c]} S_{[c]} + \Omega_{[c]} U'_{[c]} .
# \end{aligned}
# $$
#
# The fla code read for this chapter is flash-linear-attention 0.6.0 from PyPI:
# `fla/ops/delta_rule/chunk.py` (`chunk_delta_rule_fwd`), `fla/ops/delta_rule/wy_fast.py`,
# `fla/ops/common/chunk_scaled_dot_kkt.py`, `fla/ops/utils/solve_tril.py`,
# `fla/ops/common/chunk_delta_h.py` and `fla/ops/common/chunk_o.py`. In its variables, `A` after
# `solve_tril` is $A_{[c]}^{-1}$ (our $\mathcal{T}_{[c]}$ without the $\operatorname{diag}(\beta)$,
# which fla applies to $K$ and $V$), `v_new` is $U'$ and `h` holds the chunk states $S_{[c]}$.
# Its forward runs five steps; this chapter's kernel does the same work in three launches:
#
# | stage | computes | needs | fla | here | grid (programs) |
# |---|---|---|---|---|---|
# | scaled $KK^\top$ | $A_{[c]}$ | the chunk's $K_{[c]}$, $\beta_{[c]}$ | `chunk_scaled_dot_kkt_fwd` | `_wy_kernel` | chunks × heads |
# | triangular solve | $\mathcal{T}_{[c]}$ | $A_{[c]}$ | `solve_tril` | `_wy_kernel` | |
# | WY factors | $W_{[c]}$, $U_{[c]}$ | $\mathcal{T}_{[c]}$, $K_{[c]}$, $V_{[c]}$ | `recompute_w_u_fwd` | `_wy_kernel` | |
# | **state pass** | $U'_{[c]}$, $S_{[c+1]}$, storing $S_{[c]}$ | $S_{[c]}$: **the chunk before** | `chunk_gated_delta_rule_fwd_h` | `_state_kernel` | value blocks × heads |
# | output pass | $O_{[c]}$ | $S_{[c]}$, $U'_{[c]}$ (stored) | `chunk_fwd_o` | `_output_kernel` | value blocks × chunks × heads |
#
# Read the "needs" column. The first three stages use only their own chunk's inputs: every chunk
# of every head is an independent program. The output of chunk $c$ needs $S_{[c]}$ and $U'_{[c]}$,
# and once the state pass has stored them every chunk's output is independent again. Only
# $S_{[c+1]} = S_{[c]} + K_{[c]}^\top (U_{[c]} - W_{[c]} S_{[c]})$ links a chunk to the one before,
# so only the state pass walks the chunks in order, *inside one program*: a loop that carries $S$
# in registers. It has $B \cdot H$ programs (times the value blocks, below), each doing
# $\lceil T/C \rceil$ steps; everything else runs on grids $\lceil T / C \rceil$ times larger.
#
# The first three are fused into one kernel here because $A_{[c]}$ and $\mathcal{T}_{[c]}$ are
# $C \times C$ and stay in registers from $K K^\top$ to the solve to $W$ and $U$. fla keeps them
# as separate kernels, each tuned on its own and shared with the gated variants, and stores
# $A_{[c]}$ and its inverse in between.

# %% [markdown]
# ## A first kernel: the scaled $KK^\top$
#
# Before reading the lib's kernels, one small kernel: the first stage alone, one program per
# chunk and head, writing the strictly lower part of $A_{[c]}$,
#
# $$
# \begin{gathered}
# L_{[c]} = A_{[c]} - I = \operatorname{tril}(\operatorname{diag}(\beta_{[c]}) K_{[c]} K_{[c]}^\top, -1), \\
# (L_{[c]})_{ij} = \beta_i\, (k_i \cdot k_j) \text{ for } j < i, \text{ else } 0,
# \end{gathered}
# $$
#
# into an output `a` of shape `[B·H, T, C]`: row $t$ holds its chunk's row of $L_{[c]}$ (fla's
# layout for this intermediate). Each line maps to a piece of the equation: `program_id` picks the
# chunk and head, `arange` builds the row and column indices, the mask cuts the last chunk and
# the padding columns (a head size $D$ that is not a power of two is padded to `BD`), `tl.dot`
# is $K_{[c]} K_{[c]}^\top$, the row scaling is $\operatorname{diag}(\beta_{[c]})$, and `tl.where` with
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
        p_k = k + i_bh * T * D + o_t[:, None] * D + o_d[None, :]  # addresses of K_[c]
        b_k = tl.load(p_k, mask=m_td, other=0.0)  # K_[c]                     [C, BD]
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
# `triton.jit` is what `@triton.jit` does; `InterpretedFunction` is what it does when
# `TRITON_INTERPRET=1` is set: it runs the same function on NumPy arrays, one program after
# another, in Python. The lib chooses per call in the same way (`tinyk3.kernels.runtime`), so one
# process can interpret on the CPU and compile for a GPU. The check, against chapter 7's
# `wy.ut_matrix` ($A_{[c]}$) on
# zero-padded chunks, for $T = 37$ (the third chunk has 5 tokens) and $D = 20$ (padded to 32):

# %%
if kernels.AVAILABLE:
    B, H, T, D, C = 2, 3, 37, 20, 16
    _, k, _, beta, _ = kernel_inputs(B, H, T, D, D, seed=0)
    a = scaled_kkt(k, beta, C)  # [B, H, T, C]
    N, pad = -(-T // C), -T % C
    # chunks, zero-padded   [B, H, N, C, D]
    kc = F.pad(k, (0, 0, 0, pad)).view(B, H, N, C, D)
    bc = F.pad(beta, (0, pad)).view(B, H, N, C)
    # tril(diag(β) K Kᵀ, −1) per chunk   [B, H, N, C, C]
    A_ref = wy.ut_matrix(kc, bc) - torch.eye(C)
    d_A = max_diff(a, A_ref.flatten(2, 3)[:, :, :T])
    print(f"max |L from my kernel - (wy.ut_matrix - I)| = {d_A:.1e} "
          f"({N} chunks x {B * H} heads = {N * B * H} programs)")
else:
    print(kernels.REASON)

# %% [markdown]
# ## Stage 1: `_wy_kernel`, every chunk at once
#
# The lib's first kernel starts exactly like the small one: program $(i_c, i_{bh})$ owns tokens
# $i_c C, \dots, i_c C + C - 1$ of head $i_{bh}$ and loads its $\beta_{[c]}$. The head index is cast
# to `int64`: $B \cdot H \cdot T \cdot D$ can exceed $2^{31}$, where an `int32` offset wraps.

# %%
show_part(kd._wy_kernel, "i_c = tl.program_id(0)", "b_beta = tl.load")

# %% [markdown]
# Then $L_{[c]} = A_{[c]} - I$. For a large head size the kernel walks $D_k$ in blocks of `BK`
# columns and accumulates, $K_{[c]} K_{[c]}^\top = \sum_{b} K_{[c]}^{(b)} K_{[c]}^{(b)\top}$, so the
# tiles stay small. `to_operand` is the identity in the float32 mode and the cast to bfloat16 in
# the bfloat16 mode (below).

# %%
show_part(kd._wy_kernel, "b_L = tl.full", "b_L = tl.where")

# %% [markdown]
# **The triangular solve, one row at a time, in registers.** Write $A^{-1} = (I + L)^{-1} = I + N$.
# Row $i$ of $X = A^{-1}$ solves $X_i + \sum_{j<i} L_{ij} X_j = e_i$, so, with $X_j = e_j + N_j$,
#
# $$
# N_i = -L_i - \sum_{j<i} L_{ij} N_j , \qquad \mathcal{T}_{[c]} = (I + N)\operatorname{diag}(\beta_{[c]}) .
# $$
#
# The kernel starts from $N = -L$ (row $i$ still holds $-L_i$ when its turn comes); at step $i$ it
# reads that row out with a masked sum, adds $\sum_j L_{ij} N_j$ as one product of the row with the
# whole tile (the terms $j \ge i$ vanish because $L_{ij} = 0$), and writes the row back with
# `tl.where`. A tile has no "row $i$" to index in registers; selecting and writing rows by masks
# is how a kernel does it.

# %%
show_part(kd._wy_kernel, "b_N = -b_L", "b_UT = to_operand")

# %% [markdown]
# The same loop written with PyTorch operations on one chunk (each line the tile operation
# above: masked row sum, row-times-tile reduction, masked write), against chapter 7's
# `wy.ut_transform`:

# %%
C = 16
_, k, _, beta, _ = kernel_inputs(1, 1, C, 32, 32, seed=1)
k_c, b_c = k[0, 0], beta[0, 0]  # one chunk: [C, Dk], [C]
o_i = torch.arange(C)
# L = A − I   [C, C]
L = torch.where(o_i[:, None] > o_i[None, :], b_c[:, None] * (k_c @ k_c.T), 0.0)
N = -L
for i in range(1, C):
    row = torch.where(o_i[:, None] == i, N, 0.0).sum(0)  # −L_i, read out by a mask  [C]
    row = row + (row[:, None] * N).sum(0)  # −L_i − Σ_j L_ij N_j                     [C]
    N = torch.where(o_i[:, None] == i, row[None, :], N)  # write row i back
UT = (N + torch.eye(C)) * b_c[None, :]  # 𝒯 = (I + N) diag(β): scale column j by β_j
print(f"max |UT matrix from the row loop - wy.ut_transform| = "
      f"{max_diff(UT, wy.ut_transform(k_c, b_c)):.1e}")

# %% [markdown]
# $-L_i - \sum_j L_{ij} N_j$ is computed as $r + \sum_j r_j N_j$ with $r = -L_i$. The substitution
# costs $C$ dependent steps of $O(C^2)$ vector work, about $3C^3$ flops, against $C^3/3$ for an
# optimal triangular inverse. fla's `solve_tril` inverts $16 \times 16$ diagonal blocks and fills
# in the rest with block matrix products, chapter 7's block forward substitution. Finally
# $W_{[c]} = \mathcal{T}_{[c]} K_{[c]}$ and $U_{[c]} = \mathcal{T}_{[c]} V_{[c]}$, block by block:

# %%
show_part(kd._wy_kernel, "# -- W = 𝒯 K")

# %% [markdown]
# **What lives where.** $L_{[c]}$, $N$ and $\mathcal{T}_{[c]}$ ($C \times C$ each) never leave the
# program: they are registers (and shared memory while `tl.dot` uses them). Global memory sees the
# reads of $K_{[c]}$ (twice: a reload is cheaper than keeping a $C \times D_k$ tile alive through
# the solve), $V_{[c]}$, $\beta_{[c]}$ and the writes of $W_{[c]}$, $U_{[c]}$.

# %% [markdown]
# ## Stage 2: `_state_kernel`, the one sequential loop
#
# $$
# U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}, \qquad S_{[c+1]} = S_{[c]} + K_{[c]}^\top U'_{[c]}, \qquad c = 0, 1, \dots, N - 1 .
# $$
#
# **Why the columns of $S$ can be split over programs.** Both equations act on $S$ column by
# column: for any set $J$ of columns, $U'_{[c]}[:, J] = U_{[c]}[:, J] - W_{[c]} S_{[c]}[:, J]$ and
# $S_{[c+1]}[:, J] = S_{[c]}[:, J] + K_{[c]}^\top U'_{[c]}[:, J]$. So a head's state can be cut into
# blocks of `BV` columns, each carried by its own program with no communication: $D_v / BV$
# times the parallelism, and a $D_k \times BV$ block in registers. Checked with chapter 8's
# `delta_rule.state_pass` on the whole state and on column blocks of 8:

# %%
B, H, T, Dk, Dv, C = 1, 2, 64, 16, 24, 16
q, k, v, beta, S0 = kernel_inputs(B, H, T, Dk, Dv, seed=2)
Kc, Vc = (x.unflatten(2, (-1, C)).flatten(0, 1) for x in (k, v))  # [B·H, N, C, D]
bc = beta.unflatten(2, (-1, C)).flatten(0, 1)[..., None]  # [B·H, N, C, 1]
Wc, Uc = delta_rule.wy_stage(Kc, Vc, bc)
S_start = S0.flatten(0, 1)  # [B·H, Dk, Dv]
whole = delta_rule.state_pass(Wc, Uc, Kc.mT, S_start)  # every S_[c], every U'_[c], S_N
# columns j, ..., j + 7 of the state, one block at a time
blocks = [delta_rule.state_pass(Wc, Uc[..., j:j + 8], Kc.mT, S_start[..., j:j + 8])
          for j in range(0, Dv, 8)]
names = ("states S_[c]", "deltas U'_[c]", "final state")
for name, full, parts in zip(names, whole, zip(*blocks)):
    side_by_side = torch.cat(parts, dim=-1)
    print(f"{name:>12s}: max |blocks side by side - whole| = "
          f"{max_diff(side_by_side, full):.1e}")

# %% [markdown]
# The grid is (value blocks, heads). A program loads its columns of $S_0$ into a float32 register
# tile `b_S` of shape $[D_k, BV]$ (`BK` is all of $D_k$):

# %%
show_part(kd._state_kernel, "i_v = tl.program_id(0)", "b_S += tl.load")

# %% [markdown]
# and loops over the chunks. Per chunk it stores $S_{[c]}$ *before* updating (the output pass needs
# the state the chunk starts from), computes and stores $U'_{[c]}$, and updates the register tile
# with `b_S += tl.dot(tl.trans(b_k), b_du)`; that store of $S_{[c]}$ is the state's only trip to
# global memory. With `FUSE_OUTPUT` the chunk's output is computed here instead: nothing stored,
# but that work then runs on the few programs of the sequential pass.

# %%
show_part(kd._state_kernel, "for i_c in range(0, NT)", "tl.store(s_out")

# %% [markdown]
# ## Stage 3: `_output_kernel`, every chunk at once again
#
# $$
# O_{[c]} = Q_{[c]} S_{[c]} + (Q_{[c]} K_{[c]}^\top \odot M)\, U'_{[c]}
# $$
#
# One program per (value block, chunk, head) reads the stored $S_{[c]}$ and $U'_{[c]}$. $Q_{[c]} S_{[c]}$
# and $Q_{[c]} K_{[c]}^\top$ are both sums over $D_k$, accumulated together block by block; the mask
# keeps $j \le i$ ($o_t$ reads the state after token $t$ wrote), and one more product adds the
# intra-chunk part:

# %%
show_part(kd._output_kernel, "# -- Q_[c] S_[c] and Q_[c] K_[c]ᵀ")

# %% [markdown]
# Each of a chunk's $D_v / BV$ value blocks recomputes the scores $Q_{[c]} K_{[c]}^\top$ rather than
# reading them back from memory; fla's `chunk_fwd_o` makes the same bet, that at these tile sizes
# the product costs less than the traffic it saves.
#
# ## The host side: three launches
#
# `chunked` validates the inputs and calls `_forward`, which allocates the intermediates and
# launches the three grids; `launch_config` picks tile sizes and launch options from the
# compiler's resource reports (below):

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
# state tile each keeps in registers, spread over the threads of its warps, is a small part of a
# thread's registers. The rest go to the tiles of $W_{[c]}$, $K_{[c]}$ and $U'_{[c]}$.

# %% [markdown]
# ## Two operand modes: float32, and bfloat16 as fla does it
#
# The kernel has two modes, chosen by `operands=` (default: `"bfloat16"` for bfloat16 inputs,
# `"float32"` for float32 and float16 inputs):
#
# - **`"float32"`**: every tile is converted to float32 before `tl.dot`, and $W$, $U$, $S_{[c]}$,
#   $U'$ are stored in float32. `input_precision` picks the products: `"ieee"` is exact float32
#   (no tensor cores), `"tf32"` rounds the operands to TF32 (tensor cores; errors about $10^{-3}$
#   relative), `"tf32x3"` recovers most of float32 at three times the TF32 cost.
# - **`"bfloat16"`**, fla's design: bfloat16 tiles go into every `tl.dot` with float32
#   accumulators; the solve, the state carried in registers and every accumulator stay float32;
#   $W$, $U$, $S_{[c]}$ and $U'$ are stored in bfloat16. Rounded to bfloat16, as in fla's
#   `recompute_w_u_fwd`, `chunk_gated_delta_rule_fwd_h` and `chunk_fwd_o`: $\mathcal{T}_{[c]}$
#   before its products, the state before $W_{[c]} S_{[c]}$ and before it is stored, $U'_{[c]}$,
#   and $\Omega_{[c]}$ before $\Omega_{[c]} U'_{[c]}$.
#
# The Triton interpreter cannot run the second mode as written: its bfloat16 cast truncates
# instead of rounding, and NumPy has no bfloat16 for loads and stores. Under the interpreter the
# kernel therefore keeps float32 tensors and `runtime.to_operand` *emulates* bfloat16: it rounds
# each value to the nearest bfloat16 by integer arithmetic on its float32 bits and computes in
# float32. A float32 product of two bfloat16 numbers is exact, so this is what the tensor cores
# compute, up to the order of the float32 sums:

# %%
tinyk3.notebook.show_source(runtime.to_operand)
if kernels.AVAILABLE:
    q, k, v, beta, S0 = kernel_inputs(1, 2, 100, 32, 32, seed=7, dtype=torch.bfloat16)
    ref = delta_rule.chunked(*(x.double() for x in (q, k, v, beta)), chunk_size=32,
                             initial_state=S0.double())
    for mode in ("float32", "bfloat16"):
        o, S = kd.chunked(q, k, v, beta, chunk_size=32, initial_state=S0.float(),
                          operands=mode)
        st = kd.forward_stages(q, k, v, beta, chunk_size=32, initial_state=S0.float(),
                               operands=mode)
        rounded = all(torch.equal(st[n], st[n].bfloat16().float())
                      for n in ("w", "u", "states", "u_new"))
        print(f"operands={mode:>8s}: max |o - fp64| = {max_diff(o, ref[0]):.1e}, "
              f"max |S - fp64| = {max_diff(S, ref[1]):.1e}; "
              f"W, U, S_[c], U' all bfloat16 values: {rounded}")
else:
    print(kernels.REASON)

# %% [markdown]
# On the same bfloat16 inputs, the float32 mode's state agrees with float64 to float32 round-off
# and its output carries one bfloat16 rounding; the bfloat16 mode's state carries the roundings
# listed above (`tests/test_kernels.py` bounds both modes against float64).

# %% [markdown]
# ## What goes through memory, and what the backward pass recomputes
#
# Everything a later launch reads must be stored. Per token and head, at $C = 64$,
# $D_k = D_v = 128$, bfloat16 inputs, the per-chunk states $S_{[c]}$ ($D_k D_v$ numbers per chunk)
# counting $D_k D_v / C$ numbers per token; this kernel in its two modes, and fla's
# `chunk_delta_rule_fwd` (its scaled $KK^\top$ is stored in float32, its inverse in the inputs'
# dtype):

# %%
C_, Dk_, Dv_ = 64, 128, 128
numbers = {  # numbers per token and head
    "inputs q, k, v, beta": Dk_ + Dk_ + Dv_ + 1,
    "W, U (stage 1 -> 2)": Dk_ + Dv_,
    "S_[c] (state pass -> output)": Dk_ * Dv_ / C_,
    "U' (state pass -> output)": Dv_,
    "A - I, scaled K K^T (fla only)": C_,
    "A^-1 (fla only; kept for backward)": C_,
}
bytes_per = {  # bytes per number: this kernel float32 mode, bfloat16 mode, fla
    "inputs q, k, v, beta": (2, 2, 2),
    "W, U (stage 1 -> 2)": (4, 2, 2),
    "S_[c] (state pass -> output)": (4, 2, 2),
    "U' (state pass -> output)": (4, 2, 2),
    "A - I, scaled K K^T (fla only)": (0, 0, 4),
    "A^-1 (fla only; kept for backward)": (0, 0, 2),
}
cols = ("this kernel fp32", "this kernel bf16", "fla 0.6.0")
print(f"{'bytes per token and head':>36s} " + " ".join(f"{c:>16s}" for c in cols))
totals = [0, 0, 0]
for name, n in numbers.items():
    row = [n * b for b in bytes_per[name]]
    totals = [t + x for t, x in zip(totals, row)]
    print(f"{name:>36s} " + " ".join(f"{x:16.0f}" for x in row))
print(f"{'total':>36s} " + " ".join(f"{x:16.0f}" for x in totals))

# %% [markdown]
# In this kernel's float32 mode the per-chunk states alone take more bytes than the inputs, and
# in every column the intermediates together outweigh the inputs (each total less the inputs
# row). This kernel's bfloat16 mode halves each of its float32 intermediates; fla stores the same
# four in bfloat16 as well, plus $A_{[c]} - I$ in float32 and $A_{[c]}^{-1}$ (the rows marked fla
# only), so its total lies above this kernel's bfloat16 one. That is why the **backward pass
# stores little and recomputes**: fla's
# `chunk_delta_rule` saves $q, k, v, \beta$, the initial state and the inverses $A_{[c]}^{-1}$;
# its backward recomputes $W$ and $U$ (`recompute_w_u_fwd`) and reruns the state pass
# (`chunk_gated_delta_rule_fwd_h`) to get every $S_{[c]}$ and $U'_{[c]}$, then runs its gradient
# kernels: one more sequential sweep instead of the memory above for every layer until the
# backward reaches it, the trade activation checkpointing makes.
#
# The lib's kernel makes the other choice of Part VI (chapter 19): its `autograd.Function`
# keeps the inputs and the chunk states $S_{[c]}$ the forward wrote anyway, and its backward
# recomputes $W$, $U$ and $U'$ from them inside the backward kernels of `tinyk3.kernels.backward`:

# %%
tinyk3.notebook.show_source(kd._ChunkedFunction.backward)

# %% [markdown]
# Those backward kernels are derived and checked in Part VI; this chapter is about the forward,
# checked next.

# %% [markdown]
# ## Check: the kernels under the interpreter, stage by stage
#
# `kd.forward_stages` runs the three launches and returns what each wrote; on CPU tensors the
# interpreter runs the kernels' own code, masks and loops. One awkward case: $T = 37$ with
# $C = 16$ (a 5-token last chunk), $D_k = 20$, $D_v = 12$ (padded to 32 and 16), two batch
# entries, a non-zero initial state. Each stage against its equation, computed with chapters 7
# and 8's PyTorch pieces on zero-padded chunks:

# %%
if kernels.AVAILABLE:
    B, H, T, Dk, Dv, C = 2, 2, 37, 20, 12, 16
    q, k, v, beta, S0 = kernel_inputs(B, H, T, Dk, Dv, seed=4)
    st = kd.forward_stages(q, k, v, beta, chunk_size=C, initial_state=S0)
    N, pad = -(-T // C), -T % C

    def chunks(x):  # [B, H, T, D] -> [B, H, N, C, D], zero-padded
        return F.pad(x, (0, 0, 0, pad)).view(B, H, N, C, -1)

    beta_c = F.pad(beta, (0, pad)).view(B, H, N, C)
    W_ref, U_ref = wy.wy_factors(chunks(k), chunks(v), beta_c)
    S_all, U_new, S_N = delta_rule.state_pass(W_ref.flatten(0, 1), U_ref.flatten(0, 1),
                                               chunks(k).flatten(0, 1).mT,
                                               S0.flatten(0, 1))
    o_ref, S_ref = delta_rule.chunked(q, k, v, beta, chunk_size=C, initial_state=S0)
    print({name: tuple(x.shape) for name, x in st.items()})
    print(f"stage 1: max |W - T K| = {max_diff(chunks(st['w']), W_ref):.1e}, "
          f"max |U - T V| = {max_diff(chunks(st['u']), U_ref):.1e}")
    d_states = max_diff(st["states"].flatten(0, 1), S_all)
    d_u_new = max_diff(chunks(st["u_new"]).flatten(0, 1), U_new)
    print(f"stage 2: max |S_[c] - state pass| = {d_states:.1e}, "
          f"max |U' - state pass| = {d_u_new:.1e}, "
          f"max |S_N| diff = {max_diff(st['S'].flatten(0, 1), S_N):.1e}")
    print(f"stage 3: max |o - delta_rule.chunked| = {max_diff(st['o'], o_ref):.1e} "
          f"(outputs up to {o_ref.abs().max():.1f}), "
          f"final state {max_diff(st['S'], S_ref):.1e}")
else:
    print(kernels.REASON)

# %% [markdown]
# Every stage agrees to float32 round-off. Now the end result over a grid of cases: each chunk
# size, $T$ a multiple of $C$ or not, a zero or random initial state, the separate and the fused
# output pass, against the PyTorch form in float32 and in float64:

# %%
if kernels.AVAILABLE:
    t0 = time.perf_counter()
    print(f"{'C':>3s} {'T':>4s} {'S_0':>6s} {'output':>8s} {'|o - fp32|':>11s} "
          f"{'|S - fp32|':>11s} {'|o - fp64|':>11s} {'|S - fp64|':>11s}")
    worst = 0.0
    for C in SWEEP_CS:
        for T in (2 * C, 2 * C + 5):
            q, k, v, beta, S0 = kernel_inputs(1, 2, T, 32, 32, seed=C + T)
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
# Every distance is at the level of float32 round-off (the largest is printed last), for partial
# last chunks, initial states and the fused pass alike; `tests/test_kernels.py` asserts
# $2 \cdot 10^{-6}$ relative against float32 and $10^{-5}$ against float64, and bounds the
# bfloat16 mode too.
#
# **The interpreter is for checking, not for speed.** Each program is Python over NumPy arrays,
# one after another. One call at a larger size against the PyTorch chunked form on the same
# inputs, each the median of 3 runs (`tinyk3.timing`):

# %%
if kernels.AVAILABLE:
    q, k, v, beta, S0 = kernel_inputs(1, 4, T_INTERP, 64, 64, seed=5)
    args = dict(chunk_size=64, initial_state=S0)
    o_k, _ = kd.chunked(q, k, v, beta, **args)
    o_p, _ = delta_rule.chunked(q, k, v, beta, **args)
    t_interp = time_fn(lambda: kd.chunked(q, k, v, beta, **args), repeats=3, warmup=0)
    t_torch = time_fn(lambda: delta_rule.chunked(q, k, v, beta, **args), repeats=3)
    print(f"T = {T_INTERP}, 4 heads of 64: interpreter {t_interp:.2f} s, "
          f"PyTorch chunked {t_torch * 1e3:.1f} ms "
          f"({t_interp / t_torch:.0f}x); max |o| diff {max_diff(o_k, o_p):.1e}")
    print(stamp())
else:
    print(kernels.REASON)

# %% [markdown]
# ## On a GPU: the compiled kernel
#
# On CUDA tensors the same call compiles the kernels (`triton.jit`) and runs them on the GPU. The
# next cell runs only where a CUDA GPU is present (on Colab: *Runtime → Change runtime type*, an
# L4 or A100 for the kernels as designed; the free T4 is outside Triton's supported range, see
# {ref}`which-gpu`). It checks the compiled kernel against the PyTorch form in float64 (float32
# inputs, `input_precision="ieee"`), then times the forward pass (median of 10 runs,
# `tinyk3.timing`) with half-precision inputs (bfloat16 from compute capability 8.0, with the
# kernel's bfloat16 operands; float16 on older GPUs such as the T4, with float32 operands and
# TF32) for the Triton kernel, the PyTorch chunked form and causal softmax attention
# (`F.scaled_dot_product_attention`) on the same $q, k, v$. No GPU number appears in this text:
# none was measured for it. `python tools/gpu_check_kernels.py` is the full check (more shapes
# and modes, fla if installed, the time share of each stage).

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
    q, k, v, beta, S0 = (x.to(dev) for x in kernel_inputs(B, H, T, D, D, seed=6))
    o, S = kd.chunked(q, k, v, beta, chunk_size=64, initial_state=S0,
                      input_precision="ieee")
    o64, S64 = delta_rule.chunked(*(x.double() for x in (q, k, v, beta)), chunk_size=64,
                                  initial_state=S0.double())
    print(f"{torch.cuda.get_device_name()}, B={B}, H={H}, T={T}, D={D}: "
          f"compiled kernel (float32, ieee) against PyTorch float64: "
          f"max |o| diff {max_diff(o, o64):.1e}, max |S| diff {max_diff(S, S64):.1e}")
    qh, kh, vh, bh = (x.to(half) for x in (q, k, v, beta))
    mode = "bf16 operands" if bf16_ok else "fp32 operands, tf32"
    forms = {
        f"Triton kernel ({mode})":
            lambda: kd.chunked(qh, kh, vh, bh, chunk_size=64),
        "PyTorch chunked form":
            lambda: delta_rule.chunked(qh, kh, vh, bh, chunk_size=64),
        "softmax attention (SDPA, causal)":
            lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True),
    }
    with torch.no_grad():
        ms = {name: 1e3 * time_fn(fn, repeats=10, warmup=2, cuda=True)
              for name, fn in forms.items()}
    for name, t_ms in ms.items():
        print(f"{name:>34s}: {t_ms:8.3f} ms ({B * T / t_ms:10.0f} tokens/ms, {half})")
    print(stamp())

# %% [markdown]
# ## Compiling for real GPUs, without one
#
# The interpreter runs the kernels' logic but not the compiler: it accepts tiles that are not
# powers of two, dtype mismatches in `tl.dot` and operations a GPU backend lacks, and cannot say
# how many registers or how much shared memory a program needs. Triton compiles for a *named*
# target without a GPU: `kd.compile_for_gpu(arch)` calls `runtime.compile_kernel`, which runs
# `triton.compile` with `GPUTarget("cuda", arch, 32)` (90: H100, 80: A100) through the whole tool
# chain, Triton IR → TritonGPU IR → LLVM IR → PTX → the `ptxas` in the Triton wheel → a cubin.
# One compile at the production size, $C = 64$, $D_k = D_v = 128$, bfloat16 inputs, float32
# operands with TF32 products, for sm_90 (the cell prints how long it took; a rerun that finds
# Triton's on-disk cache is faster):

# %%
reason = None if not kernels.AVAILABLE else kd.cannot_compile_reason()
if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    t0 = time.perf_counter()
    compiled = kd.compile_for_gpu(90, chunk_size=64 if not SMOKE else 16,
                                  Dk=COMPILE_D, Dv=COMPILE_D,
                                  dtype=torch.bfloat16, operands="float32",
                                  input_precision="tf32")
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
# - **Triton IR**: the state pass is a loop (`scf.for`) over the chunks that carries one value,
#   the state tile `tensor<Dk x BV x f32>` (`iter_args`), and does $W_{[c]} S_{[c]}$ and
#   $K_{[c]}^\top U'_{[c]}$ as `tt.dot` with `inputPrecision = tf32`.
# - **TritonGPU IR**: every tile has a *layout* (which thread holds which element). The state has
#   the layout of a tensor-core accumulator (`#mma`) and stays in registers from chunk to chunk;
#   as the right operand of $W_{[c]} S_{[c]}$ it is copied into shared memory (`local_alloc`),
#   where Hopper's `wgmma` instruction reads that operand.
# - **PTX**: the NVIDIA virtual instruction set, with tensor-core (`mma`) instructions on TF32
#   operands and float32 accumulators.
# - **Shared memory**: the bytes each program reserves, one of the two limits on occupancy.
#
# Registers and spills come from `ptxas`, the assembler that turns PTX into machine code: run with
# `-v` it reports the registers each thread uses, the bytes it *spills* to (slow, off-chip) local
# memory when 255 registers are not enough, and the thread's stack frame in local memory. It
# ships in the Triton wheel; `runtime.ptxas_report` runs it:

# %%
MAX_REGISTERS = 255  # per thread, the architectural limit of NVIDIA GPUs
tinyk3.notebook.show_source(runtime.ptxas_report)
if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    report = runtime.ptxas_report(state.asm["ptx"])["text"]
    print("\n".join(line for line in report.splitlines()
                    if "registers" in line or "spill" in line))
    print(f"(an NVIDIA thread can address at most {MAX_REGISTERS} registers)")

# %% [markdown]
# (which-gpu)=
# ### Which GPU: a free T4, or an L4 or A100
#
# Colab's free GPU is a T4 (compute capability 7.5). Triton supports NVIDIA GPUs from compute
# capability 8.0 (A100 8.0, L4 8.9, H100 9.0), and a T4's tensor cores take float16 but neither
# TF32 nor bfloat16. Nothing in this chapter ran on a GPU; what the compiler does for one is
# measured without it: the next cell compiles the state pass for sm_75 (T4), sm_80 (A100) and
# sm_89 (L4), float16 inputs, asking for TF32 and for `"ieee"` products, and counts the
# tensor-core instructions (`mma`) and scalar float32 multiply-adds (`fma.rn.f32`) in the PTX.

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
# The sm_75 build asked for TF32 is the same PTX as the exact one (the last lines): every tile
# product becomes scalar float32 multiply-adds, while sm_80 and sm_89 get tensor-core `mma`
# instructions. So on Colab the free T4 runs every PyTorch form of the course and can check the
# compiled kernels (float16 inputs, outside Triton's supported range, no tensor cores): use it
# for correctness, not speed. An L4 or A100 runtime runs the kernels as designed.

# %% [markdown]
# ## Experiment: two designs, compiled, against the chunk size
#
# `launch_config`'s choices come from reports like that one. The experiment compiles the three
# kernels for sm_90 at $D_k = D_v = 128$ (bfloat16 inputs) for each chunk size, in three designs:
# float32 operands with TF32 products and with exact `"ieee"` products (this kernel's float32
# mode), and bfloat16 operands with float32 accumulation (fla's design). For each stage it reads
# the registers per thread, spilled bytes, stack frame and shared memory from the compiler, and
# counts the tensor-core (`mma`) instructions in the PTX. The cell prints its time.
#
# Next to it, a number no compiler reports: the **bytes** each stage moves to and from global
# memory per chunk and head, and its **arithmetic intensity** (flops per byte), counted from the
# kernels' loads, stores and `tl.dot`s, with the intermediates in float32 or in bfloat16 and the
# $D_v / BV$ value blocks each re-reading their operands. A GPU reaches its peak rate only on work
# that does many flops per byte it moves; below that, memory sets the pace.

# %%
def stage_traffic(C, Dk, Dv, BV, mid_bytes, in_bytes=2, f32=4):
    """(flops, bytes) per chunk and head of each stage, counted from the kernels;
    mid_bytes: bytes per number of W, U, S_[c], U' (4: float32, 2: bfloat16)."""
    nV = -(-Dv // BV)  # value blocks: each re-reads what it needs of W, K, Q
    m = mid_bytes
    # flops: KKᵀ, substitution, 𝒯K, 𝒯V; bytes: K twice, V, β, then W and U written
    wy_ = (2 * C * C * Dk + 3 * C**3 + 2 * C * C * Dk + 2 * C * C * Dv,
           2 * C * Dk * in_bytes + C * Dv * in_bytes + C * in_bytes + C * (Dk + Dv) * m)
    # flops: W S and Kᵀ U'; bytes: W and K per block, U, S_[c] and U' written
    state = (2 * 2 * C * Dk * Dv,
             nV * C * Dk * (m + in_bytes) + C * Dv * m + Dk * Dv * m + C * Dv * m)
    # flops: Q S, Q Kᵀ (per block), Ω U'; bytes: Q, K per block, S_[c], U', O
    output = (2 * C * Dk * Dv + nV * 2 * C * C * Dk + 2 * C * C * Dv,
              nV * 2 * C * Dk * in_bytes + Dk * Dv * m + C * Dv * m + C * Dv * in_bytes)
    return {"_wy_kernel": wy_, "_state_kernel": state, "_output_kernel": output}


def count_mma(ptx):
    """The tensor-core (mma) instructions in a PTX listing."""
    return sum("mma_async" in line or "mma.sync" in line for line in ptx.splitlines())


# launch_config's name for each kernel
CONFIG_KEYS = {"_wy_kernel": "wy", "_state_kernel": "state", "_output_kernel": "output"}
# (operands, precision, C) -> {stage: ptxas report + shared bytes, mma count, warps}
resources = {}
if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    t0 = time.perf_counter()
    for ops, prec in DESIGNS:
        for C in COMPILE_CS:
            out = kd.compile_for_gpu(90, chunk_size=C, Dk=COMPILE_D, Dv=COMPILE_D,
                                     dtype=torch.bfloat16, operands=ops,
                                     input_precision=prec)
            cfg = kd.launch_config(C, COMPILE_D, COMPILE_D)
            resources[ops, prec, C] = {
                name: dict(runtime.ptxas_report(c.asm["ptx"]), shared=c.metadata.shared,
                           mma=count_mma(c.asm["ptx"]),
                           warps=cfg[CONFIG_KEYS[name]]["num_warps"])
                for name, c in out.items()}
    print(f"compiled and assembled {3 * len(resources)} kernels "
          f"in {time.perf_counter() - t0:.0f} s; "
          f"sm_90, Dk = Dv = {COMPILE_D}, bf16 inputs")
    print(f"{'operands':>8s} {'dot':>4s} {'C':>3s} {'stage':>15s} {'warps':>5s} "
          f"{'regs':>4s} {'spill B':>7s} {'stack B':>7s} {'shared KB':>9s} {'mma':>4s}")
    for (ops, prec, C), stages in resources.items():
        dot = prec if ops == "float32" else "bf16"
        for name, r in stages.items():
            print(f"{ops:>8s} {dot:>4s} {C:3d} {name:>15s} {r['warps']:5d} "
                  f"{r['registers']:4d} {r['spill_stores']:7d} {r['stack_frame']:7d} "
                  f"{r['shared'] / 1024:9.0f} {r['mma']:4d}")
    SM_REGISTERS, SM_SHARED = 65536, 228 * 1024  # per SM on H100 (sm_90)
    C_max = max(COMPILE_CS)
    for ops, prec in DESIGNS:
        r = resources[ops, prec, C_max]["_state_kernel"]
        by_regs = SM_REGISTERS // (r["registers"] * 32 * r["warps"])
        by_shared = SM_SHARED // max(r["shared"], 1)
        print(f"state pass, {ops} operands ({prec if ops == 'float32' else 'bf16'}), "
              f"C = {C_max}: programs per SM allowed by registers {by_regs}, "
              f"by shared memory {by_shared}")

print(f"\nbytes moved per chunk and head, and flops per byte, Dk = Dv = {COMPILE_D}:")
traffic = {}
for C in (16, 32, 64):
    if kernels.AVAILABLE:
        BV = kd.launch_config(C, COMPILE_D, COMPILE_D)["state"]["BV"]
    else:
        BV = 32
    for mid, m_bytes in (("fp32", 4), ("bf16", 2)):
        traffic[mid, C] = stage_traffic(C, COMPILE_D, COMPILE_D, BV, m_bytes)
        print(f"  C = {C:2d}, intermediates {mid}: " + ", ".join(
            f"{name.strip('_').replace('_kernel', '')} {by / 1024:5.0f} KB "
            f"({fl / by:4.1f} flop/B)" for name, (fl, by) in traffic[mid, C].items()))

# %% mystnb={"figure": {"caption": "What each of the three Triton stages needs when compiled for sm_90 at $D_k = D_v = 128$ with bfloat16 inputs, against the chunk size $C$, in three designs: float32 operands with TF32 products (solid), float32 operands with exact ieee products (dashed), bfloat16 operands with float32 accumulation (dotted). Registers and stack frame per thread and shared memory per program as the compiler reports them; bytes moved per chunk and head counted from the kernels' loads and stores, with float32 or bfloat16 intermediates.", "name": "fig-kernel-stage-resources"}, "image": {"alt": "Four line plots in a two-by-two grid against chunk size 16, 32 and 64, one colour per stage (wy, state, output) and one line style per design. Registers per thread: the float32 TF32 state pass reaches the 255 limit at C = 64; the ieee state pass sits at the limit at C = 16 and 32 and drops to 64 at C = 64, where the ieee wy stage reaches the limit; the bfloat16 design stays below the limit. Stack frame: zero except for the ieee design, whose state pass needs hundreds of bytes at C = 16 and 32 and thousands at C = 64, and whose wy stage needs a few hundred at C = 64. Shared memory grows with C, least for the bfloat16 design. Bytes moved: every stage moves fewer bytes with bfloat16 intermediates."}}
stage_names = ["_wy_kernel", "_state_kernel", "_output_kernel"]
colors = ("C0", "C1", "C2")
styles = {("float32", "tf32"): "o-", ("float32", "ieee"): "s--",
          ("bfloat16", "tf32"): "^:"}
fig, axes = plt.subplots(2, 2, figsize=(6.7, 6.6), layout="constrained")
axes = axes.flatten()
for name, color in zip(stage_names, colors):
    for design, ls in styles.items():
        Cs = [C for (o_, p_, C) in resources if (o_, p_) == design]
        if not Cs:
            continue
        vals = [resources[(*design, C)][name] for C in Cs]
        axes[0].plot(Cs, [x["registers"] for x in vals], ls, color=color)
        axes[1].plot(Cs, [x["stack_frame"] for x in vals], ls, color=color)
        axes[2].plot(Cs, [x["shared"] / 1024 for x in vals], ls, color=color)
    for mid, ls in (("fp32", "o-"), ("bf16", "^:")):
        Cs = [C for (m_, C) in traffic if m_ == mid]
        axes[3].plot(Cs, [traffic[mid, C][name][1] / 1024 for C in Cs], ls, color=color)
axes[0].axhline(MAX_REGISTERS, color="k", ls="-", lw=0.5)
titles = ("registers per thread (ptxas)", "stack frame per thread (bytes, ptxas)",
          "shared memory per program (KB)", "bytes moved per chunk and head (KB)")
for ax, title in zip(axes, titles):
    ax.set_title(title, fontsize=10)
    ax.set(xlabel="chunk size C")
    ax.set_xscale("log", base=2)
    ax.set_xticks([16, 32, 64], ["16", "32", "64"])
by_stage = [Line2D([], [], color=color, label=name.strip("_").replace("_kernel", ""))
            for name, color in zip(stage_names, colors)]
by_style = [Line2D([], [], color="k", marker="o", ls="-", label="fp32 operands, tf32"),
            Line2D([], [], color="k", marker="s", ls="--", label="fp32 operands, ieee"),
            Line2D([], [], color="k", marker="^", ls=":", label="bf16 operands")]
key = [h for pair in zip(by_stage, by_style) for h in pair]  # columns fill first
fig.legend(handles=key, loc="outside lower center", ncol=3, fontsize=8)
fig.suptitle(f"The three stages compiled for sm_90, Dk = Dv = {COMPILE_D}, bf16 inputs",
             fontsize=11)
plt.show()

# %% [markdown]
# What the table and the figure say:
#
# - **bfloat16 operands against float32 with TF32.** Neither spills. The bfloat16 design needs
#   half the `mma` instructions (the `mma` column): a bfloat16 `wgmma` consumes 16 elements of the
#   inner dimension where a TF32 one consumes 8, so each instruction does twice the work, and H100
#   runs both at the same instruction rate. It needs no more shared memory than TF32 in any stage,
#   and about half in stage 1 and the state pass at $C = 64$, where the operands staged for
#   `tl.dot` (2 bytes instead of 4) dominate. Its registers are not lower across the board: the
#   state pass at $C = 64$, at the 255 limit with TF32, stays below it, but the bfloat16 output
#   pass uses more registers than the TF32 one at $C = 16$ and $32$ (the `regs` column). Its
#   stages also move fewer bytes (last panel), the intermediates being half the size. TF32 is
#   therefore the fast mode only among float32-operand designs.
# - **The register outlier.** With `"ieee"` products there are no tensor-core instructions
#   (the `mma` column): each product becomes float32 fused multiply-adds whose operand layout
#   gives every thread whole rows of $W_{[c]}$ and columns of $S_{[c]}$. At $C = 16$ and $32$ the
#   state pass sits at 255 registers and spills hundreds of bytes; at $C = 64$ stage 1 reaches
#   255 and spills as well, and the state pass reports far fewer registers and a stack frame of
#   kilobytes (the `stack B` column): the working set no longer fits, and ptxas moved the tiles
#   to local memory and streams through them with few registers. A low register count with a
#   large stack frame is the heaviest case, not the lightest. The exact mode is for checking; the
#   other two designs do not spill.
# - **Occupancy.** The last lines of the table divide an H100 SM's registers and shared memory
#   by what one state-pass program needs. In the two designs that do not spill, registers bind
#   first: the bfloat16 design's smaller tiles halve the shared memory but leave the program
#   count per SM where the registers put it.
# - **Arithmetic intensity** is low for every stage (tens of flops per byte at most). Stages 1
#   and 3 do $O(C^2 D)$ work per chunk on $O(C D)$ bytes, so their intensity grows with $C$; the
#   state pass gains less, because each of a head's $D_v / BV$ programs reloads $W_{[c]}$ and
#   $K_{[c]}$. A GPU needs far more flops per byte to keep its tensor cores busy, so all three
#   stages are bound by memory traffic: chunks of 64 rather than chapter 8's flop-minimal small
#   chunks move fewer bytes per token (the three stages' bytes per chunk, added up, grow less
#   than fourfold from $C = 16$ to $64$, while a chunk covers four times the tokens), and
#   bfloat16 intermediates fewer still.

# %% [markdown]
# ## Exercises
#
# The first two are what one program of a kernel does, written in PyTorch (no Triton needed);
# the third is a Triton kernel, checked under the interpreter.
#
# ```{exercise} The addresses of a chunk's tile
# :label: ex-kernel-tile-offsets
#
# Write `tile_offsets(i_bh, i_c, T, D, C, BD)`: for a contiguous `[B·H, T, D]` tensor, the element
# offsets (`int64`, `[C, BD]`) of the tile program `(i_c, i_bh)` loads, tokens
# $i_c C, \dots, i_c C + C - 1$ of head `i_bh` and columns $0, \dots, BD - 1$ ($BD \ge D$, a power
# of two), and the mask (`bool`, `[C, BD]`) of the entries with $t < T$ and $d < D$. Compute the
# offsets for every entry, masked or not, as the kernel's `arange` arithmetic does.
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
# A load is `x.flatten()[offsets]` where the mask holds and `other` elsewhere. Without the row
# mask, the last chunk of head 0 reads head 1's first tokens ($T = 37$, $D = 4$, chunk 2 of 16):

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
# Write `state_pass_block(w, u, k, s0, chunk_size, i_v, BV)`, one program of the state pass for
# one head: `w [T, Dk]`, `u [T, Dv]` (stage 1's WY factors), `k [T, Dk]`, the whole initial state
# `s0 [Dk, Dv]`, and the program's columns `i_v·BV` up to `min(Dv, i_v·BV + BV)`. Walk the
# $\lceil T/C \rceil$ chunks (the last may be short) with $U'_{[c]} = U_{[c]} - W_{[c]} S_{[c]}$ and
# $S_{[c+1]} = S_{[c]} + K_{[c]}^\top U'_{[c]}$ on those columns, and return
# `(states [N, Dk, n], u_new [T, n], s_final [Dk, n])`: the state each chunk *starts* from, the
# deltas and the final state.
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
        states.append(S)  # store S_[c] before the update
        du = u[rows, cols] - w[rows] @ S  # U'_[c] = U_[c] − W_[c] S_[c]       [C, n]
        deltas.append(du)
        S = S + k[rows].T @ du  # S_[c+1] = S_[c] + K_[c]ᵀ U'_[c]          [Dk, n]
    return torch.stack(states), torch.cat(deltas), S


ok = checks.run("kernel.state_pass_block", state_pass_block_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# Run over every block of columns (here of 8) and every head, as the kernel's grid runs its
# programs, the function rebuilds what `_state_kernel` stored on the inputs of the stage-by-stage
# check (the kernel's own block width does not matter: the columns never mix):

# %%
if kernels.AVAILABLE:
    B, H, T, Dk, Dv, C = 2, 2, 37, 20, 12, 16
    BV = 8
    q, k, v, beta, S0 = kernel_inputs(B, H, T, Dk, Dv, seed=4)
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
          f"max distance to the kernel's stored S_[c], U' and S_N = {worst:.1e}")
else:
    print(kernels.REASON)

# %% [markdown]
# ```{exercise} The output stage, in Triton
# :label: ex-kernel-output-stage
#
# Complete `output_kernel_mine`, one program per (chunk, head) on a grid `(NT, B·H)`: load
# $Q_{[c]}$, $K_{[c]}$ (`[BC, BK]`), the stored state $S_{[c]}$ (`[BK, BV]`, at
# `states + (i_bh·NT + i_c)·Dk·Dv`) and $U'_{[c]}$ (`[BC, BV]`), compute
# $O_{[c]} = Q_{[c]} S_{[c]} + (Q_{[c]} K_{[c]}^\top \odot M)\, U'_{[c]}$ and store it. All
# tensors are contiguous float32, `q, k [B·H, T, Dk]`, `states [B·H, NT, Dk, Dv]`,
# `u_new, o [B·H, T, Dv]`; `BK` and `BV` are $D_k$ and $D_v$ padded to powers of two, so every
# load and the store need masks. `check_kernel.check_output_kernel` launches your kernel under
# the Triton interpreter on five fixed random cases (partial last chunks, padded head sizes,
# several heads) against the PyTorch reference; every tensor sits between NaN margins, so an
# unmasked load reads NaN and an unmasked store is seen.
# ```

# %%
def output_kernel_mine(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr):
    i_c = tl.program_id(0)  # which chunk
    i_bh = tl.program_id(1)  # which (batch, head)
    o_i = tl.arange(0, BC)
    o_t = i_c * BC + o_i  # tokens of the chunk
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    # your code here: masks, four loads, three tl.dot, the causal mask, one store
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = check_kernel.check_output_kernel(output_kernel_mine)

# %% [markdown]
# ```{solution-start} ex-kernel-output-stage
# :class: dropdown
# ```

# %%
tinyk3.notebook.show_source(check_kernel.output_kernel_solution)
ok = check_kernel.check_output_kernel(check_kernel.output_kernel_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# The same check with the causal mask's diagonal dropped (`>` for `>=`), a typical slip, fails
# on the first case and names it:

# %%
if kernels.AVAILABLE:

    def output_kernel_strict(q, k, states, u_new, o, T, Dk, Dv, NT, BC: tl.constexpr,
                             BK: tl.constexpr, BV: tl.constexpr):
        i_c, i_bh = tl.program_id(0), tl.program_id(1)
        o_i = tl.arange(0, BC)
        o_t = i_c * BC + o_i
        o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
        m_tk = (o_t[:, None] < T) & (o_k[None, :] < Dk)
        m_tv = (o_t[:, None] < T) & (o_v[None, :] < Dv)
        b_q = tl.load(q + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0)
        b_k = tl.load(k + i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :], mask=m_tk,
                      other=0.0)
        p_s = states + (i_bh * NT + i_c) * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        b_s = tl.load(p_s, mask=(o_k[:, None] < Dk) & (o_v[None, :] < Dv), other=0.0)
        b_u = tl.load(u_new + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :],
                      mask=m_tv, other=0.0)
        b_sc = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
        b_sc = tl.where(o_i[:, None] > o_i[None, :], b_sc, 0.0)  # the slip: > for >=
        b_o = tl.dot(b_q, b_s, input_precision="ieee")
        b_o += tl.dot(b_sc, b_u, input_precision="ieee")
        tl.store(o + i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :], b_o, mask=m_tv)

    result = check_kernel.check_output_kernel(output_kernel_strict)
else:
    print(kernels.REASON)

# %% [markdown]
# ## Summary
#
# - A production kernel for the chunked delta rule splits chapter 8's algorithm into the scaled
#   $KK^\top$, the triangular solve, the WY factors, the state pass and the output pass (fla's five
#   kernels; three launches here). Only the state pass is sequential, because only
#   $S_{[c+1]} = S_{[c]} + K_{[c]}^\top (U_{[c]} - W_{[c]} S_{[c]})$ links a chunk to the one
#   before; it runs as a loop inside one program per head and block of state columns, carrying
#   the state in registers. The columns of $S$ evolve independently, so a head's state can be
#   split over programs.
# - Every intermediate one launch hands to the next goes through global memory: $W$, $U$, $U'$
#   and every chunk's starting state, more bytes than the inputs; this kernel's bfloat16 mode
#   halves them, as fla's bfloat16 storage does (fla also stores its scaled $KK^\top$ and the
#   inverses). fla's backward pass therefore stores little and recomputes. The lib's kernel
#   keeps the chunk states it wrote and recomputes the rest in its backward kernels (Part VI).
# - The kernels map line by line onto the equations: `program_id` picks the chunk, head and
#   value block, `arange` and masks build the tiles, `tl.dot` does the products, and the
#   triangular solve is a row loop of masked tile operations.
# - Under the Triton interpreter each stage and the end result equal the PyTorch chunked form to
#   float32 round-off in the float32 mode; the bfloat16-operand mode, emulated there by exact
#   rounding, stores bfloat16 values, with larger errors against float64 than the float32 mode
#   (`tests/test_kernels.py` bounds both).
# - Compiled for sm_90 without a GPU, the bfloat16 design needs half the `mma` instructions of the
#   float32 design with TF32 and no more shared memory (about half at $C = 64$ in stage 1 and the
#   state pass), with register counts of the same order, and neither spills; exact `"ieee"`
#   products have no tensor cores and spill, and at $C = 64$ the state pass's stack frame grows to
#   kilobytes, which is why ptxas reports so few registers there.
#
# **Next.** Chapter 10 adds a forgetting gate: Gated DeltaNet multiplies the state by a decay
# $\alpha_t$ at every step, $S_t = \alpha_t (I - \beta_t k_t^\top k_t) S_{t-1} + \beta_t k_t^\top v_t$. The
# chunked form keeps the stages of this chapter but every product inside a chunk gains a decay mask,
# and a published formula that forgot it is measurably wrong. This chapter's kernels with the gates
# of chapters 10 and 11 added are read in an optional appendix,
# [the gated rules as Triton kernels](A1_gated_kernels.ipynb).

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
