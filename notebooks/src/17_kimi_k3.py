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
# # Kimi K3
#
# The destination of the course: Kimi K3 (Moonshot AI; weights and technical report released
# on 27 July 2026), the model of the title, published with 2.8 trillion parameters of which
# 104 billion are used for each token. Its token mixers are chapter 15's Kimi Linear hybrid (KDA in three of every four
# layers, position-free MLA in the fourth), its feed-forward layers chapter 14's mixture of
# experts. What is new sits between and inside them: the residual stream itself becomes an
# attention over depth, the experts run in a narrower latent space, a soft-capped gated unit
# replaces SiLU, and both mixers get sigmoid gates on their outputs.
#
# **Sources.** Kimi Team, *Kimi K3: Open Frontier Intelligence*, arXiv 2607.24653 (the
# technical report, also `k3_tech_report.pdf` in the `MoonshotAI/Kimi-K3` repository), and the
# model card of `moonshotai/Kimi-K3`. The sizes are the released `config.json`'s (its
# `text_config`), recorded once in `tinyk3.models.presets.kimi_k3`; the computations are those
# of third-party ports that run the released weights, mlx-lm's `models/kimi_k3.py` above all,
# against which every piece here is checked. Where the chapter uses a statement of the report,
# it gives the section and says that it is quoted: by the report's readers, torchtitan's
# `models/kimi_k3/` (whose code cites §2.3.3, §2.5 and §4.1.4), NVIDIA's and DeepSpeed's
# issue threads and public reading notes. Block attention residuals are described in Kimi
# Team, *Attention Residuals*, arXiv 2603.15031.
#
# **In this chapter** you build every change from Kimi Linear small, each checked against
# `tinyk3` with a printed distance (and against mlx-lm where it is installed): the layer
# pattern; block attention residuals, and what they do and do not reduce to; SiTU-GLU and why
# it caps; the latent mixture of experts; MLA's sigmoid output gate; KDA's lower-bound gate
# and full-rank output gate. Then a tiny K3-shaped model whose cached decoding equals its full
# forward; the parameter counts of the released configuration against the published ones and
# the title's ratio, three ways; the decoding memory at a million tokens; a tiny K3 trained
# briefly against a GPT-2 of the same size; the released checkpoint's MXFP4 experts, decoded
# by hand and measured on that trained model; and what K3 changed in training (Quantile
# Balancing and Per-Head Muon are built in chapters 14 and 16).
#
# **Cost.** Under two minutes on one CPU core, most of it in the training experiment (the last
# cell prints the time); `SMOKE = True` runs in seconds.


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
import copy
import dataclasses
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from tinyk3 import checks, data, mxfp4
from tinyk3.layers import (
    KDAConfig,
    KimiDeltaAttention,
    MLAConfig,
    MoEConfig,
    MultiHeadLatentAttention,
    SwiGLUConfig,
    moe,
)
from tinyk3.models import LM, LMConfig, count_parameters, presets
from tinyk3.models.gpt2 import gpt2_config
from tinyk3.models.lm import DepthMix
from tinyk3.train import evaluate_loss, train_lm
from tinyk3.util import max_diff

STEPS = 4 if SMOKE else 150  # training steps of the experiment, for each model
SEEDS = (0,) if SMOKE else (0, 1)  # one training run per model and seed
BATCH, CONTEXT = 16, 64  # sequences per step and tokens per sequence
RESULTS = {}  # distances for the closing note

try:  # the independent implementation, where installed (never required)
    import mlx.core as mx
    from mlx_lm.models import kimi_k3 as mlx_k3
except ImportError as err:
    mlx_k3 = None
    print(f"mlx-lm is not importable ({err}): the comparisons with it are skipped "
          "(pip install 'mlx[cpu]' and mlx-lm --no-deps to run them)")

# %% [markdown]
# ## From Kimi Linear to Kimi K3
#
# The two released configurations, side by side (`presets.kimi_linear_48b()` and
# `presets.kimi_k3()`, each citing its source):

# %%
K3, KL = presets.kimi_k3(), presets.kimi_linear_48b()


def describe(cfg):
    kda = next(m for m in cfg.layer_mixers if m.kind == "kda")
    mla = next(m for m in cfg.layer_mixers if m.kind == "mla")
    mo = next(m for m in cfg.layer_mlps if isinstance(m, MoEConfig))
    return {
        "layers (KDA + MLA)": f"{cfg.n_layer} ({cfg.kinds.count('kda')} + "
                              f"{cfg.kinds.count('mla')})",
        "width": f"{cfg.n_embd:,}",
        "KDA heads x dim": f"{kda.n_head} x {kda.head_dim}",
        "KDA gate / output gate": f"{kda.gate} / {kda.output_gate}",
        "MLA heads, output gate": f"{mla.n_head}, {mla.output_gate}",
        "experts (per token, shared)": f"{mo.n_experts} ({mo.top_k}, {mo.n_shared})",
        "expert hidden / latent": f"{mo.expert_hidden:,} / {mo.latent_dim or '-'}",
        "activation": mo.activation,
        "attention residual blocks": cfg.attn_res_block_size or "-",
    }


rows_k3, rows_kl = describe(K3), describe(KL)
print(f"{'':>28s}{'Kimi Linear 48B':>22s}{'Kimi K3':>22s}")
for key in rows_k3:
    print(f"{key:>28s}{str(rows_kl[key]):>22s}{str(rows_k3[key]):>22s}")

# %% [markdown]
# ## The layer pattern
#
# Like Kimi Linear's, K3's configuration lists its full-attention layers counted from 1
# (`linear_attn_config["full_attn_layers"]`): every fourth layer and the last. Python counts
# from 0, so layer $j$ of the list is list position $j - 1$:

# %%
lin = presets.KIMI_K3_TEXT_CONFIG["linear_attn_config"]
full_1based = lin["full_attn_layers"]
n_layer = presets.KIMI_K3_TEXT_CONFIG["num_hidden_layers"]
kinds_mine = ["mla" if i + 1 in full_1based else "kda" for i in range(n_layer)]
print(f"full_attn_layers (1-based): {full_1based[:3]} ... {full_1based[-3:]}")
mla_at = [i for i, k in enumerate(kinds_mine) if k == "mla"]
print(f"0-based MLA positions: {mla_at[:3]} ... {mla_at[-3:]} "
      "(the last two are neighbours)")
print(f"{kinds_mine.count('kda')} KDA and {kinds_mine.count('mla')} MLA layers; "
      f"equal to presets.kimi_k3().kinds: {tuple(kinds_mine) == K3.kinds}")
print(f"first layer: mixer {K3.kinds[0]}, feed-forward {K3.layer_mlps[0].kind} "
      f"(hidden {K3.layer_mlps[0].hidden:,}); the others: "
      f"{sorted({m.kind for m in K3.layer_mlps[1:]})}")

# %% [markdown]
# So the last full-attention layer follows another one directly (0-based 91 and 92): 93 is not
# a multiple of four, and the model ends on global attention anyway, as Kimi Linear's 27
# layers do.
#
# ## Block attention residuals
#
# **The idea.** In GPT-2 and every model of this course so far, layer $\ell$ reads the residual
# stream $x_\ell = h_0 + \sum_{j < \ell} f_j$, the embedding plus the sum of every earlier
# sub-layer's output, each with weight one. Others had already made those weights learned:
# Hyper-Connections (Zhu et al., arXiv 2409.19606) widen the stream into several copies mixed
# by learned, input-dependent weights, and DeepSeek's manifold-constrained Hyper-Connections
# (mHC, arXiv 2512.24880) constrain that mixing to keep deep stacks stable.
# *Attention Residuals* replaces the fixed sum by a learned, input-dependent mixture over depth: each read is a softmax over earlier outputs, as
# attention is a softmax over earlier tokens. Attending to every earlier sub-layer would keep
# $2\ell$ vectors per token; the block form keeps a few. The layers are cut into blocks of
# $n$ (K3: $n = 12$); the sources of a read are the **completed block sums** $b_0 = h_0$
# (the embedding), $b_1, \dots, b_m$ (each the sum of one finished block's sub-layer outputs)
# and the **partial sum** $p$ of the current block so far.
#
# **The math.** With the sources $s_0, \dots, s_m, s_{m+1} = p$, each a $d_{\text{model}}$-vector for one
# token, a read with the learned vectors $w_{\text{norm}}, w_{\text{proj}} \in \mathbb{R}^{d_{\text{model}}}$ is
#
# $$
# \begin{gathered}
# \operatorname{read}(s_0, \dots, s_{m+1}) = \sum_{i=0}^{m+1} \pi_i\, s_i, \\
# \pi = \operatorname{softmax}_i\!\left(\frac{s_i}{\operatorname{rms}(s_i)} \cdot (w_{\text{norm}} \odot w_{\text{proj}})\right), \\
# \operatorname{rms}(s) = \sqrt{\tfrac{1}{d_{\text{model}}} \textstyle\sum_c s_c^2 + \epsilon} .
# \end{gathered}
# $$
#
# The keys are the RMS-normed sources (`RMSNorm` then a $d_{\text{model}} \to 1$ projection, so the two
# weights act as one vector), there is no $1/\sqrt{d_{\text{model}}}$, and the values are the **raw** sources:
# a block that wrote a large update contributes a large vector. The softmax runs over depth,
# separately for each token, so the read needs nothing from other tokens: decoding adds
# nothing to the cache. A block of layers then runs as follows (mlx-lm's
# `KimiK3DecoderLayer`, and `tinyk3.models.lm.Block`):
#
# 1. the attention input is $\operatorname{read}(b_0, \dots, b_m, p)$;
# 2. if the layer starts a block, $p$ becomes the completed $b_{m+1}$ and a new $p$ starts
#    empty (the layer at 0-based index $\ell$ starts a block when $\ell \bmod n = 0$, so layer 0
#    turns the embedding into $b_0$);
# 3. $p \leftarrow p + \operatorname{attn}(\operatorname{norm}(\text{input}))$;
# 4. the MLP input is a second read (its own weights) over the same blocks and the new $p$;
#    $p \leftarrow p + \operatorname{mlp}(\operatorname{norm}(\text{input}))$.
#
# After the last layer a final read (`output_attn_res`) gives the input of the final norm and
# the head. One read, from scratch, against `DepthMix`, the library's:

