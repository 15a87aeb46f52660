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
# # Appendix: the gated rules as Triton kernels
#
# Chapter 9 turned chunked DeltaNet into three Triton kernels; chapters 10 and 11 added a forget
# gate, one number per head (Gated DeltaNet) or one per key channel (KDA), and derived its chunk
# form in PyTorch. This appendix reads the Triton kernels of both gated rules against chapter 9's,
# line by line: what the gate changes in each stage, how the kernels differ from fla's, how
# accurate they are in both operand modes, and what the gate costs in registers on an H100,
# compiled without one. Nothing in the chapters depends on it; it assumes chapters 9 to 11.
#
# **Cost.** About ten seconds on one CPU core, running the kernels under the Triton interpreter
# and compiling them for sm_90 (the last cell prints the time). Without Triton the checks say so
# and are skipped.

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
import numpy as np
import torch
import torch.nn.functional as F

import tinyk3.kernels as kernels
from tinyk3.kernels import delta_rule as kernel9
from tinyk3.kernels import gated as kernel_gated
from tinyk3.notebook import source_diff
from tinyk3.ops import gated_delta_rule, kda
from tinyk3.util import max_diff

# %% [markdown]
# ## What the gate changes, stage by stage
#
# Chapter 9 wrote chunkwise DeltaNet as three Triton stages: the WY factors of every chunk in
# parallel, the one sequential pass over chunks that carries the state, and the outputs of every
# chunk in parallel again. The gated rules keep that split. `tinyk3.kernels.gated` holds gated
# copies of the three kernels, shared by both rules: a compile-time constant `GATE` selects one
# gate per head (`1`, Gated DeltaNet, chapter 10) or one per key channel (`2`, KDA), so Triton
# compiles a separate kernel for each and the `if GATE == …` branches cost nothing when it runs.
# `tinyk3.kernels.gated_delta_rule.chunked` and `tinyk3.kernels.kda.chunked` have the signatures
# of the ops. Below, each stage as a diff against chapter 9's source: lines with `-` are chapter
# 9's, lines with `+` the gated kernel's, everything else is unchanged.
#
# Two things set these kernels apart from fla's `chunk_kda`, and both are choices of simplicity
# over speed. **The sub-chunk scores**: KDA's gated $KK^\top$ and $QK^\top$ are formed with one
# full $C \times C$ `tl.dot` per reference point, the rows of the other sub-chunks zeroed, so
# $C/16$ full products where fla forms $16 \times 16$ blocks (`fla/ops/kda/chunk_intra.py`): at
# $C = 64$ these two products cost 4 times chapter 9's, so "the decay adds only elementwise
# exponentials", true of the counted form above, is not true of these kernels. **The operand
# precision**: in the production mode every `tl.dot` takes bfloat16 operands with float32
# accumulation, where fla's forward forms the sub-chunk scores from float32 tiles with TF32
# products. Neither has been timed on a GPU yet (`tools/gpu_check_kernels.py` holds the check).

# %%
def kernel_diff(name, helper=None):
    """What the gated kernel changes in one of chapter 9's stages (with the helper it
    moved part of chapter 9's body into, read first)."""
    new = getattr(kernel_gated, name)
    print(source_diff(getattr(kernel9, name), new if helper is None else (helper, new),
                      f"chapter 9 {name}", f"gated {name}"))


kernel_diff("_wy_kernel", kernel_gated._ut_inverse)

# %% [markdown]
# **Stage 1, the WY factors.** The gated kernel keeps $KK^\top$ and the triangular solve in a
# helper, `_ut_inverse` (read first above), so that the backward of chapter 21 can run this
# stage from the inverse $X$ the forward kept (`LOAD_X`) instead of solving again. The solve
# for $\mathcal{T}$ is untouched: the gate changes only the matrix it solves and the keys $W$
# is made of. Gated DeltaNet forms $K K^\top$ as before
# and multiplies it by $\Gamma$, with the exponent set to $-\infty$ above the diagonal before the
# `exp` (chapter 10's `decay_mask`); then $W = \mathcal{T} \operatorname{diag}(\gamma) K$. KDA
# cannot multiply afterwards, because its decay sits inside the sum over channels: for each
# reference point $r_a$ the kernel multiplies the rows of sub-chunk $a$, scaled by $e^{L_i}$,
# with the columns of sub-chunks $b \le a$, scaled by $e^{r_a - r_b - L_j}$, and adds the
# products: chapter 11's `kda.pair_scores`, as `tl.dot`s (the helper `_decayed_scores`, which
# stage 3 and chapter 21's backward share). The gates of each chunk are summed inside the
# kernel (`tl.associative_scan`), so only $g$ itself is read from memory.

# %%
kernel_diff("_state_kernel")