# %%
def depth_mix_mine(blocks, partial, w_norm, w_proj, eps, *, weights=False):
    """One read: a softmax over depth of the block sums and the partial sum."""
    if not blocks:
        return (partial, None) if weights else partial
    src = torch.stack([*blocks, partial])  # [S, B, T, d]
    keys = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)  # RMS-normed
    logits = keys @ (w_norm * w_proj)  # [S, B, T]: one logit per source and token
    p = logits.softmax(dim=0)  # over depth
    out = (p.unsqueeze(-1) * src).sum(0)  # the RAW sources
    return (out, p) if weights else out


gen = torch.Generator().manual_seed(0)
d = 32
mix = DepthMix(d, 1e-5).double()
with torch.no_grad():  # DepthMix starts at zero (a uniform mix): make it non-trivial
    mix.proj.weight.copy_(3 * torch.randn(1, d, generator=gen, dtype=torch.float64)
                          / math.sqrt(d))
    mix.norm.weight.copy_(1 + 0.2 * torch.randn(d, generator=gen, dtype=torch.float64))
srcs = [(i + 1) * torch.randn(2, 5, d, generator=gen, dtype=torch.float64)
        for i in range(4)]
with torch.no_grad():
    ours = depth_mix_mine(srcs[:3], srcs[3], mix.norm.weight, mix.proj.weight[0],
                          mix.norm.eps)
    dist = max_diff(ours, mix(srcs[:3], srcs[3]))
RESULTS["one read vs DepthMix (float64)"] = dist
print(f"my read against DepthMix: max |diff| {dist:.1e}")
if mlx_k3 is not None:
    blocks_mx = mlx_k3.ResidualBlocks(1e-5)
    for s in srcs[:3]:
        blocks_mx.append(mx.array(s.float().numpy()))
    w_eff = mx.array((mix.norm.weight * mix.proj.weight[0]).float().detach().numpy())
    theirs = mlx_k3._attn_res_mix(blocks_mx, mx.array(srcs[3].float().numpy()), w_eff,
                                  1e-5, False)
    dist = max_diff(ours, torch.tensor(theirs.tolist()))
    RESULTS["one read vs mlx-lm (float32)"] = dist
    print(f"my read against mlx-lm's _attn_res_mix (float32): max |diff| {dist:.1e}")

# %% [markdown]
# Now the residual stream of a whole model, from scratch, around the library's own sub-layers:
# a tiny K3-shaped model (four KDA layers and one MLA layer, attention residuals in blocks of
# two, a dense first layer, then the latent mixture of experts with SiTU-GLU; the pieces are
# built one by one in the sections below). One simplification: its MLA has no shared key
# channels (`qk_rope_head_dim=0`), where K3 keeps the configuration's 64, unrotated; with no
# RoPE they are only 64 more key dimensions, shared by the heads, and change nothing else:

# %%
def tiny_k3(d=64, block=2, n_kda=4, eps=1e-5, vocab=256):
    """A K3-shaped LMConfig: n_kda KDA layers and one MLA layer, the second to last."""
    kda = KDAConfig(n_head=2, head_dim=d // 2, gate="lower_bound", output_gate="full",
                    chunk_size=16, norm_eps=eps)
    mla = MLAConfig(n_head=2, kv_lora_rank=d // 2, qk_nope_head_dim=d // 2,
                    qk_rope_head_dim=0, v_head_dim=d // 2, q_lora_rank=d // 2,
                    use_rope=False, output_gate=True, norm_eps=eps)
    pattern = [kda] * (n_kda - 1) + [mla] + [kda]
    lmoe = MoEConfig(8, 2, d, n_shared=1, activation="situ", latent_dim=d // 2,
                     latent_norm=True, norm_eps=eps)
    mlps = [SwiGLUConfig(2 * d, activation="situ")] + [lmoe] * (len(pattern) - 1)
    return LMConfig(vocab_size=vocab, block_size=4096, n_embd=d, pattern=tuple(pattern),
                    mlp=tuple(mlps), pos_emb=False, norm="rmsnorm", layer_norm_eps=eps,
                    tie_embeddings=False, attn_res_block_size=block)


def randomise_depth_mixes(model, gain=3.0, seed=0):
    """Random read vectors (the library starts them at zero: a uniform mix)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DepthMix):
                d_ = m.proj.weight.shape[1]
                m.proj.weight.copy_(gain * torch.randn(m.proj.weight.shape, generator=g,
                                                       dtype=m.proj.weight.dtype)
                                    / math.sqrt(d_))


def randomise_small(model, seed=1):
    """Read vectors ~ N(0, 0.02²), the size of every other weight at initialisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DepthMix):
                m.proj.weight.copy_(0.02 * torch.randn(m.proj.weight.shape, generator=g,
                                                       dtype=m.proj.weight.dtype))


def zero_depth_mixes(model):
    """Zero read vectors: every read a uniform mix over its sources."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, DepthMix):
                m.proj.weight.zero_()


def stream_mine(model, idx):
    """The forward pass of an LM with attention residuals, written out."""
    tr = model.transformer

    def read(m, blocks, partial):
        w_norm, w_proj = m.norm.weight, m.proj.weight[0]
        return depth_mix_mine(blocks, partial, w_norm, w_proj, m.norm.eps)

    blocks, partial = [], tr.wte(idx)  # the embedding is the first partial sum
    for ell, layer in enumerate(tr.h):
        h = read(layer.self_attention_res, blocks, partial)
        if ell % model.config.attn_res_block_size == 0:  # a new block starts here
            blocks, partial = blocks + [partial], None
        y, _ = layer.attn(layer.ln_1(h))
        partial = y if partial is None else partial + y
        h = read(layer.mlp_res, blocks, partial)
        partial = partial + layer.mlp(layer.ln_2(h))
    x = read(tr.output_attn_res, blocks, partial)  # the final read
    return model.lm_head(tr.ln_f(x))


torch.manual_seed(0)
model = LM(tiny_k3()).double().eval()
randomise_depth_mixes(model)
idx = torch.randint(0, 256, (2, 24), generator=gen)
with torch.no_grad():
    dist = max_diff(stream_mine(model, idx), model(idx))
RESULTS["residual stream vs LM (float64)"] = dist
cfg = model.config
print(f"{cfg.n_layer} layers, blocks of {cfg.attn_res_block_size}: my stream against "
      f"LM: max |diff| of the logits {dist:.1e}")

# %% [markdown]
# **What it reduces to.** The paper places the block form between two ends counted by the
# number of blocks $N$, not by their size $n$ (§3.2): "N = L recovers Full AttnRes, while N = 1
# reduces to standard residual connections with the embedding isolated as b₀". The first end
# holds by construction: with one layer per block ($n = 1$, so $N$ equals the number of layers
# $L$) every layer starts a block, every earlier layer's output is a source of its own, and the
# read mixes all of them. The weights of the last layer's attention read, at random read
# vectors (sources: the embedding, then each layer's output):

# %%
def read_weights(model, idx, layer):
    """The depth weights of `layer`'s attention read, averaged over the tokens."""
    tr, out = model.transformer, {}
    hook = tr.h[layer].self_attention_res.register_forward_hook(
        lambda m, args, y: out.update(args=(list(args[0]), args[1])))
    with torch.no_grad():
        model(idx)
    hook.remove()
    blocks, partial = out["args"]
    m = tr.h[layer].self_attention_res
    _, p = depth_mix_mine(blocks, partial, m.norm.weight, m.proj.weight[0], m.norm.eps,
                          weights=True)
    return p.mean(dim=(1, 2))


full = LM(tiny_k3(block=1)).double().eval()
randomise_depth_mixes(full, seed=1)
p_last = read_weights(full, idx, full.config.n_layer - 1)
print(f"block size 1, last layer's read over {len(p_last)} sources: "
      + ", ".join(f"{v:.2f}" for v in p_last.tolist()))

# %% [markdown]
# The other end, $N = 1$: one block holds every layer (in the tiny model, a block size of 12
# over its 5 layers). The embedding is $b_0$, everything after it one partial sum $p$, and
# every read after the first layer's is a softmax over two sources, $\pi_0 b_0 + \pi_1 p$ with
# $\pi_0 + \pi_1 = 1$, where the plain residual stream is $b_0 + p$, both weights one. The two
# agree only at equal logits ($\pi_0 = \pi_1 = \tfrac12$, the read is $(b_0 + p)/2$), and then
# only up to that factor ½, which the RMSNorm after every read (`ln_1`, `ln_2`, `ln_f`) removes
# up to its $\epsilon$. The same argument holds at any $N$: inside a block the partial sum is
# the plain sum of the block's outputs, and at equal logits a read over $S$ sources is the plain
# residual sum divided by $S$. So the paper's "reduces to" is loose: at $N = 1$ the model *can*
# compute the plain residual stream (zero read vectors, how `LM` starts them), as at every
# other $N$; with learned read vectors it is a two-source mixture, not the plain sum. Checked
# on the logits, with the same weights loaded into a model without attention residuals (its
# "twin"), for zero read vectors, for small random ones (entries of 0.02, the size of every
# other linear map's at initialisation) and for large random ones:

# %%
def plain_twin(model):
    """The same weights in a model with the plain residual stream."""
    cfg = dataclasses.replace(model.config, attn_res_block_size=0)
    twin = LM(cfg).to(model.transformer.wte.weight.dtype).eval()
    twin.load_state_dict(model.state_dict(), strict=False)  # without the read vectors
    return twin


READS = {"zero": zero_depth_mixes,
         "small": randomise_small,  # N(0, 0.02²) entries
         "random": randomise_depth_mixes}
n_sources_12 = len(read_weights(LM(tiny_k3(block=12)).double().eval(), idx, 3))
print(f"block size 12 over 5 layers (N = 1): a later layer's read has {n_sources_12} "
      "sources")
print("logits, max |diff| from the plain twin, by read vectors:")
print(f"{'':>22s}{'zero':>9s}{'small':>9s}{'random':>9s}{'zero, eps 1e-5':>16s}")
for block in (1, 2, 12):
    row = {}
    for what, set_reads in READS.items():
        for eps in (1e-12, 1e-5) if what == "zero" else (1e-12,):
            torch.manual_seed(0)
            m = LM(tiny_k3(block=block, eps=eps)).double().eval()
            set_reads(m)
            with torch.no_grad():
                row[what, eps] = max_diff(m(idx), plain_twin(m)(idx))
        key = f"vs plain twin, block {block}, {what} read vectors, eps 1e-12"
        RESULTS[key] = row[what, 1e-12]
    N = math.ceil(m.config.n_layer / block)
    print(f"block size {block:2d} (N = {N})   " + "".join(
        f"{row[w, 1e-12]:9.1e}" for w in READS) + f"{row['zero', 1e-5]:16.1e}")
emb_rms = m.transformer.wte.weight.pow(2).mean().sqrt().item()
print(f"the embedding's entries at initialisation: RMS {emb_rms:.3f}")

# %% [markdown]
# With zero read vectors the two models agree as far as the norms' $\epsilon$ allows: to about
# $10^{-9}$ at $\epsilon = 10^{-12}$ (the first column), and visibly not at the released
# $\epsilon = 10^{-5}$ (the last: dividing the sum by $S$ makes $\epsilon$ count $S^2$ times
# more, against a residual stream that is small at initialisation: the embedding's entries
# have the RMS printed last). With any other read vectors they differ at every $N$, $N = 1$ and
# $N = L$ included, by a sizeable fraction of the logits or more: even small read vectors
# make the depth weights unequal, and the mixture of experts' discrete top-$k$ turns small
# changes of its input into different experts. So attention residuals can *start* as the
# plain residual stream, if their read vectors start at zero, and learn away from it; at no
# $N$ are they the plain residual stream once learned. (The course's plan had read the
# paper's sentence as "one layer per block reduces to the plain residual"; the errata page
# records both readings.)
#
# At K3's size: 93 layers in blocks of 12 start a block at 0-based layers 0, 12, …, 84, so the
# final read mixes the embedding, seven completed block sums and the partial sum of the last
# nine layers. Each token's reads keep at most that many $d_{\text{model}}$-vectors alive during the forward
# pass:

# %%
starts = [ell for ell in range(K3.n_layer) if ell % K3.attn_res_block_size == 0]
n_sources = len(starts) + 1  # blocks appended at each start, plus the partial sum
print(f"block starts (0-based): {starts}")
print(f"the final read has {n_sources} sources: the embedding, {len(starts) - 1} block "
      f"sums, the partial sum of {K3.n_layer - starts[-1]} layers")
n_reads = 2 * K3.n_layer + 1
print(f"{n_reads} reads, {2 * K3.n_embd * n_reads:,} parameters in all "
      f"(w_norm and w_proj, {K3.n_embd:,} each)")

# %% [markdown]
# ## SiTU-GLU
#
# Every feed-forward network of K3, the dense first layer, the shared and the routed experts,
# is a gated unit $W_{\text{down}}\,\phi(x W_{\text{gate}}^\top, x W_{\text{up}}^\top)$ as in
# chapter 14, with SiLU-GLU's $\phi(g, u) = g\,\sigma(g)\, u$ replaced by
#
# $$
# \phi_{\text{SiTU}}(g, u) = \underbrace{4 \tanh(g/4)\, \sigma(g)}_{\text{gate}} \cdot
#     \underbrace{25 \tanh(u/25)}_{\text{value}} ,
# $$
#
# read from mlx-lm's `_situ` and the configuration's `activation_situ_beta = 4` and
# `activation_situ_linear_beta = 25`. A soft cap $\beta \tanh(x/\beta)$ is $x$ for
# $|x| \ll \beta$ and tends to $\pm\beta$ beyond it; here it caps the gate's argument at 4
# before the sigmoid weighs it, and the value at 25, so no product can exceed
# $4 \cdot 25 = 100$ in magnitude, however large the pre-activations grow. Why cap: the report
# gives the reason as bounded tails for low-precision training (as its readers quote it): the
# activations that enter the routed experts are computed in MXFP8, whose groups of 32 values
# share one power-of-two scale, so one outlier in a group coarsens the grid of the other 31
# (the MXFP4 section below measures the same effect on weights). A unit that can never exceed
# 100 has no such outliers to begin with.