# %% [markdown]
# **Stage 2, the state pass.** The sequential loop gains two decays per chunk: the state is
# multiplied by $\gamma_C$ (a scalar per head, or one factor per row of $S$ for KDA), and each
# key by $e^{G_C - G_i} = e^{\sum_{s > i} g_s}$ before $K^\top U'$ writes it into the state. That
# sum is taken as a reverse scan of the gates loaded one token later, so it holds only its own
# terms and never subtracts two large sums. Most of the lines removed are chapter 9's
# `FUSE_OUTPUT` option (the output computed inside this loop), which the gated kernels do not
# carry: their output always has its own parallel pass, as in fla. The others come back as
# gated lines (the keys, for one, are now loaded in float32 and decayed before rounding).

# %%
kernel_diff("_output_kernel")

# %% [markdown]
# **Stage 3, the outputs.** $O_{[c]} = (Q \odot \Gamma) S_{[c]} + \Omega U'$: the queries meet
# the chunk's starting state decayed by $\gamma_i$, and the intra-chunk scores are the decayed
# ones, formed exactly as in stage 1 (after the product for Gated DeltaNet, sub-chunk by
# sub-chunk for KDA).
#
# The kernels run on CPU tensors under the Triton interpreter, a real launch of the same code.
# Against the float64 token loops, at a length that is not a multiple of the chunk, $D_k \ne D_v$,
# a non-zero initial state, in the exact float32 mode and in the bf16-operand mode production
# kernels use, and for KDA once more with the gate-stress inputs of chapter 11's numerics section
# (gates down to $-5$, a whole chunk at the bound):

# %%
def kernel_check(kernel, op, q, k, v, beta, g, S0, C, operands):
    """Relative max error of a kernel's o and S against the op's float64 token loop."""
    o_ref, S_ref = op.recurrent(q, k, v, beta, g, initial_state=S0)
    args = (t.float() for t in (q, k, v, beta, g))
    o, S = kernel(*args, chunk_size=C, initial_state=S0.float(), operands=operands)
    scale_o = max(1.0, o_ref.abs().max().item())
    scale_S = max(1.0, S_ref.abs().max().item())
    return max_diff(o, o_ref) / scale_o, max_diff(S, S_ref) / scale_S


if not kernels.AVAILABLE:
    print(f"Triton is not installed here ({kernels.REASON}): the kernels cannot run.")
else:
    from tinyk3.kernels import gated_delta_rule as kernel_gdn
    from tinyk3.kernels import kda as kernel_kda

    F64 = torch.float64
    gen = torch.Generator().manual_seed(11)
    B, H, T, Dk, Dv = 1, 2, 45 if SMOKE else 77, 24, 16
    q = torch.randn(B, H, T, Dk, generator=gen, dtype=F64)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=F64)
    beta = torch.rand(B, H, T, generator=gen, dtype=F64)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=F64)
    g_head = -torch.rand(B, H, T, generator=gen, dtype=F64)
    g_chan = -torch.rand(B, H, T, Dk, generator=gen, dtype=F64)
    g_stress = -5 * torch.rand(B, H, T, Dk, generator=gen, dtype=F64)
    g_stress[..., : Dk // 4] = -1e-3  # long-lived channels beside ...
    g_stress[..., Dk // 4: Dk // 2] = -5.0  # ... channels at the bound
    g_stress[:, :, 16:32] = -5.0  # a whole chunk of 16 at the bound
    cases = [("gated_delta_rule", kernel_gdn.chunked, gated_delta_rule, g_head),
             ("kda", kernel_kda.chunked, kda, g_chan),
             ("kda, gate stress", kernel_kda.chunked, kda, g_stress)]
    for name, kernel, op, g_ in cases:
        for C in (16, 32):
            for operands in ("float32", "bfloat16"):
                err_o, err_S = kernel_check(kernel, op, q, k, v, beta, g_, S0, C,
                                            operands)
                print(f"{name:>17s}  C={C}  {operands:>8s} operands: "
                      f"o {err_o:.1e}, S_T {err_S:.1e} (relative)")

# %% [markdown]
# The float32 mode agrees with the float64 loop to float32 round-off in every case; the bf16
# mode, which rounds every operand of a matrix product to bfloat16 (8 significant bits) and
# stores $W$, $U$, the chunk states and $U'$ in bfloat16, is off by what that rounding costs
# (the tests bound it by $1.5 \times 10^{-2}$). The stress case is about as accurate as the mild one:
# the sub-chunk factors never leave float32's range. Gates whose 16-token sum falls below
# $-80$ (possible only below $-5$ per step) are refused by the KDA kernel with a message, since
# its diagonal blocks are always factorised; the op's exact pairwise path handles them:

# %%
if kernels.AVAILABLE:
    g_bad = torch.full((1, 1, 32, 8), -6.0)  # 16 × −6 = −96 < −80
    x = torch.randn(1, 1, 32, 8)
    try:
        kernel_kda.chunked(x, F.normalize(x, dim=-1), x, torch.rand(1, 1, 32), g_bad,
                           chunk_size=16)
    except ValueError as err:
        print(f"ValueError: {err}")

# %% [markdown]
# What the gate costs on a GPU shows before any GPU runs: compiling the kernels for an H100
# (sm_90) without one, and reading the registers each thread needs and whether any spill to
# local memory (chapter 9's `runtime.ptxas_report`), at the production shape C = 64,
# $D_k = D_v = 128$, bf16 inputs with bf16 operands, against chapter 9's kernel at the same shape:

# %%
STAGES = ("_wy_kernel", "_state_kernel", "_output_kernel")
ptxas = {}  # (kernel, stage) -> ptxas's report, with the shared memory in KB
reason = None if not kernels.AVAILABLE else kernel9.cannot_compile_reason()
if not kernels.AVAILABLE or reason:
    print(reason or kernels.REASON)
else:
    from tinyk3.kernels import runtime

    t0 = time.perf_counter()
    shape = dict(chunk_size=16 if SMOKE else 64, Dk=128, Dv=128, dtype=torch.bfloat16,
                 operands="bfloat16")
    builds = {"chapter 9": kernel9.compile_for_gpu(90, **shape),
              "gated_delta_rule": kernel_gdn.compile_for_gpu(90, **shape),
              "kda": kernel_kda.compile_for_gpu(90, **shape)}
    print(f"compiled for sm_90 in {time.perf_counter() - t0:.1f} s "
          f"(C = {shape['chunk_size']}, D = 128, bf16 operands)")
    print(f"{'stage':>15s}" + "".join(f"{name:>28s}" for name in builds))
    for stage in STAGES:
        cells = []
        for name, compiled in builds.items():
            rep = runtime.ptxas_report(compiled[stage].asm["ptx"])
            rep["shared_kb"] = compiled[stage].metadata.shared / 1024
            ptxas[name, stage] = rep
            cells.append(f"{rep['registers']} reg, {rep['spill_stores']} B spill, "
                         f"{rep['shared_kb']:.0f} KB")
        print(f"{stage:>15s}" + "".join(f"{c:>28s}" for c in cells))

# %% mystnb={"figure": {"caption": "Registers per thread that ptxas assigns to each stage of chapter 9's kernel and of the gated kernels (Gated DeltaNet, KDA), compiled for sm_90 at C = 64, D = 128 with bf16 operands; the dotted line is the 255-register limit of a thread, past which values spill to local memory.", "name": "fig-gated-kernel-registers"}, "image": {"alt": "Grouped bar chart of registers per thread for three stages, the WY factors, the state pass and the outputs, with three bars each: chapter 9, Gated DeltaNet and KDA. In the WY stage the bars rise from chapter 9 to Gated DeltaNet to KDA; in the state pass the gated bars reach the dotted 255 line; in the output stage chapter 9 and Gated DeltaNet are level and KDA is higher."}}
if ptxas:
    names = list(builds)
    x = np.arange(len(STAGES))
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    for i, name in enumerate(names):
        regs = [ptxas[name, st]["registers"] for st in STAGES]
        ax.bar(x + (i - 1) * 0.27, regs, 0.27, label=name, color=f"C{i}")
    ax.axhline(255, color="k", ls=":", lw=1)
    ax.set_xticks(x, ["WY factors", "state pass", "outputs"])
    ax.set(ylabel="registers per thread", ylim=(0, 330),
           title="What the gate costs in registers (sm_90, bf16)")
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    plt.tight_layout()
    plt.show()

# %% [markdown]
# Registers per thread, bytes spilled and shared memory per program, stage by stage
# (a thread has at most 255 registers; what does not fit spills to local memory, off the chip).
# The gates cost registers most in KDA's stages, whose gates are `[C, BK]` tiles, and in the state
# pass, which carries the state in registers and reaches the cap for both rules; Gated DeltaNet's
# gate, one number per token, adds fewer in stage 1 and none in stage 3 (the table). The launch
# configuration (`kernel_gated.launch_config`, chapter 9's with smaller tiles where ptxas reported
# spills for the gated stages) keeps the bf16 mode free of spills.
# `benchmarks/2026-12-02-ptxas-gated/` records the same for sm_80 and sm_90 in both operand modes.
# Timing needs a GPU: `tools/gpu_check_kernels.py` checks the compiled kernels against the float64
# loops and times them against fla's `chunk_gated_delta_rule` and `chunk_kda` (bf16, B = 4,
# H = 16, D = 128, T from 2048 to 16384).


# %% [markdown]
# ## Summary
#
# - The gated kernels are chapter 9's three stages with the gate added: the WY stage solves the
#   decayed matrix, the state pass decays the state and each key to the chunk's end, the output
#   stage decays the queries and the scores. One source serves both rules (`GATE`, a
#   compile-time constant).
# - KDA's decayed scores are formed per reference point, as chapter 11 derived, with C/16 full
#   products where fla forms 16 × 16 blocks, and bf16 operands where fla's sub-chunk scores use
#   float32 tiles: simpler, and slower at C = 64 until a GPU measures how much.
# - Under the interpreter both kernels equal the float64 loops to float32 round-off in the exact
#   mode and to bf16 rounding in the production mode, gate stress included; the KDA kernel
#   refuses gates below its factorisation's range with a message.
# - Compiled for sm_90 without a GPU, no stage spills in bf16 mode at the default tiles.
#
# **Next.** Chapter 12 builds the KDA layer around the operator these kernels compute.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