# %%
def situ_mine(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


g_in = 30 * torch.randn(1000, generator=gen, dtype=torch.float64)
u_in = 200 * torch.randn(1000, generator=gen, dtype=torch.float64)
dist = max_diff(situ_mine(g_in, u_in), moe.situ(g_in, u_in))
RESULTS["SiTU-GLU vs moe.situ (float64)"] = dist
print(f"my SiTU-GLU against moe.situ: max |diff| {dist:.1e}")
if mlx_k3 is not None:
    u_mx, g_mx = mx.array(u_in.float().numpy()), mx.array(g_in.float().numpy())
    theirs = mlx_k3._situ(u_mx, g_mx, 4.0, 25.0)  # mlx-lm's order: value, gate
    dist = max_diff(situ_mine(g_in, u_in), torch.tensor(theirs.tolist()))
    RESULTS["SiTU-GLU vs mlx-lm (float32)"] = dist
    print(f"my SiTU-GLU against mlx-lm's _situ (float32): max |diff| {dist:.1e}")
print(f"largest |SiTU| on these inputs: {situ_mine(g_in, u_in).abs().max():.2f} "
      f"(bound 100); largest |SiLU-GLU|: {(F.silu(g_in) * u_in).abs().max():,.0f}")
small = torch.linspace(-1, 1, 201, dtype=torch.float64)
print(f"for |g|, |u| <= 1: max |SiTU - SiLU-GLU| "
      f"{max_diff(situ_mine(small, small), F.silu(small) * small):.3f}")

# %% mystnb={"figure": {"caption": "SiTU-GLU against SiLU-GLU. Left: the gate factor, SiTU's 4\u00b7tanh(g/4)\u00b7\u03c3(g) against SiLU's g\u00b7\u03c3(g); they agree near zero and SiTU's levels off below 4. Right: the value factor, 25\u00b7tanh(u/25) against the identity; it levels off at \u00b125. The product of the two is bounded by 100 in magnitude.", "name": "fig-k3-situ"}, "image": {"alt": "Two line plots. Left, horizontal axis gate pre-activation from -12 to 12: the SiLU gate rises as a straight line for positive inputs, dipping slightly below zero near -1.3; the SiTU gate follows it up to about 2 and then flattens towards 4, with the same dip. Right, horizontal axis value pre-activation from -80 to 80: the identity is a straight diagonal line; the capped value follows it near zero and flattens towards plus and minus 25."}}
gs = torch.linspace(-12, 12, 400)
us = torch.linspace(-80, 80, 400)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.7, 2.8), layout="constrained")
ax1.plot(gs, F.silu(gs), label="SiLU: g·σ(g)")
ax1.plot(gs, 4 * torch.tanh(gs / 4) * torch.sigmoid(gs), label="SiTU: 4·tanh(g/4)·σ(g)")
ax1.axhline(4, color="k", lw=0.6, ls=":")
ax1.set_xlabel("gate pre-activation g")
ax1.set_title("gate factor", fontsize=10)
ax1.legend(fontsize=8)
ax2.plot(us, us, label="u")
ax2.plot(us, 25 * torch.tanh(us / 25), label="25·tanh(u/25)")
for c in (25, -25):
    ax2.axhline(c, color="k", lw=0.6, ls=":")
ax2.set_xlabel("value pre-activation u")
ax2.set_title("value factor", fontsize=10)
ax2.legend(fontsize=8)
plt.show()

# %% [markdown]
# Near zero the two units agree to first order (the lines above), so a model initialised with
# small weights starts out as a SiLU-GLU model; the caps matter only for the outliers.
#
# ## The latent mixture of experts
#
# Chapter 14's layer runs every routed expert at the model's width $d_{\text{model}}$. K3 projects each token
# down to a latent of $d_L = 3{,}584$ (half of $d_{\text{model}} = 7{,}168$), runs the routed experts there,
# normalises their weighted sum and projects it back up; the router and the two shared experts
# see the token at full width:
#
# $$
# \begin{gathered}
# z_t = x_t W_{\downarrow}^\top, \\
# y_t = \operatorname{RMSNorm}\Big(\sum_{i \in \mathcal{E}_t} w_{t,i}\, \operatorname{FFN}_i(z_t)\Big)\, W_{\uparrow}^\top + \operatorname{FFN}^{(s)}(x_t), \\
# W_{\downarrow} \in \mathbb{R}^{d_L \times d_{\text{model}}},\; W_{\uparrow} \in \mathbb{R}^{d_{\text{model}} \times d_L} ,
# \end{gathered}
# $$
#
# with the routing $(w_{t,i}, \mathcal{E}_t)$ of chapter 14 (sigmoid scores, a selection-only
# bias, one group, renormalised) and SiTU-GLU experts. Note where the norm sits: after the
# weighted sum, not on each expert. From the layer's weights, against `moe.MoE`:

# %%
def ffn(x, gate_up, down):
    """A SiTU-GLU expert: gate_up [2h, d_in], down [d_in, h]."""
    g, u = (x @ gate_up.T).chunk(2, dim=-1)
    return situ_mine(g, u) @ down.T


def latent_moe_mine(x, layer):
    flat = x.reshape(-1, x.shape[-1])  # [N, d]
    w, idx, _ = layer.router(flat)  # chapter 14's routing, at full width
    z = flat @ layer.routed_expert_down_proj.weight.T  # [N, d_L]
    y = torch.zeros_like(z)
    for e in range(layer.router.n_experts):
        token, slot = torch.where(idx == e)
        out = ffn(z[token], layer.experts.gate_up_proj[e], layer.experts.down_proj[e])
        y = y.index_add(0, token, out * w[token, slot, None])
    n = layer.routed_expert_norm
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + n.eps) * n.weight  # RMSNorm
    y = y @ layer.routed_expert_up_proj.weight.T  # back to full width
    s = layer.shared_experts  # full width
    y = y + situ_mine(flat @ s.gate_proj.weight.T, flat @ s.up_proj.weight.T) \
        @ s.down_proj.weight.T
    return y.view(x.shape)


lmoe = moe.MoE(32, 8, 2, 24, n_shared=2, activation="situ", latent_dim=16,
               latent_norm=True).double()
with torch.no_grad():
    lmoe.router.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=gen))
x = torch.randn(2, 20, 32, generator=gen, dtype=torch.float64)
with torch.no_grad():
    dist = max_diff(latent_moe_mine(x, lmoe), lmoe(x))
RESULTS["latent MoE vs moe.MoE (float64)"] = dist
print(f"my latent MoE against moe.MoE: max |diff| {dist:.1e}")

# %% [markdown]
# What the latent buys, at K3's sizes: the routed experts' weights scale with the width they
# run at, so halving it halves the experts' parameters and their work per token, for the price
# of two $d_{\text{model}} \times d_L$ projections per layer (`MoEConfig.num_parameters`, the same layer at
# full width for comparison):

# %%
k3_moe = next(m for m in K3.layer_mlps if isinstance(m, MoEConfig))
wide = dataclasses.replace(k3_moe, latent_dim=0, latent_norm=False)
dK3 = K3.n_embd
for name, m in (("latent (released)", k3_moe), ("full width", wide)):
    print(f"{name:>18s}: {m.num_parameters(dK3) / 1e9:6.2f}B per layer, "
          f"{m.num_active_parameters(dK3) / 1e9:5.3f}B used per token")
print(f"latent projections: {2 * dK3 * k3_moe.latent_dim / 1e6:.1f}M per layer; "
      f"per layer the latent saves "
      f"{1 - k3_moe.num_parameters(dK3) / wide.num_parameters(dK3):.0%} of the weights")

# %% [markdown]
# ## MLA's sigmoid output gate
#
# K3's MLA layers are chapter 13's position-free MLA (no RoPE: the configuration's
# `mla_use_nope`) with one addition, a sigmoid gate on the concatenated heads before the
# output projection, computed from the layer's input (as Qwen3-Next's gated attention does):
# $y_t = \big(o_t \odot \sigma(x_t W_G^\top)\big) W_O^\top$, with
# $W_G \in \mathbb{R}^{H d_v \times d_{\text{model}}}$. From the layer's pieces:

# %%
mla = MultiHeadLatentAttention(32, 4, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=0, v_head_dim=8, q_lora_rank=16,
                               use_rope=False, output_gate=True).double()
x = torch.randn(2, 12, 32, generator=gen, dtype=torch.float64)
with torch.no_grad():
    q_nope, q_rope = mla.queries(x, 0)
    c, k_rope = mla.latents(x, 0)
    o = mla.attend(q_nope, q_rope, c, k_rope)  # [B, H, T, dv], chapter 13
    o = o.transpose(1, 2).reshape(2, 12, -1)  # heads side by side
    y_mine = (o * torch.sigmoid(x @ mla.g_proj.weight.T)) @ mla.o_proj.weight.T
    y_lib, _ = mla(x)
    ungated = o @ mla.o_proj.weight.T
dist = max_diff(y_mine, y_lib)
RESULTS["gated MLA vs MultiHeadLatentAttention (float64)"] = dist
print(f"my gated MLA against MultiHeadLatentAttention(output_gate=True): "
      f"max |diff| {dist:.1e}")
print(f"the gate changes the output by up to {max_diff(ungated, y_lib):.2f}")
print(f"cache per token and layer: {mla.state_numel(1, 1)} values (the gate adds none)")

# %% [markdown]
# The gate is computed from the current token only, so it adds nothing to the cache; it lets
# each head's output be switched off per token, which softmax attention cannot do by itself
# (its weights sum to one over the past).
#
# ## KDA's lower-bound gate and full-rank output gate
#
# Kimi Linear's KDA forgets with $g_t = -e^{A}\operatorname{softplus}(f_t + b)$, per channel:
# any $g_t < 0$ is possible. K3 bounds it (the configuration's `gate_lower_bound = -5`):
#
# $$
# g_t = -5\, \sigma\big(e^{A} (f_t + b)\big) \in (-5, 0), \qquad
# \alpha_t = e^{g_t} \in (e^{-5}, 1),
# $$
#
# with $f_t$ the same low-rank projection of $x_t$ and $A$ (`A_log`), $b$ (`dt_bias`) learned.
# A step can forget at most a factor $e^{5} \approx 148$, so over a sub-chunk of $s = 16$ tokens
# the cumulative decay $\gamma_i = e^{G_i}$ of chapter 11's chunked form stays above $e^{-80}$,
# representable in float32, where an unbounded gate needs care. Its output gate is full rank:
# $\sigma(x_t W_g^\top)$ with $W_g \in \mathbb{R}^{H D_v \times d_{\text{model}}}$ instead of Kimi Linear's
# rank-$D_k$ product of two matrices. From the layer's pieces:

# %%
kda_k3 = KimiDeltaAttention(32, 2, 16, gate="lower_bound", output_gate="full").double()
kda_kl = KimiDeltaAttention(32, 2, 16).double()  # Kimi Linear's: softplus, low rank
with torch.no_grad():
    for layer in (kda_k3, kda_kl):
        layer.A_log.copy_(torch.tensor([0.5, 1.5], dtype=torch.float64))
        layer.f_b_proj.weight.mul_(20)  # large gate inputs, to show the bound
    kda_kl.f_a_proj.weight.copy_(kda_k3.f_a_proj.weight)
    kda_kl.f_b_proj.weight.copy_(kda_k3.f_b_proj.weight)
    kda_kl.dt_bias.copy_(kda_k3.dt_bias)
    x = torch.randn(2, 40, 32, generator=gen, dtype=torch.float64)
    f = (x @ kda_k3.f_a_proj.weight.T @ kda_k3.f_b_proj.weight.T).view(2, 40, 2, 16)
    f = f.transpose(1, 2)  # [B, H, T, Dk]
    A = kda_k3.A_log.exp().view(2, 1, 1)
    g_mine = -5 * torch.sigmoid(A * (f + kda_k3.dt_bias.view(2, 1, 16)))
    g_lib, g_kl = kda_k3.log_decay(x), kda_kl.log_decay(x)
    u_mine = (x @ kda_k3.g_proj.weight.T).view(2, 40, 2, 16)
    dist_u = max_diff(u_mine, kda_k3.output_gate_logits(x))
dist = max_diff(g_mine, g_lib)
RESULTS["lower-bound gate vs KimiDeltaAttention (float64)"] = dist
print(f"my lower-bound gate against KimiDeltaAttention.log_decay: max |diff| "
      f"{dist:.1e}")
print(f"my full-rank output gate logits against output_gate_logits: {dist_u:.1e}")
print(f"g in [{g_lib.min():.2f}, {g_lib.max():.3f}]; Kimi Linear's softplus gate on "
      f"the same inputs reaches {g_kl.min():.1f}")
full_gate = KDAConfig(n_head=96, head_dim=128, gate="lower_bound", output_gate="full")
low_gate = dataclasses.replace(full_gate, output_gate="low_rank")
extra = full_gate.num_parameters(dK3) - low_gate.num_parameters(dK3)
n_kda = K3.kinds.count("kda")
print(f"at K3's size the full-rank output gate has {extra / 1e6:.1f}M more parameters "
      "per KDA layer")
print(f"than a rank-128 one: {n_kda * extra / 1e9:.2f}B over {n_kda} layers")

# %% [markdown]
# ## The whole model: decoding equals the full forward
#
# All of it in one model: `LM(tiny_k3())` from above (four KDA layers and one MLA layer,
# attention residuals in blocks of two, the latent MoE with SiTU-GLU, random read vectors).
# Fed in pieces through its cache, each KDA layer carries its state and each MLA layer its
# latent cache, while the attention residuals need no cache at all (they mix depth, within
# each token). The logits must equal those of the full forward:

# %%
def piecewise(model, idx, cuts):
    cache, outs, t = model.new_cache(), [], 0
    with torch.no_grad():
        for n in cuts:
            outs.append(model(idx[:, t:t + n], cache))
            t += n
    return torch.cat(outs, dim=1), cache


T_dec = idx.shape[1]
cuts_list = ([1] * T_dec, [5, 1, 10, 8])
for dtype in (torch.float64, torch.float32):
    m = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        ref = m(idx)
    dists = [max_diff(piecewise(m, idx, cuts)[0], ref) for cuts in cuts_list]
    RESULTS[f"decode vs prefill ({str(dtype)[6:]})"] = max(dists)
    print(f"{str(dtype)[6:]}: token by token {dists[0]:.1e}, in pieces {cuts_list[1]} "
          f"{dists[1]:.1e} (logits up to {ref.abs().max():.1f})")
_, cache = piecewise(model, idx, cuts_list[1])
print("states:", [type(s).__name__ for s in cache.layers])

# %% [markdown]
# In float64 the two orders of computation agree to round-off; in float32 to a few
# $10^{-6}$ (the lines above; the prefill runs KDA chunkwise and decoding step by step, so the
# sums are ordered differently). The same model is checked against mlx-lm's `kimi_k3` (loaded
# from one checkpoint in the published format, through `tinyk3.models.from_checkpoint`) in
# the course's tests, `tests/test_models_k3.py`, which assert that the logits agree within
# $10^{-4}$ (a bound the tests enforce; mlx-lm is not part of this notebook's setup, so the
# distance itself is not printed here), and with its routed experts packed in MXFP4 as
# released (`tests/test_mxfp4.py`, where mlx-lm runs them as MXFP4).
#
# ## Parameters: the released configuration against the published counts
#
# `count_parameters(presets.kimi_k3())`, against the published 2.8T total and 104B active (the
# model card; the report gives "104.2B activated", as its readers quote it):

# %%
n_k3 = count_parameters(K3)
PUBLISHED = (2.8e12, 104e9)
emb_in = K3.vocab_size * K3.n_embd  # the input embedding: a token reads one row of it
print(f"Kimi K3: total {n_k3.total:,} ({n_k3.total / 1e12:.4f}T, "
      f"{n_k3.total / PUBLISHED[0] - 1:+.2%} against 2.8T)")
print(f"         active {n_k3.active:,} ({n_k3.active / 1e9:.2f}B, "
      f"{n_k3.active / PUBLISHED[1] - 1:+.2%} against 104B)")
print(f"         active without the input embedding ({emb_in / 1e9:.2f}B): "
      f"{(n_k3.active - emb_in) / 1e9:.2f}B")

# %% [markdown]
# Where they sit, component by component, from the per-layer configurations (the rest is the
# norms):

# %%
def breakdown_k3(cfg):
    d = cfg.n_embd
    keys = ("embedding", "output head", "KDA layers", "MLA layers", "routers",
            "routed experts", "latent projections + norm", "shared experts",
            "dense MLP", "depth reads")
    rows = {k: [0, 0] for k in keys}

    def add(key, total, active=None):
        rows[key][0] += total
        rows[key][1] += total if active is None else active

    add("embedding", cfg.vocab_size * d)
    add("output head", 0 if cfg.tie_embeddings else cfg.vocab_size * d)
    for mixer, mlp in zip(cfg.layer_mixers, cfg.layer_mlps):
        kind = "KDA layers" if mixer.kind == "kda" else "MLA layers"
        add(kind, mixer.num_parameters(d))
        if isinstance(mlp, MoEConfig):
            routed = mlp.n_experts * 3 * mlp.expert_hidden * mlp.latent_dim
            add("routers", mlp.n_experts * d)
            add("routed experts", routed, routed * mlp.top_k // mlp.n_experts)
            add("latent projections + norm", 2 * d * mlp.latent_dim + mlp.latent_dim)
            add("shared experts", 3 * d * mlp.shared_width)
        else:
            add("dense MLP", mlp.num_parameters(d))
    add("depth reads", 2 * d * (2 * cfg.n_layer + 1))
    total, active = count_parameters(cfg)
    rows["norms (the rest)"] = [total - sum(r[0] for r in rows.values()),
                                active - sum(r[1] for r in rows.values())]
    return rows


table = breakdown_k3(K3)
print(f"{'':>26s}{'total':>11s}{'share':>8s}{'active':>10s}")
for key, (t_, a_) in table.items():
    print(f"{key:>26s}{t_ / 1e9:10.3f}B{t_ / n_k3.total:8.2%}{a_ / 1e9:9.3f}B")
print(f"norms: {table['norms (the rest)'][0]:,} parameters")
routed_t, routed_a = table["routed experts"]
print(f"routed experts: {routed_t / n_k3.total:.1%} of all weights, "
      f"{routed_a / n_k3.active:.1%} of the active ones")

# %% [markdown]
# The routed experts hold almost all the weights but less than half of what a token uses
# (the last line); attention of both kinds, the embeddings and the shared experts make up most
# of the rest. Against the published figures, the first lines of the section: 2.8T is the
# total rounded to one decimal; and the active count without the input embedding is the
# report's 104.2B, which rounds to the card's 104B. That is the convention chapter 14 met in
# DeepSeek-V3's published 36.6B activated, which leaves the input embedding out (a token reads
# one row of it, not the whole matrix, so it costs no matrix product), where `count_parameters`
# counts every parameter a token can touch. So the one-percent gap is a difference of
# definition, not of architecture: every value of the preset is read from the released
# configuration. The release has no multi-token-prediction layer to leave out: K3 trained one
# (the report, as quoted) and turned it into an EAGLE-3 draft model for speculative decoding,
# but the released config
# has `num_nextn_predict_layers: 0`, so neither the checkpoint nor these counts hold it.
#
# ## The title's number, three ways
#
# "GPT-2 to Kimi K3": how many GPT-2s is one K3? The ratio depends on which two counts are
# divided:

# %%
n_gpt2 = count_parameters(presets.gpt2_small()).total
ratios = {"2.8e12 / 124e6 (both as announced)": 2.8e12 / 124e6,
          f"2.8e12 / {n_gpt2:,} (GPT-2's exact count)": 2.8e12 / n_gpt2,
          f"{n_k3.total:,} / {n_gpt2:,} (both counted)": n_k3.total / n_gpt2}
for what, r in ratios.items():
    print(f"{r:10,.1f}  {what}")
r = list(ratios.values())
print(f"differences: {r[0] - r[1]:.1f} from GPT-2's exact count, {r[1] - r[2]:.1f} "
      "more from K3's")

# %% [markdown]
# The first divides two rounded headline figures; the second replaces "124M" by GPT-2 small's
# exact 124,439,808 parameters (tied head counted once; `presets.gpt2_small()`), which is
# larger than 124M and lowers the ratio; the third also replaces "2.8T" by the count of the
# released configuration, which is below 2.8T and lowers it further (the differences printed
# above). All
# three say the same thing, some twenty-two thousand GPT-2s; the last one is the one a cell can
# reproduce from the two released configurations.
#
# ## Memory at a million tokens
#
# What decoding holds per sequence at K3's context of $2^{20}$ tokens, from the preset's
# layers: each MLA layer caches one latent of $r + d_R$ values per token (chapter 13; K3's MLA
# has no RoPE but keeps the configuration's 64 shared key channels), each KDA layer a fixed
# state per head and its short convolutions' last inputs (chapter 12). The caches in bf16, the
# KDA states in float32 (as in chapter 15, and as mlx-lm keeps them: a state is updated at
# every token of the sequence, and rounding it to bf16 at each update would compound):

# %%
L_CTX = K3.block_size
mla_values = sum(m.state_numel(1, L_CTX) for m in K3.layer_mixers if m.kind == "mla")
kda_values = sum(m.state_numel(1, L_CTX) for m in K3.layer_mixers if m.kind == "kda")
mla_bytes, kda_bytes = 2 * mla_values, 4 * kda_values
print(f"context {L_CTX:,} tokens, one sequence:")
n_mla, n_kda = K3.kinds.count("mla"), K3.kinds.count("kda")
print(f"  MLA caches ({n_mla} layers): {mla_bytes / 1e9:.1f} GB in bf16")
print(f"  KDA states ({n_kda} layers): {kda_bytes / 1e6:.0f} MB in float32")
all_mla = 2 * K3.n_layer * mla_values / n_mla
print(f"an all-MLA K3 would cache {all_mla / 1e9:.1f} GB; the hybrid holds "
      f"{(mla_bytes + kda_bytes) / all_mla:.1%} of that")

# %% [markdown]
# ## Experiment: a tiny K3 against a GPT-2 of the same size
#
# Does the K3 recipe work at a size that trains on a laptop? The tiny K3-shaped model of this
# chapter, trained from scratch on the course's offline corpus (Python's own documentation,
# bytes as tokens: `tinyk3.data`), against a GPT-2 (softmax attention, learned positions,
# GELU MLP, tied head; `gpt2_config`) with about the same total parameter count, under the
# same budget: the same steps, batch, context, learning-rate schedule and seed
# (`tinyk3.train.train_lm`). Two seeds per model, and a small budget: a first look, not a
# ranking.

# %%
corpus = data.encode(data.load_corpus())
train_data, val_data = data.split(corpus)


def build_contender(name, seed):
    torch.manual_seed(seed)
    if name == "tiny K3":
        return LM(tiny_k3(d=64, block=2))
    return LM(gpt2_config(vocab_size=256, block_size=CONTEXT, n_layer=4, n_head=4,
                          n_embd=92))


NAMES = ("tiny K3", "GPT-2")
for name in NAMES:
    n = count_parameters(build_contender(name, 0).config)
    print(f"{name:>8s}: {n.total:,} parameters ({n.active:,} active)")
runs, trained = {}, {}
for seed in SEEDS:
    for name in NAMES:
        trained[name, seed] = build_contender(name, seed)
        r = train_lm(trained[name, seed], train_data, val_data, steps=STEPS,
                     batch_size=BATCH, block_size=CONTEXT, lr=3e-3,
                     warmup=min(20, STEPS // 4), eval_every=max(1, STEPS // 6),
                     seed=seed, progress=False)
        runs[name, seed] = r
        print(f"{name:>8s}, seed {seed}: validation loss {r.val_loss[0]:.3f} -> "
              f"{r.val_loss[-1]:.3f} (nats per byte) in {r.seconds:.0f} s")
gaps = [runs["GPT-2", s].val_loss[-1] - runs["tiny K3", s].val_loss[-1] for s in SEEDS]
secs = {n: sum(runs[n, s].seconds for s in SEEDS) for n in NAMES}
print("final validation loss, GPT-2 minus tiny K3, per seed: "
      + ", ".join(f"{g:+.3f}" for g in gaps))
print(f"time per step, tiny K3 over GPT-2: {secs['tiny K3'] / secs['GPT-2']:.1f}x")
UNIGRAM = data.unigram_entropy(train_data)  # chapter 1's baseline
print(f"byte frequencies alone (no context): {UNIGRAM:.3f} nats per byte")

# %% mystnb={"figure": {"caption": "Validation loss (nats per byte, on fixed windows of held-out text) against training steps, for the tiny K3-shaped model and a GPT-2 of about the same total parameter count, trained with the same steps, batch, context, learning-rate schedule and seeds on the course's offline corpus; one line per seed; the dotted line is the loss of byte frequencies alone (chapter 1's baseline). The printed lines above the figure give the final losses, the gaps and the times.", "name": "fig-k3-vs-gpt2"}, "image": {"alt": "A line plot of validation loss against training steps, one colour per model (tiny K3 and GPT-2), solid and dashed lines for the two seeds. At their first evaluation all lines lie between 3.0 and 3.3 nats per byte, just under a dotted horizontal line marking the byte-frequency baseline near 3.3, and all fall well below it over the steps; the printed lines above the figure say which model ends lower and by how much."}}
fig, ax = plt.subplots(figsize=(6.2, 3.4), layout="constrained")
for (name, seed), r in runs.items():
    ax.plot(r.val_steps, r.val_loss, marker="o", ms=3, ls=("-", "--")[seed % 2],
            color="C0" if name == "tiny K3" else "C1", label=f"{name}, seed {seed}")
ax.axhline(UNIGRAM, color="gray", ls=":", lw=1, label="byte frequencies alone")
ax.set_xlabel("training step")
ax.set_ylabel("validation loss (nats per byte)")
ax.set_title(f"Same budget: {STEPS} steps of {BATCH} x {CONTEXT} bytes", fontsize=10)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# What this can and cannot show. At this size and budget the models learn the byte statistics
# and the common words of the corpus; the printed gaps say which ends lower and by how much, for
# each seed (two seeds are a spread of two, not a confidence interval). The comparison is not a
# contest of equals: the learning rate (3e-3) and schedule are the course's defaults, tuned for
# neither model; the tiny K3 runs each token through two of eight routed experts, so it uses
# fewer parameters per token than it has (printed above), while its chunked KDA layers and
# per-expert loops make each CPU step slower (the time ratio above), so at equal *time* it
# would get fewer steps. What it does show is that the pieces of this chapter, assembled,
# train, under the same loop as every model of the course. Nothing here says how K3 compares
# with a transformer at scale.
#
# ## The released checkpoint: MXFP4 experts
#
# The released weights are not all bf16. The report (§4.1.4, as torchtitan's
# `models/kimi_k3/quant_scope.py` quotes it) says K3 quantises "the MoE expert weights -- which
# dominate the model's parameter memory -- to MXFP4, with activations computed in MXFP8, while
# all non-expert components (attention projections, latent MoE projections, shared experts,
# and MoE routers) remain in higher precision"; the weights are trained to sit on that grid
# (quantisation-aware training) from supervised fine-tuning on. The checkpoint stores them in
# the `compressed-tensors` format `mxfp4-pack-quantized` (its `quantization_config`, whose
# `ignore` list keeps everything else in bf16): per expert and matrix, `weight_packed` and
# `weight_scale`.
#
# **The format.** MXFP4 (OCP Microscaling) cuts each row into groups of 32 consecutive
# values. Each value is a 4-bit E2M1 float: a sign bit (bit 3) and three bits that pick one of
# the magnitudes $0, 0.5, 1, 1.5, 2, 3, 4, 6$. Each group shares one 8-bit E8M0 scale byte
# $x$, standing for a pure power of two, $2^{x - 127}$. So a weight is one of those signed
# magnitudes times $2^{x-127}$, and
# `weight_packed` holds two codes per byte, the low nibble first; `weight_scale` one byte per
# group. One byte, by hand, against `tinyk3.mxfp4`:

# %%
byte, scale_byte = 0xB3, 126
low, high = byte & 0x0F, byte >> 4  # the first value is the low nibble
mags = mxfp4.E2M1_MAGNITUDES


def decode(code, s):
    sign = -1.0 if code & 8 else 1.0
    return sign * mags[code & 7] * 2.0 ** (s - 127)


mine = [decode(low, scale_byte), decode(high, scale_byte)]
row_bytes = torch.tensor([[byte] * 16], dtype=torch.uint8)  # 32 values, one group
lib = mxfp4.dequantize_mxfp4(row_bytes, torch.tensor([[scale_byte]], dtype=torch.uint8))
print(f"byte 0x{byte:02X}: low nibble {low:04b} -> {mine[0]}, high nibble {high:04b} "
      f"-> {mine[1]} (scale 2^({scale_byte} - 127)); tinyk3.mxfp4: "
      f"{lib[0, :2].tolist()}")

# %% [markdown]
# A block of 32 weights through the round trip: the scale is the largest power of two that
# puts the group's largest magnitude in $[4, 8)$ (the OCP rule; anything above 6 is clipped to
# 6), every value divided by it is rounded to the nearest of the 16 codes, and the decoded
# block is compared with the original:

# %%
gen_q = torch.Generator().manual_seed(7)
w_block = 0.02 * torch.randn(1, 32, generator=gen_q, dtype=torch.float64)
packed, scale = mxfp4.quantize_mxfp4(w_block)
back = mxfp4.dequantize_mxfp4(packed, scale, dtype=torch.float64)
top = w_block.abs().max().item()
print(f"scale byte {scale.item()} (2^{scale.item() - 127}); the largest |w| {top:.4f} "
      f"over the scale: {top / 2.0 ** (scale.item() - 127):.2f}")
print("first 6 weights: " + ", ".join(f"{a:+.4f}" for a in w_block[0, :6].tolist()))
print("decoded:         " + ", ".join(f"{a:+.4f}" for a in back[0, :6].tolist()))
print(f"distinct values in the decoded block: {back.unique().numel()} (of 15 possible)")

# %% [markdown]
# **Its error.** Relative RMS error of the round trip, $\|\hat W - W\|_F / \|W\|_F$, against
# bf16's (an 8-bit mantissa), on Gaussian weights and on heavy-tailed ones (Student's $t$ with
# 3 degrees of freedom: a few large weights per group, the shape trained weights tend to
# have), for both scale rules (mlx's `no_clip` rule takes the next power of two instead, so
# nothing is clipped but the grid is twice as coarse where the OCP rule would have clipped):

# %%
def rms_rel_err(w, w_hat):
    """||w_hat − w||_F / ||w||_F: the relative RMS error of a rounding."""
    return ((w_hat - w).norm() / w.norm()).item()


t_dist = torch.distributions.StudentT(3.0)
torch.manual_seed(0)
weights = {"Gaussian": torch.randn(256, 1024, dtype=torch.float64),
           "heavy-tailed (t, 3 d.o.f.)": t_dist.sample((256, 1024)).double()}
print(f"{'':>27s}{'bf16':>9s}{'MXFP4, OCP':>12s}{'MXFP4, no clip':>16s}")
for name, w in weights.items():
    errs = [rms_rel_err(w, w.bfloat16().double())]
    for rule in mxfp4.SCALE_RULES:
        packed_w, scale_w = mxfp4.quantize_mxfp4(w, scale_rule=rule)
        errs.append(rms_rel_err(w, mxfp4.dequantize_mxfp4(packed_w, scale_w,
                                                     dtype=torch.float64)))
    RESULTS[f"MXFP4 relative error, {name}"] = errs[1]
    print(f"{name:>27s}" + "".join(f"{e:>{w_}.4f}" for e, w_ in zip(errs, (9, 12, 16))))

# %% [markdown]
# MXFP4 loses well over an order of magnitude more than bf16 (the table), and the heavy-tailed
# weights lose more than the Gaussian ones: a large weight sets its group's scale and leaves
# the small ones few grid points (in the block above, the two smallest weights decoded to 0). That is what quantisation-aware training is for: a model trained
# with its weights rounded in the forward pass learns weights that sit where the grid is,
# rather than being rounded after the fact. How much round-to-nearest *after* training costs
# the model trained above: its routed experts' weights (the only ones K3 stores in MXFP4)
# rounded to MXFP4, everything else left, on the same held-out windows:

# %%
def quantise_experts(model, scale_rule="ocp"):
    """A copy whose routed experts' weights are rounded to MXFP4 (along the input)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, moe.Experts):
                for p in (mod.gate_up_proj, mod.down_proj):
                    packed_, scale_ = mxfp4.quantize_mxfp4(p, scale_rule=scale_rule)
                    p.copy_(mxfp4.dequantize_mxfp4(packed_, scale_, dtype=p.dtype))
    return m


k3_trained = trained["tiny K3", SEEDS[0]]
loss_before = evaluate_loss(k3_trained, val_data, BATCH, CONTEXT)
loss_after = evaluate_loss(quantise_experts(k3_trained), val_data, BATCH, CONTEXT)
experts = [p for mod in k3_trained.modules() if isinstance(mod, moe.Experts)
           for p in (mod.gate_up_proj, mod.down_proj)]
err = max(rms_rel_err(p.detach().double(), mxfp4.dequantize_mxfp4(
    *mxfp4.quantize_mxfp4(p.detach()), dtype=torch.float64)) for p in experts)
print(f"routed experts: {sum(p.numel() for p in experts):,} of "
      f"{count_parameters(k3_trained.config).total:,} weights; largest relative error "
      f"of a matrix {err:.3f}")
print(f"validation loss {loss_before:.4f} -> {loss_after:.4f} with MXFP4 experts "
      f"({loss_after - loss_before:+.4f} nats per byte)")

# %% [markdown]
# The experts' weights move by about a tenth of their size, and the loss hardly moves (the
# lines above): a token's output sums over many weights, whose rounding errors partly cancel,
# and the experts are only part of each layer. At this size and budget that is one measurement of one
# model, not a general bound; at K3's scale the report relies on quantisation-aware training
# rather than on luck. What the format buys, at K3's sizes (the routed experts in MXFP4 at
# 4 + 8/32 = 4.25 bits a weight, everything else in bf16):

# %%
routed_all = table["routed experts"][0]
bytes_mx = routed_all * 4.25 / 8 + (n_k3.total - routed_all) * 2
print(f"all weights in bf16: {2 * n_k3.total / 1e12:.2f} TB; routed experts in MXFP4: "
      f"{bytes_mx / 1e12:.2f} TB ({bytes_mx / (2 * n_k3.total):.0%} of it)")

# %% [markdown]
# `tinyk3.models.from_checkpoint` reads the packed experts as released: it decodes
# `weight_packed` and `weight_scale` (`tinyk3.mxfp4.dequantize_mxfp4`) into the dtype of the
# checkpoint's other tensors, and slices the released `A_log`, which stores 128 entries for
# the 96 KDA heads, to its first 96 (as mlx-lm's loader does). The course's tests check both
# against mlx and mlx-lm (`tests/test_mxfp4.py`): our decoding equals mlx's MXFP4 bit for bit,
# and a tiny K3 checkpoint packed as released gives mlx-lm's logits within the tests' bound
# of $2 \times 10^{-4}$.
#
# ## A published checkpoint (optional, in Colab)
#
# K3 itself is 2.8T parameters. Two tiny models in its released format are public, with random
# weights (so their continuations are noise): `yujiepan/kimi-k3-bf16-tiny-random` (17 layers
# of width 8, 64 experts, plain bf16 experts) and `yujiepan/kimi-k3-tiny-random` (the same
# architecture with its routed experts packed in MXFP4). In Colab the cell below downloads
# each one's `config.json` and safetensors, loads them through `from_checkpoint`, checks the
# parameter count against `count_parameters` and cached decoding against the full forward, and
# generates a few token ids; anywhere else it says why it is skipped. No reference runs in
# Colab (mlx-lm needs `mlx`, which Colab does not ship), so unlike chapters 12 to 14 there are
# no logits to compare with.

# %%
from tinyk3.models import try_published
from tinyk3.models.demo import CHECKPOINTS

demos = {key: try_published(CHECKPOINTS[key]) for key in ("kimi_k3_bf16", "kimi_k3")}

# %% [markdown]
# ## What K3 changed in training
#
# The architecture is half of what is new in K3; the report's other changes are to how it was
# trained. Those the course builds:
#
# - **Quantile Balancing** (§2.3.3): each router bias set to the quantile of the biases its
#   expert would need, instead of DeepSeek-V3's step of $\pm u$; derived, checked and trained
#   in [chapter 14](14_mixture_of_experts.ipynb) (`tinyk3.layers.moe.quantile_bias`,
#   `moe.Balancer`).
# - **Per-Head Muon** (§2.5): the momentum of the Q, K and V projections orthogonalised one
#   head's block at a time, with Kimi K2's QK-Clip kept; in
#   [chapter 16](16_muon_qk_clip.ipynb) (`tinyk3.optim.per_head_newton_schulz`,
#   `optim.muon_param_groups`).
# - **MXFP4 experts, MXFP8 activations** (§4.1.4), trained in from fine-tuning on; the format
#   above, and SiTU's caps, which keep the activations' tails in range.
#
# And two the course describes without building: one multi-token-prediction layer trained
# beside the model and turned into an EAGLE-3 draft for speculative decoding (not released),
# and a context curriculum of 8K, 64K, 256K and finally 1M tokens.
#
# ## Exercises
#
# ```{exercise} One attention-residual read
# :label: ex-k3-depth-mix
#
# Write `depth_mix(sources, w_norm, w_proj, eps)`: one read of block attention residuals.
# `sources [S, B, T, d]` are the completed block sums (the embedding first) and, last, the
# partial sum; `w_norm [d]` and `w_proj [d]` are the read's RMSNorm weight and projection. Give
# each source the logit $(s / \operatorname{rms}(s)) \cdot (w_{\text{norm}} \odot
# w_{\text{proj}})$ with $\operatorname{rms}(s) = \sqrt{\operatorname{mean}(s^2) + \epsilon}$,
# take the softmax over the sources for each token, and return the weighted sum of the raw
# sources, `[B, T, d]`, in `sources`' dtype.
# ```

# %%
def depth_mix_exercise_mine(sources, w_norm, w_proj, eps):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kimi_k3.depth_mix", depth_mix_exercise_mine)

# %% [markdown]
# ```{solution-start} ex-k3-depth-mix
# :class: dropdown
# ```

# %%
def depth_mix_solution(sources, w_norm, w_proj, eps):
    src = sources.double()
    keys = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)
    p = (keys @ (w_norm * w_proj).double()).softmax(dim=0)  # over depth
    return (p.unsqueeze(-1) * src).sum(0).to(sources.dtype)


ok = checks.run("kimi_k3.depth_mix", depth_mix_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} The routed experts' parameters
# :label: ex-k3-routed-experts
#
# The breakdown above counts from the library's layer configurations. Count from the released
# configuration instead: write `routed_experts(config)`, returning `(total, active)`, the
# parameters of the routed experts alone and the part of them one token uses, from a dict
# with K3's keys (`num_hidden_layers`, `hidden_size`, `first_k_dense_replace`,
# `num_experts`, `num_experts_per_token`, `num_shared_experts`, `moe_intermediate_size`,
# `routed_expert_hidden_size`, `moe_layer_freq`, which is 1 in every case). Decide from the
# chapter which width an expert's matrices have and which layers hold experts. The cases
# include K3 as released, DeepSeek-V3's and Kimi K2's shapes written in K3's keys (their
# experts work at the full width), and a configuration with no dense layer.
# ```

# %%
def routed_experts_mine(config):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("kimi_k3.routed_experts", routed_experts_mine)

# %% [markdown]
# ```{solution-start} ex-k3-routed-experts
# :class: dropdown
# ```
#
# The first `first_k_dense_replace` layers have a dense feed-forward; each of the others
# holds `num_experts` routed experts, three matrices each (gate, up, down) between the
# expert's hidden width and the *latent* width `routed_expert_hidden_size`, not
# `hidden_size`: the projections into and out of the latent belong to the layer, once.

# %%
def routed_experts_solution(config):
    n_moe = config["num_hidden_layers"] - config["first_k_dense_replace"]
    expert = 3 * config["moe_intermediate_size"] * config["routed_expert_hidden_size"]
    return (n_moe * config["num_experts"] * expert,
            n_moe * config["num_experts_per_token"] * expert)


ok = checks.run("kimi_k3.routed_experts", routed_experts_solution)
routed_total, routed_active = routed_experts_solution(presets.KIMI_K3_TEXT_CONFIG)
print(f"K3's routed experts: {routed_total / 1e12:.4f}T of {n_k3.total / 1e12:.4f}T "
      f"({routed_total / n_k3.total:.1%}), {routed_active / 1e9:.2f}B of the "
      f"{n_k3.active / 1e9:.2f}B a token uses ({routed_active / n_k3.active:.1%}); "
      f"the breakdown's row: {table['routed experts'][0] == routed_total}")

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - Kimi K3 (technical report arXiv 2607.24653) is Kimi Linear's hybrid at larger size (93
#   layers: KDA in 69, NoPE MLA in 24, every fourth counted from 1 and the last), with five
#   changes, each built here and checked against `tinyk3` (and mlx-lm where installed).
# - **Block attention residuals**: every sub-layer reads a softmax over depth of the completed
#   block sums and the current partial sum, with RMS-normed keys against one learned vector, no
#   $1/\sqrt{d_{\text{model}}}$, raw values; a block every 12 layers; a final read before the head. With
#   $N = L$ blocks it mixes every earlier output; with $N = 1$ each read is a softmax of the
#   embedding and one partial sum. At no $N$ is it the plain residual sum once the read vectors
#   are learned; with zero read vectors (the initialisation) it computes the plain-residual
#   model up to the norms' $\epsilon$, at any $N$.
# - **SiTU-GLU**, $4\tanh(g/4)\sigma(g) \cdot 25\tanh(u/25)$: SiLU-GLU near zero, bounded by
#   100 in magnitude, so that activations have no tails to break MXFP8's shared scales.
# - **The latent MoE**: routed experts in a 3,584-wide latent, RMSNorm after the weighted sum,
#   then back up; router and shared experts at full width. It halves the routed experts'
#   weights and work for two projections per layer.
# - **Gates**: a sigmoid output gate on MLA, computed from the layer's input (nothing added to
#   the cache); KDA's decay bounded below by $-5$ per step and its output gate full rank.
# - A tiny K3-shaped model decodes through its cache to the full forward's logits. The
#   released configuration counts 2.7795T total ("2.8T") and 105.4B active, 104.2B without
#   the input embedding (the report's figure, DeepSeek-V3's convention), the routed experts
#   holding almost all of it; the title's ratio is about 22,580, 22,501 or 22,336, depending
#   on which counts are divided; at a million tokens the MLA caches dominate the decoding
#   memory, the 69 KDA states are small beside them.
# - The released routed experts are MXFP4: 4-bit E2M1 codes, two per byte, low nibble first,
#   one E8M0 power-of-two scale per 32 weights. `from_checkpoint` decodes them (checked
#   against mlx-lm); rounding a trained model's experts to the format after training moved its
#   loss far less than its weights, and K3 trains on the grid from fine-tuning on.
# - K3's training changes, Quantile Balancing and Per-Head Muon, are built in chapters 14 and
#   16.
# - Trained for the same steps on the course's corpus, the tiny K3 and a GPT-2 of the same
#   total size both learn; the gaps printed in the experiment say which ended lower for each
#   seed, at untuned, shared hyper-parameters and a slower CPU step for the tiny K3.
#
# The distances this run measured:

# %%
for key, value in RESULTS.items():
    print(f"{key:>58s}: {value:.1e}")

# %% [markdown]
# **Next.** [The road compared](18_the_road_compared.ipynb) puts every mechanism of the course
# in one tiny model, trained on one data set.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
