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
# # Mixture of experts
#
# Chapters 10 to 13 changed how tokens talk to each other. This chapter changes the other half of
# every block, the feed-forward network, and with it where a large model keeps its parameters.
# A mixture-of-experts (MoE) layer holds many feed-forward networks, the *experts*, and sends
# each token through only a few of them, chosen by a small linear *router*. The parameters grow
# with the number of experts; the work per token grows only with the number chosen. DeepSeek-V3
# (DeepSeek-AI, arXiv 2412.19437), Kimi K2 and Kimi K3 put almost all of their weights there.
#
# **In this chapter** you build a DeepSeek-V3 MoE layer in small steps: the SwiGLU expert; the
# router with sigmoid scores (DeepSeek-V3, K2) beside softmax ones (Qwen3-Next, Mixtral); top-$k$
# selection on the score plus a bias that only selects, with weights from the unbiased scores,
# renormalised and scaled; group-limited routing; shared experts. Each step is checked against
# `tinyk3.layers.moe`, the whole layer against `transformers`' `DeepseekV3MoE` and
# `Qwen3NextSparseMoeBlock`, and an expert loop against a batched form. Then the
# auxiliary-loss-free balancing that moves the bias, in an experiment on a skewed router; Kimi
# K3's Quantile Balancing, which replaced it, derived and checked; the two rules and an
# auxiliary loss on a router that trains; and the parameter counts of DeepSeek-V3 and Kimi K2,
# total and active, from their configurations.
#
# **Cost.** About a minute on one CPU core, most of it in the two balancing experiments and the
# timings (the last cell prints the time); `SMOKE = True` runs faster.

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

from tinyk3 import checks
from tinyk3.bench import stamp
from tinyk3.layers import moe
from tinyk3.models import count_parameters, presets
from tinyk3.timing import distinguishable, time_fn
from tinyk3.util import import_without_fla, max_diff, moving_mean, randomise_

N_TIME = 512 if SMOKE else 4096  # tokens in the timing of the expert forms
N_BAL = 1024 if SMOKE else 4096  # tokens routed in each step of the balancing run
BAL_STEPS = 60 if SMOKE else 400  # bias updates per speed
SPEEDS = [1e-4, 1e-3, 1e-2, 3e-2, 1e-1]  # bias update speeds u of the experiment
TOY_STEPS = 40 if SMOKE else 300  # training steps of the router-training experiment
TOY_SEEDS = (0,) if SMOKE else (0, 1, 2)
RESULTS = {}  # distances and counts for the closing note

# %% [markdown]
# ## The idea: parameters without compute per token
#
# A dense feed-forward network of hidden width $d_e$ has $3 d_{\text{model}} d_e$ weights
# (SwiGLU's three matrices) and costs each token about twice that in flops. An MoE layer with
# $N_r$ routed experts of that size, of which each token uses $K_r$, holds $N_r$ times the weights
# and costs $K_r$ times the flops: a token pays for the experts it is sent to, the model owns
# all of them. (The symbols are DeepSeek-V3's: $N_r$ routed experts, $K_r$ of them per token,
# $N_s$ shared experts that every token uses.) From the DeepSeek-V3 and Kimi K2 configurations
# (`tinyk3.models.presets`, each citing its source), one MoE layer:

# %%
PRESETS = {"DeepSeek-V3": presets.deepseek_v3(), "Kimi K2": presets.kimi_k2()}
for name, cfg in PRESETS.items():
    d = cfg.n_embd
    m = next(mlp for mlp in cfg.layer_mlps if isinstance(mlp, moe.MoEConfig))
    total, active = m.num_parameters(d), m.num_active_parameters(d)
    print(f"{name}: d_model {d}, {m.n_experts} routed experts of hidden "
          f"{m.expert_hidden}, {m.top_k} per token, {m.n_shared} shared: "
          f"{total / 1e9:.2f}B weights per MoE layer, {active / 1e9:.3f}B used per "
          f"token ({total / active:.0f}x fewer)")

# %% [markdown]
# ## The expert: a SwiGLU network
#
# Every expert, routed or shared, is the gated feed-forward network of Llama, Qwen, DeepSeek and
# Kimi, with no biases:
#
# $$
# \begin{gathered}
# \operatorname{FFN}(x) = \big(\operatorname{SiLU}(x W_{\text{gate}}^\top) \odot x W_{\text{up}}^\top\big)\, W_{\text{down}}^\top, \\
# W_{\text{gate}}, W_{\text{up}} \in \mathbb{R}^{d_e \times d_{\text{model}}},\; W_{\text{down}} \in \mathbb{R}^{d_{\text{model}} \times d_e} .
# \end{gathered}
# $$
#
# `transformers` (and `tinyk3.layers.moe`) store the routed experts stacked, the gate and up
# projections of expert $i$ as one `gate_up_proj[i]` of shape `[2 d_e, d_model]` and the down
# projections as `down_proj[i]`, `[d_model, d_e]`:

# %%
def swiglu(x, gate_up, down):
    """One expert on the rows x [n, d]: gate_up [2 d_e, d], down [d, d_e]."""
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)  # [n, d_e] each
    return (F.silu(gate) * up) @ down.T  # [n, d]


d, d_e = 16, 24
expert = moe.SwiGLU(d, d_e).double()
x = torch.randn(5, d, dtype=torch.float64)
gate_up = torch.cat([expert.gate_proj.weight, expert.up_proj.weight])  # stacked
with torch.no_grad():
    dist = max_diff(swiglu(x, gate_up, expert.down_proj.weight), expert(x))
print(f"my SwiGLU against moe.SwiGLU: max |diff| {dist:.1e}")

# %% [markdown]
# ## The router: scores, a top-$k$, weights
#
# The router is one matrix $W_r \in \mathbb{R}^{N_r \times d_{\text{model}}}$ whose row $e_i$ is
# expert $i$'s "centroid". For token $x_t$ it gives one score per expert:
#
# $$
# \begin{gathered}
# p_{t,i} = \sigma(x_t e_i^\top) \quad \text{(DeepSeek-V3, Kimi K2)}, \\
# p_{t,i} = \operatorname{softmax}_i(x_t e_i^\top) \quad \text{(Qwen3-Next, Mixtral)} .
# \end{gathered}
# $$
#
# The token is sent to the $K_r$ experts $\mathcal{E}_t$ with the largest $p_{t,i} + b_i$, where
# $b_i$ is a per-expert bias (DeepSeek-V3's `e_score_correction_bias`; the next sections say what
# it is for). The weights are the *unbiased* scores of the chosen experts, renormalised to sum to
# one and multiplied by a constant $\rho$ (`routed_scaling_factor`):
#
# $$
# \begin{gathered}
# \mathcal{E}_t = \operatorname{TopK}_i\big(p_{t,i} + b_i,\, K_r\big), \\
# w_{t,i} = \rho\, \frac{p_{t,i}}{\sum_{j \in \mathcal{E}_t} p_{t,j}} \;\; (i \in \mathcal{E}_t), \\
# y_t = \sum_{i \in \mathcal{E}_t} w_{t,i} \operatorname{FFN}_i(x_t) + \sum_{j=1}^{N_s} \operatorname{FFN}^{(s)}_j(x_t) .
# \end{gathered}
# $$
#
# This is equations 12 to 16 of the DeepSeek-V3 report (§2.1.2) in this course's symbols, with
# the factor $\rho$ of the released configuration and code (2.5 for DeepSeek-V3). In code, one
# step at a time:

# %%
def router_scores(x, W_r, scoring="sigmoid"):
    """p [N, E]: one score per token and expert."""
    logits = x @ W_r.T  # x_t e_iᵀ
    return logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)


def route_mine(p, b, k, rho):
    """(weights [N, k], indices [N, k]): choose on p + b, weigh with p."""
    idx = (p + b).topk(k, dim=-1).indices  # selection: biased scores
    w = p.gather(1, idx)  # the UNBIASED scores of the chosen experts
    w = w / w.sum(dim=-1, keepdim=True)  # renormalised over the chosen
    return rho * w, idx


gen = torch.Generator().manual_seed(0)
N, d, E, k, rho = 64, 32, 16, 4, 2.5
x = torch.randn(N, d, generator=gen)
W_r = torch.randn(E, d, generator=gen) / math.sqrt(d)
b = 0.05 * torch.randn(E, generator=gen)
p = router_scores(x, W_r)
w_mine, idx_mine = route_mine(p, b, k, rho)
w_lib, idx_lib = moe.route(p, top_k=k, bias=b, routed_scaling_factor=rho)
def experts_differ(a, b):
    """Tokens whose chosen experts differ between two routings (as sets)."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1).sum().item()


n_differ = experts_differ(idx_mine, idx_lib)
print(f"my router against moe.route: experts differ for {n_differ} of {N} tokens, "
      f"max |weight diff| {max_diff(w_mine, w_lib):.1e}")
print(f"each token's weights sum to rho = {rho}: "
      f"max |sum - rho| {max_diff(w_mine.sum(-1), torch.full((N,), rho)):.1e}")
router = moe.Router(d, E, k, routed_scaling_factor=rho)  # the module: W_r and the bias
with torch.no_grad():
    router.weight.copy_(W_r)
    router.e_score_correction_bias.copy_(b)
    w_mod, idx_mod, p_mod = router(x)
print(f"my scores and router against moe.Router: scores {max_diff(p, p_mod):.1e}, "
      f"experts differ for {experts_differ(idx_mine, idx_mod)} of {N} tokens, weights "
      f"{max_diff(w_mine, w_mod):.1e}")

# %% [markdown]
# **Sigmoid or softmax.** A softmax score depends on every expert's logit; a sigmoid score only
# on its own. With softmax, renormalising the top $K_r$ gives exactly the softmax of the chosen
# logits (the other experts' terms cancel), which is how Mixtral writes it. With sigmoid, raising
# one expert's logit leaves every other score where it was, and with hundreds of experts the
# scores do not shrink as $1/N_r$:

# %%
logits = x @ W_r.T
p_soft = logits.softmax(-1)
w_soft, idx_soft = moe.route(p_soft, top_k=k)  # Qwen3-Next: no bias, rho = 1
w_mix = logits.gather(1, idx_soft).softmax(-1)  # Mixtral: softmax of the chosen logits
print(f"softmax, renormalised top-k vs softmax of the top-k logits: "
      f"max |diff| {max_diff(w_soft, w_mix):.1e}")
bumped = logits.clone()
bumped[:, 0] += 3.0  # one expert's logit up
for name, fn in (("sigmoid", torch.sigmoid), ("softmax", lambda z: z.softmax(-1))):
    change = max_diff(fn(bumped)[:, 1:], fn(logits)[:, 1:])
    print(f"{name}: raising expert 0's logit moves the other scores by up to "
          f"{change:.3f}")
for E_big in (16, 256):
    z = torch.randn(1000, E_big, generator=gen)
    top_sig, top_soft = z.sigmoid().amax(-1).mean(), z.softmax(-1).amax(-1).mean()
    print(f"E = {E_big:3d}: mean largest score, sigmoid {top_sig:.2f}, "
          f"softmax {top_soft:.3f}")

# %% [markdown]
# After renormalisation both kinds of weights sum to one (then $\rho$): only the ranking and the
# ratios among the chosen experts matter. What the sigmoid buys is independence: an expert's
# score depends on its own logit only, and it does not shrink as experts are added (the lines
# above), so the scores and the bias added to them stay on one scale, $(0, 1)$, for any $N_r$.
#
# ## The bias selects, it never weighs
#
# The bias $b_i$ enters the top-$k$ and nothing else. A cell that raises the bias of the expert
# just outside one token's top-$k$ until it gets in:

# %%
t = 0
ranked = (p[t] + b).argsort(descending=True)
outsider = int(ranked[k])  # the best expert not chosen
b_up = b.clone()
b_up[outsider] += (p[t] + b)[ranked[k - 1]] - (p[t] + b)[outsider] + 1e-3  # just enough
w0, i0 = moe.route(p[t : t + 1], top_k=k, bias=b, routed_scaling_factor=rho)
w1, i1 = moe.route(p[t : t + 1], top_k=k, bias=b_up, routed_scaling_factor=rho)
print(f"chosen before: {sorted(i0[0].tolist())}, after raising b[{outsider}]: "
      f"{sorted(i1[0].tolist())}")
expect = rho * p[t, i1[0]] / p[t, i1[0]].sum()  # unbiased scores, renormalised, scaled
print(f"weights after the flip vs rho * p / sum(p) of the new set: "
      f"max |diff| {max_diff(w1[0], expect):.1e}")
print(f"expert {outsider}'s weight: {w1[0][i1[0] == outsider].item():.3f} "
      f"(its score {p[t, outsider]:.3f}; its bias {b_up[outsider]:+.3f} is not in it)")
p_grad, b_grad = p.clone().requires_grad_(), b.clone().requires_grad_()
w_g, _ = moe.route(p_grad, top_k=k, bias=b_grad, routed_scaling_factor=rho)
loss = (w_g * torch.randn(w_g.shape, generator=gen)).sum()  # any loss of the weights
loss.backward()
print(f"gradient reaching the scores: norm {p_grad.grad.norm():.2f}; "
      f"reaching the bias: {b_grad.grad}")

# %% [markdown]
# The expert that came in takes its own score's share; the bias only opened the door. And no
# gradient reaches $b$: `topk` returns integer indices, so the bias is not trained by the loss
# at all. It is set by a rule outside backpropagation (the balancing section below), which is
# why the library keeps it as a buffer, not a parameter.
#
# ## Group-limited routing
#
# DeepSeek-V3 trains with its 256 routed experts spread over 8 nodes, and caps how many nodes
# each token's experts may live on: at most $M = 4$, "selected according to the sum of the
# highest $K_r / M$ affinity scores of the experts distributed on each node" (§2.1.2,
# node-limited routing; $K_r / M = 2$). The released configuration writes it as `n_group = 8`
# groups of consecutive experts, `topk_group = 4` kept. With $N_g$ groups of $N_r / N_g$ experts
# and $K_g$ kept:
#
# $$
# \begin{gathered}
# \text{group score}_{t,g} = \text{sum of the 2 largest } p_{t,i} + b_i \text{ in group } g, \\
# \mathcal{E}_t = \operatorname{TopK}\big(\{p_{t,i} + b_i : i \text{ in the } K_g \text{ best groups}\}, K_r\big) .
# \end{gathered}
# $$
#
# Kimi K2 has 384 experts in one group ($N_g = K_g = 1$): no limit. In code, the experts of the
# other groups are set to $-\infty$ before the top-$k$ (not to 0: a biased score can be
# negative):

# %%
def route_groups_mine(p, b, k, rho, n_group, topk_group):
    N, E = p.shape
    biased = p + b
    per_group = biased.view(N, n_group, E // n_group)
    group_score = per_group.topk(2, dim=-1).values.sum(-1)  # top-2 sum   [N, n_group]
    kept = group_score.topk(topk_group, dim=-1).indices  # [N, topk_group]
    keep = torch.zeros(N, n_group, dtype=torch.bool).scatter(1, kept, True)
    keep = keep.repeat_interleave(E // n_group, dim=1)  # per expert    [N, E]
    idx = biased.masked_fill(~keep, -math.inf).topk(k, dim=-1).indices
    w = p.gather(1, idx)
    return rho * w / w.sum(dim=-1, keepdim=True), idx


def moe_of(cfg):
    """The MoE configuration of a preset's MoE layers."""
    return next(m for m in cfg.layer_mlps if isinstance(m, moe.MoEConfig))


N = 2000
for name, c in (("DeepSeek-V3", moe_of(PRESETS["DeepSeek-V3"])),
                ("Kimi K2", moe_of(PRESETS["Kimi K2"]))):
    p_big = torch.randn(N, c.n_experts, generator=gen).sigmoid()
    b_big = 0.05 * torch.randn(c.n_experts, generator=gen)
    if c.n_group > 1:
        w_m, i_m = route_groups_mine(p_big, b_big, c.top_k, c.routed_scaling_factor,
                                     c.n_group, c.topk_group)
    else:
        w_m, i_m = route_mine(p_big, b_big, c.top_k, c.routed_scaling_factor)
    w_l, i_l = moe.route(p_big, top_k=c.top_k, bias=b_big, n_group=c.n_group,
                         topk_group=c.topk_group,
                         routed_scaling_factor=c.routed_scaling_factor)
    print(f"{name} ({c.n_experts} experts, n_group {c.n_group}, topk_group "
          f"{c.topk_group}, rho {c.routed_scaling_factor}): same experts "
          f"{torch.equal(i_m, i_l)}, max |weight diff| {max_diff(w_m, w_l):.1e}")
    if c.n_group > 1:
        groups = i_l // (c.n_experts // c.n_group)  # the group of each chosen expert
        n_groups = torch.tensor([len(set(r)) for r in groups.tolist()])
        _, i_free = moe.route(p_big, top_k=c.top_k, bias=b_big)
        changed = (i_free.sort(-1).values != i_l.sort(-1).values).any(-1)
        free_groups = torch.tensor([len(set(r)) for r in
                                    (i_free // (c.n_experts // c.n_group)).tolist()])
        print(f"  groups per token: at most {n_groups.max().item()} with the limit, "
              f"{free_groups.float().mean():.1f} on average without it; the limit "
              f"changes the experts of {changed.float().mean():.0%} of tokens "
              f"(random scores)")

# %% [markdown]
# With random scores a token's top 8 of 256 experts would fall in more than four of the eight
# groups on average (the line above), so the limit changes the choice of most tokens; what it
# costs a trained router depends on how its affinities cluster by group, which random scores
# cannot show. Scoring a group by its top two,
# rather than its single best expert, favours groups that can supply more than one of the
# token's $K_r$ experts.
#
# ## Shared experts, and the whole layer
#
# DeepSeek-V3 and Kimi K2 add one shared expert that every token passes through, unweighted.
# DeepSeekMoE (Dai et al. 2024, arXiv 2401.06066) introduced them together with many small
# routed experts: what every token needs is learned once, in the shared expert, instead of
# again in each routed one, which leaves the routed experts free to specialise ("shared expert
# isolation" and "fine-grained expert segmentation" in that paper).
# Qwen3-Next multiplies its shared expert by a sigmoid gate of the token,
# $\sigma(x_t w_g^\top)$. The layer is then the weighted sum of the chosen experts plus the shared
# ones. Running the routed experts one at a time is the reference: for each expert, gather the
# tokens sent to it, run it once on all of them, and add the weighted results back in place:

# %%
def experts_loop_mine(x, w, idx, gate_up, down):
    y = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(idx == e)  # the (token, slot) pairs of expert e
        if token.numel():
            out = swiglu(x[token], gate_up[e], down[e]) * w[token, slot, None]
            y.index_add_(0, token, out)
    return y


def experts_sorted_mine(x, w, idx, gate_up, down):
    """Sort the N·k (token, expert) pairs by expert: each expert's rows are contiguous,
    one slice per expert (a grouped matrix product does this in one kernel)."""
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // idx.shape[1]  # the token of each sorted pair
    rows = x[token]  # [N·k, d], grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    outs = [swiglu(r, gate_up[e], down[e]) for e, r in enumerate(rows.split(counts))]
    out = torch.cat(outs) * w.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, out)


def experts_inputs(N, d, E, k, d_e, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=g, dtype=dtype)
    gate_up = torch.randn(E, 2 * d_e, d, generator=g, dtype=dtype) / math.sqrt(d)
    down = torch.randn(E, d, d_e, generator=g, dtype=dtype) / math.sqrt(d_e)
    p = torch.randn(N, E, generator=g, dtype=dtype).sigmoid()
    w, idx = moe.route(p, top_k=k, routed_scaling_factor=2.5)
    return x, w, idx, gate_up, down


F32_TOL = 1e-5  # float32, relative to the largest output (sums of d_e products)
for dtype in (torch.float64, torch.float32):
    args = experts_inputs(300, 32, 16, 4, 24, dtype)
    ref = experts_loop_mine(*args)
    scale = ref.abs().max().item()
    forms = {"my sorted form": experts_sorted_mine(*args),
             "moe.experts_loop": moe.experts_loop(*args),
             "moe.experts_batched": moe.experts_batched(*args)}
    errs = {n: max_diff(y, ref) / scale for n, y in forms.items()}
    line = ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
    tol = 1e-12 if dtype == torch.float64 else F32_TOL
    print(f"{str(dtype)[6:]}: against my loop (relative): {line}; all within {tol:g}: "
          f"{max(errs.values()) <= tol}")
    RESULTS[f"expert loop vs batched, {str(dtype)[6:]}"] = max_diff(
        forms["moe.experts_batched"], ref) / scale

# %% [markdown]
# The forms compute the same products and add each token's contributions in the same order (by
# expert), so they agree exactly or up to how the matrix-product kernels block their sums
# (`torch.bmm` against `mm`): within $10^{-12}$ relative in float64 and within the stated float32
# tolerance of $10^{-5}$ (the lines above; a different order of the $K_r$ additions would still
# sit far inside it). `moe.experts_batched` goes one step further than the sorted form: it pads every expert's
# rows to the busiest expert's count and runs all experts in two batched matrix products
# (`torch.bmm` over `[E, capacity, d]`). The padding is wasted work whenever the load is uneven.
# Many MoE systems bound that work instead: each expert gets a fixed number of slots, a
# *capacity factor* times the even share $N K_r / E$, and the tokens that overflow a full expert
# are dropped from it (they pass through the residual only; GShard, Lepikhin et al. 2020, arXiv
# 2006.16668; Switch Transformer, Fedus et al. 2021, arXiv 2101.03961). DeepSeek-V3 drops no
# tokens in training or inference, relying on its balancing (report §2.1.2); padding, as here,
# computes exactly what the loop computes.
# Timed (median of the runs, `tinyk3.timing`), at a few tokens (decoding) and at many
# (prefill, training):

# %%
print(stamp())
N_E, D_T, DE_T, K_T = 64, 256, 128, 8
timings = {}
for n_tok in (64, N_TIME):
    args = experts_inputs(n_tok, D_T, N_E, K_T, DE_T, torch.float32)
    load = moe.expert_load(args[2], N_E)
    pad = 1 - n_tok * K_T / (N_E * load.max().item())
    forms = {"loop": moe.experts_loop, "sorted": experts_sorted_mine,
             "batched": moe.experts_batched}
    row = {n: time_fn(lambda f=f, a=args: f(*a), repeats=7, warmup=1, max_seconds=3)
           for n, f in forms.items()}
    timings[n_tok] = row
    print(f"{n_tok:5d} tokens ({pad:.0%} of the batched rows are padding): "
          + ", ".join(f"{n} {t.ms()} ms" for n, t in row.items()))
    fastest = min(row, key=lambda n: float(row[n]))
    clear = all(distinguishable(row[fastest], row[n]) for n in row if n != fastest)
    print(f"      fastest: {fastest}"
          + ("" if clear else " (quartiles overlap: no clear winner)")
          + f"; loop / batched = {float(row['loop']) / float(row['batched']):.2f}")

# %% [markdown]
# Which form wins depends on the number of tokens and on the machine, so the cell prints the
# ratios rather than this text asserting one. On one CPU thread, at a few tokens the loop pays a
# fixed cost for each of the 64 experts, each of which sees only a handful of tokens, and one
# batched pass can beat it; at many tokens each expert's product is large, the loop costs
# little beyond the products themselves, and the batched form pays for its padding and its
# copies. On a GPU the balance shifts again: a loop launches several kernels per expert, and
# production kernels run grouped matrix products over the sorted rows (the sorted form, without
# padding). Either way the busiest expert sets the pace of a batched pass, and with experts
# spread over devices it sets the pace of the step: that is the cost of an unbalanced load.
#
# ## Check against `transformers`
#
# `transformers`' `DeepseekV3MoE` (the layer of DeepSeek-V3 and Kimi K2) and
# `Qwen3NextSparseMoeBlock` build offline at a tiny random configuration. Every weight is
# randomised (`tinyk3.util.randomise_`, as in the oracle tests), and so is DeepSeek-V3's router bias, which is zero at initialisation (a zero bias
# would leave the bias-selects-only rule untested); group-limited routing is on (4 groups, 2
# kept). The weights load into `moe.MoE` under the same names, except the router (`gate.` in
# `transformers`, `router.` here) and Qwen3-Next's shared expert and its gate (`shared_expert`
# and `shared_expert_gate` there, `shared_experts` and `shared_gate` here). With fla
# installed, `transformers` binds fla's GPU kernels when it imports Qwen3-Next's module, so fla
# is hidden during that import (`tinyk3.util.import_without_fla`):

# %%
def renamed(state, renames):
    out = {}
    for name, tensor in state.items():
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = tensor
    return out


try:
    hf_v3 = import_without_fla("transformers.models.deepseek_v3.modeling_deepseek_v3")
    hf_qn = import_without_fla("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import DeepseekV3Config, Qwen3NextConfig
except ImportError as err:
    hf_v3 = None
    print(f"transformers is not importable ({err}): skipping the check "
          "(pip install transformers to run it)")

# %% [markdown]
# The pieces of this chapter assembled into one layer, reading `transformers`' weights by their
# names:

# %%
def my_moe_layer(x, state, *, k, rho, n_group, topk_group):
    """DeepSeek-V3's MoE layer from its state dict: router, routed, shared experts."""
    flat = x.reshape(-1, x.shape[-1])  # [B·T, d]
    p = router_scores(flat, state["gate.weight"])
    w, idx = route_groups_mine(p, state["gate.e_score_correction_bias"], k, rho,
                               n_group, topk_group)
    y = experts_sorted_mine(flat, w, idx, state["experts.gate_up_proj"],
                            state["experts.down_proj"])
    shared_gate_up = torch.cat([state["shared_experts.gate_proj.weight"],
                                state["shared_experts.up_proj.weight"]])
    y = y + swiglu(flat, shared_gate_up, state["shared_experts.down_proj.weight"])
    return y.view(x.shape)


# %%
if hf_v3 is not None:
    d, E, k, d_e = 32, 16, 4, 8
    x = torch.randn(2, 24, d, generator=gen)
    cfg = DeepseekV3Config(hidden_size=d, n_routed_experts=E, num_experts_per_tok=k,
                           moe_intermediate_size=d_e, n_shared_experts=1, n_group=4,
                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                           experts_implementation="eager")
    theirs = hf_v3.DeepseekV3MoE(cfg).eval()
    randomise_(theirs, seed=2, bias_std=0.1)
    ours = moe.MoE(d, E, k, d_e, n_shared=1, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5)
    ours.load_state_dict(renamed(theirs.state_dict(), {"gate.": "router."}))
    with torch.no_grad():
        y_theirs, y_ours = theirs(x), ours(x)
        _, i_nogroup = moe.route(ours.router.scores(x.reshape(-1, d)), top_k=k,
                                 bias=ours.router.e_score_correction_bias)
        _, i_nobias = moe.route(ours.router.scores(x.reshape(-1, d)), top_k=k,
                                n_group=4, topk_group=2)
    chosen = ours.last_indices.sort(-1).values

    def changed(other):
        return (other.sort(-1).values != chosen).any(-1)

    dist = max_diff(y_ours, y_theirs)
    RESULTS["DeepseekV3MoE (float32)"] = dist
    print(f"DeepseekV3MoE vs moe.MoE: max |diff| {dist:.1e} "
          f"(outputs up to {y_theirs.abs().max():.1f}); the groups change "
          f"{changed(i_nogroup).float().mean():.0%} and the bias "
          f"{changed(i_nobias).float().mean():.0%} of the tokens' experts")
    mine = my_moe_layer(x, theirs.state_dict(), k=k, rho=2.5, n_group=4, topk_group=2)
    RESULTS["my layer vs DeepseekV3MoE (float32)"] = max_diff(mine, y_theirs)
    print(f"my layer from this chapter's pieces vs DeepseekV3MoE: max |diff| "
          f"{max_diff(mine, y_theirs):.1e}")

    cfg = Qwen3NextConfig(hidden_size=d, num_experts=E, num_experts_per_tok=k,
                          moe_intermediate_size=d_e, shared_expert_intermediate_size=12,
                          norm_topk_prob=True, experts_implementation="eager")
    theirs = hf_qn.Qwen3NextSparseMoeBlock(cfg).eval()
    randomise_(theirs, seed=3, bias_std=0.1)
    ours = moe.MoE(d, E, k, d_e, shared_hidden=12, scoring="softmax", shared_gate=True)
    state = renamed(theirs.state_dict(), {"gate.": "router.",
                                          "shared_expert_gate.": "shared_gate.",
                                          "shared_expert.": "shared_experts."})
    missing = ours.load_state_dict(state, strict=False).missing_keys
    with torch.no_grad():
        y_theirs, y_ours = theirs(x), ours(x)
    dist = max_diff(y_ours, y_theirs)
    RESULTS["Qwen3NextSparseMoeBlock (float32)"] = dist
    print(f"Qwen3NextSparseMoeBlock vs moe.MoE: max |diff| {dist:.1e} "
          f"(outputs up to {y_theirs.abs().max():.1f}); left at zero: {missing}")

# %% [markdown]
# All three agree to float32 round-off (or exactly). The one key that does not load is our router bias for
# Qwen3-Next, which routes on its softmax scores alone and stays at zero.
#
# ## Auxiliary-loss-free balancing
#
# Left alone, a router can send most tokens to a few experts, which then learn fastest and draw
# still more tokens ("routing collapse", in the report's words, after Shazeer et al. 2017); with
# experts spread over devices, the busiest one also sets the pace. The usual remedy is an
# auxiliary loss that penalises imbalance, at the price of a gradient that pulls against the main
# loss.
# DeepSeek-V3 (following Wang et al. 2024, arXiv 2408.15664) moves the bias instead. After each
# training step, with $\ell_i$ the number of the step's $N K_r$ token slots that went to expert
# $i$ and $\bar\ell = N K_r / N_r$ their mean,
#
# $$
# b_i \leftarrow b_i + u\, \operatorname{sign}(\bar\ell - \ell_i) :
# $$
#
# an overloaded expert's bias goes down by $u$, an underloaded one's up (§2.1.2 of the report
# states the rule in words and calls $u$, its $\gamma$, the bias update speed). Because the bias
# only selects, balancing changes which experts a token reaches, never how much each one
# counts. The report sets $u = 0.001$ for the first 14.3T training tokens and $0$ for the last
# 500B (§4.2), and keeps a very small sequence-wise balance loss beside it ($\alpha = 0.0001$,
# same section).
#
# **Experiment.** A skewed router: fixed random tokens with one constant input channel (a
# direction every token shares) and random router weights, four of 64 experts with a
# larger weight on that channel. From a zero bias, route the same tokens, count the loads,
# update the bias, repeat; track the busiest and the idlest expert against the mean load:

# %%
E_BAL, K_BAL, D_BAL = 64, 8, 64
g = torch.Generator().manual_seed(3)
x_bal = torch.randn(N_BAL, D_BAL, generator=g)
x_bal[:, 0] = 1.0  # a constant channel
W_bal = torch.randn(E_BAL, D_BAL, generator=g) / math.sqrt(D_BAL)
W_bal[:4, 0] += 1.0  # four favoured experts
p_bal = router_scores(x_bal, W_bal)


def balance(p, u, steps, k):
    """Loads max/mean and min/mean before each of `steps` bias updates at speed u."""
    bias = torch.zeros(p.shape[1])
    hi, lo = [], []
    for _ in range(steps):
        _, idx = moe.route(p, top_k=k, bias=bias)
        load = moe.expert_load(idx, p.shape[1]).float()
        hi.append((load.max() / load.mean()).item())
        lo.append((load.min() / load.mean()).item())
        bias = moe.update_bias(bias, load, u)
    return hi, lo, bias


t0 = time.perf_counter()
runs = {u: balance(p_bal, u, BAL_STEPS, K_BAL) for u in SPEEDS}
fav = p_bal[:, :4].mean() - p_bal[:, 4:].mean()
print(f"the favoured experts' mean score exceeds the others' by {fav:.3f}")
print(f"start: busiest expert {runs[SPEEDS[0]][0][0]:.2f}x the mean load, idlest "
      f"{runs[SPEEDS[0]][1][0]:.2f}x ({time.perf_counter() - t0:.1f} s for "
      f"{len(SPEEDS)} speeds x {BAL_STEPS} steps)")
tail = max(1, BAL_STEPS // 4)
arrival = {}
for u, (hi, lo, bias) in runs.items():
    reach = next((s for s, h in enumerate(hi) if h < 1.2), None)
    arrival[u] = reach
    print(f"u = {u:<6g}: max/mean < 1.2 after "
          + (f"{reach:3d} steps" if reach is not None else "  never   ")
          + f"; last {tail} steps: max/mean {sum(hi[-tail:]) / tail:.3f}, "
          f"min/mean {sum(lo[-tail:]) / tail:.3f}; bias spread "
          f"{(bias.max() - bias.min()).item():.3f}")
if arrival[1e-3] and arrival[1e-2]:
    print(f"steps to within 20%, u = 0.001 over u = 0.01: "
          f"{arrival[1e-3] / arrival[1e-2]:.1f}")

# %% mystnb={"figure": {"caption": "Auxiliary-loss-free balancing of a skewed router (64 experts, 8 per token, the same tokens every step), for five update speeds u: the busiest expert's load (top) and the idlest expert's (bottom) relative to the mean load, the worse of each two consecutive updates (the fastest speeds swing back and forth at every update), against the number of updates (log axis). A small u takes long to reach balance; a larger u gets close sooner and then stays further from it; the largest overshoots at every update.", "name": "fig-moe-balancing"}, "image": {"alt": "Two line plots sharing a logarithmic horizontal axis of updates from 1 to several hundred. Top: busiest expert load over mean load, starting near four for every speed. The fastest speed drops at once but stays far above one; the next two level off after a few and after about ten updates, somewhat above one; the speed 0.001 falls after about a hundred updates and settles closest to one; the slowest is still far above one at the end. Bottom: idlest expert load over mean load, the mirror image, rising towards one for the middle speeds, still rising slowly for the slowest and staying low for the fastest. A legend below the plots names the five speeds."}}
WINDOW = 2  # plot the worse load of each two updates: a period-2 swing shows as a level


def worst(series, pick):
    return [pick(series[max(0, i - WINDOW + 1): i + 1]) for i in range(len(series))]


fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.7, 5.6), sharex=True,
                               layout="constrained")
steps = range(1, BAL_STEPS + 1)
for u, (hi, lo, _) in runs.items():
    ax1.plot(steps, worst(hi, max), label=f"u = {u:g}", lw=1.4)
    ax2.plot(steps, worst(lo, min), lw=1.4)
for ax in (ax1, ax2):
    ax.axhline(1, color="k", lw=0.6, ls=":")
    ax.set_xscale("log")
ax1.set_ylabel("busiest load / mean")
ax2.set_ylabel("idlest load / mean")
ax2.set_xlabel(f"bias updates (the worse of each {WINDOW})")
fig.legend(loc="outside lower center", ncol=len(SPEEDS), fontsize=8)
ax1.set_title("Loss-free balancing of a skewed router, by update speed u", fontsize=10)
plt.show()

# %% [markdown]
# What the speed trades: the bias has to move by a fixed amount (the spread printed above, of
# the order of the gap between favoured and other experts' scores), and it moves by at most $u$
# a step, so the steps it takes grow as $1/u$; once there, every step still moves every bias by
# $u$, and the selections of the tokens near the cut flip back and forth, so the remaining
# imbalance grows with $u$. Here the slowest speed has not arrived after the steps shown. The
# next two bring the busiest expert within 20% of the mean load, the faster of them in a
# fraction of the steps (the ratio printed last, against their factor of ten in $u$), and it
# then stays further from balance; at the two fastest speeds the bias overshoots at every update
# and the load never settles within 20% (the lines above, and the figure). In training the
# tokens change every step and so do the router's weights, which keeps the target moving; the
# numbers above depend on this router's score spread and batch, not only on $u$. For scale, the
# report's batch of 15,360 sequences of up to 4K tokens (§4.2) means that 14.3T tokens are
# roughly this many updates, and a bias at
# $u = 0.001$ could move this far over them:

# %%
steps_v3 = 14.3e12 / (15360 * 4096)  # the report's tokens and its full batch (§4.2)
print(f"about {steps_v3:,.0f} updates at the full batch; at most "
      f"{0.001 * steps_v3:,.0f} in bias, against sigmoid scores in (0, 1)")

# %% [markdown]
# So the slow speed does not stop the bias from going anywhere it needs to; it bounds how fast it
# follows a router that is itself changing, and how much it jitters.

# %% [markdown]
# ## Quantile Balancing (Kimi K3)
#
# The sign rule moves every bias by exactly $u$ a step, whatever the distance to where it
# should be: slow when far, jittery when close. Kimi K3 replaced it (Kimi Team, *Kimi K3: Open
# Frontier Intelligence*, arXiv 2607.24653, §2.3.3, "Quantile Balancing", as torchtitan's
# `models/kimi_k3/quantile_balance.py` quotes and implements it) by a rule that computes from
# the batch itself where each bias should be.
#
# **The math.** Token $t$ ranks the biased scores $p_{t,i} + b_i$ and keeps the top $K_r$. Call
# its *cutoff* $c_t$ the $(K_r{+}1)$-th largest biased score: the best expert it did not choose.
# An expert $i$ that the token chose stays chosen as long as $p_{t,i} + b_i > c_t$, that is as
# long as
#
# $$
# b_i > r_{t,i} := c_t - p_{t,i} ,
# $$
#
# the *required bias* of expert $i$ for token $t$. So, with the other biases where they are, the
# load of expert $i$ as a function of its own bias is $\ell_i(b_i) = \#\{t : r_{t,i} < b_i\}$, a
# staircase rising from 0 to $N$ (the batch's tokens). The balanced load is $N K_r / N_r$, a fraction $K_r / N_r$ of
# the tokens, and the bias that gives it is the $K_r/N_r$ quantile of the expert's $N$ required
# biases. The rule sets every bias there at once, then subtracts the mean over experts (only
# differences of biases change a selection):
#
# $$
# b_i \leftarrow Q_{K_r/N_r}\big(\{r_{t,i}\}_{t=1}^{N}\big)
#   - \frac{1}{N_r} \sum_{j} Q_{K_r/N_r}\big(\{r_{t,j}\}_t\big) .
# $$
#
# Two things keep one update from landing exactly on balance, so the rule is iterated: every
# bias moves at once, which moves the cutoffs; and for a token that did *not* choose $i$, the
# bar $i$ must clear is the $K_r$-th largest biased score of the other experts, which is above
# $c_t$ (unless $i$ was the $(K_r{+}1)$-th itself). The required bias of an underloaded expert is
# therefore underestimated, and one update leaves it somewhat short of its target: measured
# below. Code, from scratch and against `moe.quantile_bias`:

# %%
def required_biases_mine(scores, bias, top_k):
    """r [T, E]: each token's (k+1)-th largest biased score minus each expert's."""
    ranked = (scores + bias).sort(dim=-1, descending=True).values
    cutoff = ranked[:, top_k:top_k + 1]  # 0-based top_k: the (k+1)-th largest
    return cutoff - scores


def quantile_bias_mine(scores, bias, top_k, centred=True):
    r = required_biases_mine(scores, bias, top_k)
    q = torch.quantile(r, top_k / scores.shape[1], dim=0)  # per expert, over tokens
    return q - q.mean() if centred else q


p64 = p_bal.double()
b_now = torch.zeros(E_BAL, dtype=torch.float64)
dist = max_diff(quantile_bias_mine(p64, b_now, K_BAL),
                moe.quantile_bias(p64, b_now, K_BAL))
RESULTS["quantile bias vs moe.quantile_bias (float64)"] = dist
print(f"my Quantile Balancing against moe.quantile_bias: max |diff| {dist:.1e}")
for bins in (100, 1000):
    d_h = max_diff(moe.quantile_bias(p64, b_now, K_BAL, num_bins=bins),
                   moe.quantile_bias(p64, b_now, K_BAL))
    print(f"the {bins}-bin histogram estimate against the exact quantile: "
          f"max |diff| {d_h:.1e}")

# %% [markdown]
# The histogram is how a training run computes it (the report's form, with 1,000 bins): each
# device counts its tokens' required biases into bins over $[\min b - 1, \max b + 1]$ (sigmoid
# scores lie in $(0, 1)$, so every $r_{t,e}$ falls in that range), the counts are summed over all
# devices (an all-reduce of $N_r \times 1000$ integers instead of gathering every token's
# scores), and the quantile is read off the cumulative counts, interpolating linearly inside
# its bin. Its error is of the order of a bin's width (the two lines above).
#
# **What one update does.** On the skewed router of the sign-rule experiment: first each
# expert's bias moved alone to its (uncentred) quantile, the others held at zero, so that its
# load should be the target $N K_r / N_r$; then the whole rule, step by step, against the sign
# rule:

# %%
target = N_BAL * K_BAL / E_BAL
q_alone = quantile_bias_mine(p64, b_now, K_BAL, centred=False)
_, idx0 = moe.route(p64, top_k=K_BAL, bias=b_now)
load0 = moe.expert_load(idx0, E_BAL).double()
alone = []
for e in range(E_BAL):
    b_e = b_now.clone()
    b_e[e] = q_alone[e]
    _, idx = moe.route(p64, top_k=K_BAL, bias=b_e)
    alone.append(int((idx == e).sum()))
alone = torch.tensor(alone, dtype=torch.float64)
over, under = load0 > target, load0 < target
print(f"target load {target:.0f} tokens; one expert moved alone to its quantile gets "
      f"{alone[over].min():.0f} to {alone[over].max():.0f} (the {int(over.sum())} "
      f"overloaded), {alone[under].min():.0f} to {alone[under].max():.0f} (the "
      f"{int(under.sum())} underloaded)")


def quantile_run(p, steps, k):
    bias, hi = torch.zeros(p.shape[1], dtype=p.dtype), []
    for _ in range(steps):
        _, idx = moe.route(p, top_k=k, bias=bias)
        load = moe.expert_load(idx, p.shape[1]).double()
        hi.append((load.max() / load.mean()).item())
        bias = moe.quantile_bias(p, bias, k)
    return hi


hi_q = quantile_run(p64, 8, K_BAL)
print("busiest expert / mean load, before each quantile update: "
      + ", ".join(f"{h:.2f}" for h in hi_q))
reach_q = next((s for s, h in enumerate(hi_q) if h < 1.2), None)
print(f"busiest expert within 20% of the mean after {reach_q} quantile update(s); the "
      f"sign rule took {arrival[1e-2]} updates at u = 0.01 and {arrival[1e-3]} at "
      "u = 0.001")

# %% [markdown]
# An overloaded expert moved alone lands on its target (it is among the chosen of every token
# it counts, where the cutoff is exact); an underloaded one lands below it, as derived above.
# Together, the first update brings the busiest expert from several times the mean load close
# to it, and a few more within a few percent (the lines above), where the sign rule needs a
# number of updates that grows as $1/u$. On a fixed router
# the comparison is unfair to the sign rule: its slowness is what keeps it stable when the
# scores change at every step. The test that matters is training.
#
# **Experiment: balancing a router that trains.** One MoE layer (16 experts, 2 per token,
# width 32) learns a regression task whose inputs come from 16 clusters with Zipf frequencies
# (the first twice as common as the second, and so on), each with its own target map; every
# input carries a constant channel on which two experts' router weights start favoured, so
# left alone the router collapses onto them. Five ways to train it, from three seeds each,
# with AdamW, fresh batches of 1,024 tokens, and the bias updated after every step: no
# balancing; DeepSeek-V3's sign rule at $u = 0.001$ and $0.01$; an auxiliary loss,
# $\alpha \sum_i f_i P_i$ (DeepSeek-V3's balance loss, `moe.balance_loss`: $f_i$ the expert's
# share of the load times $N_r/K_r$, $P_i$ its mean normalised score), at $\alpha = 0.01$ and
# $0.1$; and Quantile Balancing with the report's 1,000-bin histogram. `moe.Balancer` applies
# each rule to any model's MoE layers:

# %%
D_T, E_T, K_T, H_T, N_T = 32, 16, 2, 32, 1024


def toy_task(seed):
    """Batches (x, y) of a skewed regression task: Zipf-frequent clusters."""
    g = torch.Generator().manual_seed(100 + seed)
    centres = 1.5 * torch.randn(E_T, D_T, generator=g)
    freq = 1 / torch.arange(1, E_T + 1, dtype=torch.float32)
    maps = torch.randn(E_T, D_T, D_T, generator=g) / math.sqrt(D_T)

    def batch(gen, n=N_T):
        c = torch.multinomial(freq / freq.sum(), n, replacement=True, generator=gen)
        x = centres[c] + 0.5 * torch.randn(n, D_T, generator=gen)
        x[:, 0] = 1.0  # the constant channel
        return x, torch.tanh(torch.einsum("nd,nod->no", x, maps[c]))

    return batch


def train_router(rule, seed, steps, **kw):
    """Busiest and idlest load over the mean, per step; then the held-out loss."""
    torch.manual_seed(seed)
    layer = moe.MoE(D_T, E_T, K_T, H_T)
    with torch.no_grad():
        layer.router.weight[:2, 0] += 1.0  # two favoured experts
    balancer = None if rule == "none" else moe.Balancer(layer, rule, **kw)
    opt = torch.optim.AdamW(layer.parameters(), lr=3e-3)
    batch, g = toy_task(seed), torch.Generator().manual_seed(seed)
    hi, lo = [], []
    for _ in range(steps):
        x, y = batch(g)
        loss = F.mse_loss(layer(x), y)
        if balancer is not None:
            loss = loss + balancer.loss()  # zero unless the rule is "aux"
        opt.zero_grad()
        loss.backward()
        opt.step()
        load = moe.expert_load(layer.last_indices, E_T).double()
        hi.append((load.max() / load.mean()).item())
        lo.append((load.min() / load.mean()).item())
        if balancer is not None:
            balancer.step()  # the bias update (sign or quantile rule)
    layer.eval()
    with torch.no_grad():
        x, y = batch(torch.Generator().manual_seed(999), 8192)
        val = F.mse_loss(layer(x), y).item()
    return dict(hi=hi, lo=lo, val=val)


RULES = {"none": ("none", {}),
         "sign, u = 0.001": ("sign", {"speed": 1e-3}),
         "sign, u = 0.01": ("sign", {"speed": 1e-2}),
         "aux loss, α = 0.01": ("aux", {"alpha": 0.01}),
         "aux loss, α = 0.1": ("aux", {"alpha": 0.1}),
         "quantile (1,000 bins)": ("quantile", {"num_bins": 1000})}
t0 = time.perf_counter()
toy = {name: [train_router(rule, s, TOY_STEPS, **kw) for s in TOY_SEEDS]
       for name, (rule, kw) in RULES.items()}
print(f"{len(RULES)} rules x {len(TOY_SEEDS)} seeds x {TOY_STEPS} steps in "
      f"{time.perf_counter() - t0:.0f} s")
tail = max(1, TOY_STEPS // 6)


def first_below(series, level=1.5, window=10):
    """The first step at which the mean of the last `window` steps is below `level`."""
    means = [sum(series[max(0, i - window + 1): i + 1]) / min(window, i + 1)
             for i in range(len(series))]
    return next((i + 1 for i, m in enumerate(means) if m < level), None)


last_hdr = f"last {tail} steps: max/mean"
print(f"{'':>22s}{'steps to max/mean < 1.5':>25s}{last_hdr:>24s}{'min/mean':>10s}"
      f"{'held-out MSE':>14s}")
for name, runs_ in toy.items():
    reach = [first_below(r["hi"]) for r in runs_]
    reach_s = ", ".join("never" if s is None else str(s) for s in reach)
    hi_end = sum(sum(r["hi"][-tail:]) / tail for r in runs_) / len(runs_)
    lo_end = sum(sum(r["lo"][-tail:]) / tail for r in runs_) / len(runs_)
    vals = [r["val"] for r in runs_]
    print(f"{name:>22s}{reach_s:>25s}{hi_end:24.2f}{lo_end:10.2f}"
          f"{sum(vals) / len(vals):10.4f} ± {(max(vals) - min(vals)) / 2:.4f}")

# %% mystnb={"figure": {"caption": "Balancing a router that trains: one MoE layer (16 experts, 2 per token) on a skewed regression task, trained with no balancing, DeepSeek-V3's sign rule at two speeds, an auxiliary loss at two strengths and Kimi K3's Quantile Balancing (1,000-bin histogram). Left: the busiest expert's load over the mean load, averaged over 10 steps and over the seeds (log axis). Right: the held-out loss at the end against the final busiest-expert ratio, one point per seed.", "name": "fig-moe-quantile-training"}, "image": {"alt": "Left, lines of busiest load over mean load against training steps, one per rule. Without balancing the line rises to several times the mean and stays there; the slow sign rule and the weak auxiliary loss come down part of the way; the fast sign rule, the strong auxiliary loss and the quantile rule come down to within about one and a half times the mean, the quantile rule lowest and soonest. Right, a scatter of held-out loss against final busiest ratio, one marker per seed and rule: the points of the rules that balance best sit at the left, at losses between those of the unbalanced runs and above the slow sign rule's; the strong auxiliary loss sits highest."}}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6.7, 3.3), layout="constrained")
for c, (name, runs_) in enumerate(toy.items()):
    mean_hi = [sum(v) / len(v) for v in zip(*(r["hi"] for r in runs_))]
    ax1.plot(range(1, TOY_STEPS + 1), moving_mean(mean_hi), color=f"C{c}", lw=1.4,
             label=name)
    ax2.scatter([sum(r["hi"][-tail:]) / tail for r in runs_], [r["val"] for r in runs_],
                color=f"C{c}", s=18)
ax1.axhline(1, color="k", lw=0.6, ls=":")
ax1.set(yscale="log", xlabel="training step", ylabel="busiest load / mean")
ax1.set_yticks([1, 1.5, 2, 3, 5], ["1", "1.5", "2", "3", "5"])
ax1.minorticks_off()
ax2.set(xlabel="final busiest load / mean", ylabel="held-out MSE")
fig.legend(loc="outside lower center", ncol=3, fontsize=8)
ax1.set_title("Load while training", fontsize=10)
ax2.set_title("What balance costs", fontsize=10)
plt.show()

# %% [markdown]
# What this shows, and what it cannot. Left alone, the router collapses: a few experts take
# several times the mean load and others none (the first row). Every rule counters it to some
# degree; at these settings the quantile rule gets closest to balance and soonest, with no
# parameter to tune, where the sign rule's speed and the auxiliary loss's strength each trade
# balance against something else (the table). Balance and the main loss pull apart on this
# task, whose clusters are themselves skewed: the lowest held-out loss is the slow sign rule's,
# which balances only part of the way; collapse ends higher (idle experts learn nothing); the
# rules closest to balance sit between; the strong auxiliary loss, whose gradient pulls on
# the router against the task, ends highest (the right panel). Why a real MoE balances anyway:
# with experts on different devices the busiest one sets the pace of every step, and with
# capacity limits an overloaded expert drops tokens; neither exists in a one-layer toy, so its
# loss shows the price of balance, not its benefit. Three seeds and a few hundred steps are
# a spread (the ± is half the range over seeds), not a confidence interval; the order of the
# rules, not the digits, is the finding.

# %% [markdown]
# ## Parameters, total and active
#
# `tinyk3.models.count_parameters(config)` returns `(total, active)` by formula: `total` equals
# the parameter count of the model built from the configuration, exactly; `active` leaves out
# the routed experts a token is not sent to. On the two presets, against the published figures
# (DeepSeek-V3: 671B total, 37B activated per token, the report's abstract and §4.2; Kimi K2:
# 1T total, 32B activated, its model card):

# %%
PUBLISHED = {"DeepSeek-V3": (671e9, 37e9), "Kimi K2": (1e12, 32e9)}
counts = {}
for name, cfg in PRESETS.items():
    total, active = count_parameters(cfg)
    counts[name] = (total, active)
    pub_t, pub_a = PUBLISHED[name]
    print(f"{name}: total {total / 1e9:7.1f}B ({total / pub_t - 1:+.1%} against "
          f"{pub_t / 1e9:.0f}B), active {active / 1e9:5.2f}B "
          f"({active / pub_a - 1:+.1%} against {pub_a / 1e9:.0f}B)")
    RESULTS[f"{name} total / active"] = (total, active)

# %% [markdown]
# Where they come from, component by component, from the configurations' own formulas
# (`MLAConfig.num_parameters` for the attention, `MoEConfig.num_parameters` and
# `num_active_parameters` for the MoE layers, `SwiGLUConfig` for the dense ones); whatever the
# components leave is the norms:

# %%
def breakdown(cfg):
    """(total, active) per component, from the per-layer configurations."""
    d = cfg.n_embd
    V = cfg.vocab_size * d
    rows = {"embedding (input)": (V, V),
            "output head": (0, 0) if cfg.tie_embeddings else (V, V),
            "attention (MLA)": [0, 0], "routers": [0, 0], "routed experts": [0, 0],
            "shared experts": [0, 0], "dense MLPs": [0, 0]}
    for mixer, mlp in zip(cfg.layer_mixers, cfg.layer_mlps):
        n = mixer.num_parameters(d)
        rows["attention (MLA)"][0] += n
        rows["attention (MLA)"][1] += n
        if isinstance(mlp, moe.MoEConfig):
            router = mlp.n_experts * d
            shared = 3 * d * mlp.shared_width
            routed = mlp.num_parameters(d) - router - shared
            used = mlp.num_active_parameters(d) - router - shared
            for key, (t_, a_) in (("routers", (router, router)),
                                  ("shared experts", (shared, shared)),
                                  ("routed experts", (routed, used))):
                rows[key][0] += t_
                rows[key][1] += a_
        else:
            rows["dense MLPs"][0] += mlp.num_parameters(d)
            rows["dense MLPs"][1] += mlp.num_parameters(d)
    total, active = count_parameters(cfg)
    rest = (total - sum(r[0] for r in rows.values()),
            active - sum(r[1] for r in rows.values()))
    rows["norms (the rest)"] = rest
    return rows


tables = {name: breakdown(cfg) for name, cfg in PRESETS.items()}
print(f"{'':>19s}" + "".join(f"{n + ' total':>18s}{'active':>9s}" for n in tables))
for key in tables["DeepSeek-V3"]:
    print(f"{key:>19s}" + "".join(f"{t[key][0] / 1e9:17.2f}B{t[key][1] / 1e9:8.2f}B"
                                  for t in tables.values()))
print("norms: " + ", ".join(f"{n} {t['norms (the rest)'][0]:,} parameters"
                            for n, t in tables.items()))
for name, t in tables.items():
    routed_share = t["routed experts"][0] / counts[name][0]
    print(f"{name}: routed experts are {routed_share:.1%} of all weights")

# %% [markdown]
# The totals land within a few percent of the published figures (the signed differences
# above). What separates them:
#
# - **Rounding.** "1T" and "32B" are rounded headline figures; the count from Kimi K2's
#   configuration is a little above them (the lines above).
# - **The multi-token-prediction module is not built.** DeepSeek-V3's checkpoint also holds one
#   MTP module, an extra transformer block trained to predict a second token ahead and discarded
#   for plain decoding (§2.2 of the report). DeepSeek's `README_WEIGHTS.md` (Hugging Face
#   repository `deepseek-ai/DeepSeek-V3-Base`) counts it separately, 11.5B unique parameters
#   beside the main model's 671B. Like `transformers`, the course builds the main model only, so
#   the count is to be set against 671B, not against the checkpoint's size.
# - **Embeddings and what "active" means.** A token reads one row of the input embedding, not
#   the whole matrix; `count_parameters` counts the matrix as active (every parameter a token
#   can touch, by the contract of `tinyk3.models`). The same `README_WEIGHTS.md` gives 36.6B
#   activated "including 0.9B for the output Head"; the copy in the GitHub repository
#   `deepseek-ai/DeepSeek-V3` still reads 36.7B, "including 0.9B for Embedding and 0.9B for the
#   output Head" (DeepSeek revised the Hugging Face copy). Leaving the input embedding out of our active count gives:

# %%
for name, (_, active) in counts.items():
    emb = tables[name]["embedding (input)"][1]
    print(f"{name}: active without the input embedding {(active - emb) / 1e9:.2f}B "
          f"(the embedding is {emb / 1e9:.2f}B)")

# %% [markdown]
# ## A published checkpoint (optional, in Colab)
#
# Everything above ran offline on models built at random. In Colab the cell below downloads a
# checkpoint in DeepSeek-V3's published format, `transformers`' own tiny test model of the
# architecture (random weights: the text it generates is noise, and the trained models need
# hundreds of GB), loads it into `tinyk3` with `tinyk3.models.from_hf`, prints the largest
# logit difference against `transformers` and generates through the cache. Anywhere else it
# says why it is skipped.

# %%
from tinyk3.models import try_checkpoint
from tinyk3.models.demo import CHECKPOINTS

demo = try_checkpoint(CHECKPOINTS["deepseek_v3"])

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
# ```{exercise} The router
# :label: ex-moe-route
#
# Write `route_gates(scores, bias, top_k, n_group, topk_group, scale)`: DeepSeek-V3's routing
# of `scores [N, E]` (sigmoid scores) with the bias `bias [E]`, returned as dense gates
# `[N, E]`: the weight $w_{t,i}$ of each chosen expert, 0 for the others. Choose on
# `scores + bias`; with `n_group > 1` keep only the `topk_group` groups (of `E // n_group`
# consecutive experts) whose two largest biased scores sum highest; take the `top_k` largest
# biased scores among the kept experts; weigh them with the unbiased scores, renormalised over
# the chosen, times `scale`. Keep the dtype. The checker's cases include one group and several,
# large biases and biases that are all negative.
# ```

# %%
def route_gates_mine(scores, bias, top_k, n_group, topk_group, scale):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("moe.route", route_gates_mine)

# %% [markdown]
# ```{solution-start} ex-moe-route
# :class: dropdown
# ```

# %%
def route_gates_solution(scores, bias, top_k, n_group, topk_group, scale):
    N, E = scores.shape
    biased = scores + bias  # selection only
    if n_group > 1:
        per_group = biased.view(N, n_group, E // n_group)
        group_score = per_group.topk(2, dim=-1).values.sum(-1)  # top-2 sum
        kept = group_score.topk(topk_group, dim=-1).indices
        keep = torch.zeros(N, n_group, dtype=torch.bool).scatter(1, kept, True)
        keep = keep.repeat_interleave(E // n_group, dim=1)
        biased = biased.masked_fill(~keep, -math.inf)  # -inf, never 0
    idx = biased.topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)  # unbiased
    w = w / w.sum(dim=-1, keepdim=True) * scale
    return torch.zeros_like(scores).scatter(1, idx, w)


ok = checks.run("moe.route", route_gates_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} One bias update
# :label: ex-moe-update-bias
#
# Write `update_bias(bias, indices, speed)`: one step of auxiliary-loss-free balancing. `indices`
# `[N, k]` are the experts the step's tokens were sent to; count each expert's load over all
# `N·k` slots, and return $b_i + u \operatorname{sign}(\bar\ell - \ell_i)$ in `bias`'s dtype. An
# expert exactly at the mean load keeps its bias.
# ```

# %%
def update_bias_mine(bias, indices, speed):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("moe.update_bias", update_bias_mine)

# %% [markdown]
# ```{solution-start} ex-moe-update-bias
# :class: dropdown
# ```

# %%
def update_bias_solution(bias, indices, speed):
    load = torch.bincount(indices.flatten(), minlength=bias.shape[0]).double()
    return (bias + speed * torch.sign(load.mean() - load)).to(bias.dtype)


ok = checks.run("moe.update_bias", update_bias_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} Quantile Balancing
# :label: ex-moe-quantile-bias
#
# Write `quantile_bias(scores, bias, top_k)`: Kimi K3's bias update, the exact form. `scores`
# `[T, E]` are sigmoid scores before the bias, `bias [E]` the current one. Each token's cutoff
# is its $(k{+}1)$-th largest biased score; expert $e$'s required bias for token $t$ is the
# cutoff minus `scores[t, e]`; the new bias of expert $e$ is the $k/E$ quantile of its $T$
# required biases (`torch.quantile`, linear interpolation), minus the mean over experts.
# Return it in `scores`' dtype. The cases include $k = E - 1$, a single token and float64.
# ```

# %%
def quantile_bias_exercise_mine(scores, bias, top_k):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("moe.quantile_bias", quantile_bias_exercise_mine)

# %% [markdown]
# ```{solution-start} ex-moe-quantile-bias
# :class: dropdown
# ```

# %%
def quantile_bias_solution(scores, bias, top_k):
    s = scores.double()
    ranked = (s + bias.double()).sort(dim=-1, descending=True).values
    cutoff = ranked[:, top_k:top_k + 1]  # the (k+1)-th largest
    q = torch.quantile(cutoff - s, top_k / s.shape[1], dim=0)  # per expert, over tokens
    return (q - q.mean()).to(scores.dtype)


ok = checks.run("moe.quantile_bias", quantile_bias_solution)

# %% [markdown]
# ```{solution-end}
# ```
#
# ```{exercise} Parameters of one MoE layer
# :label: ex-moe-layer-parameters
#
# Write `layer_parameters(d, n_experts, top_k, hidden, n_shared)`: the `(total, active)`
# parameter counts of one MoE layer of width `d` with `n_experts` routed SwiGLU experts of
# hidden width `hidden`, `top_k` of them per token, and `n_shared` shared experts of the same
# width (one SwiGLU of hidden `n_shared · hidden`), plus the router. The router's bias is a
# buffer. The cases include DeepSeek-V3's and Kimi K2's layers.
# ```

# %%
def layer_parameters_mine(d, n_experts, top_k, hidden, n_shared):
    # your code here
    raise NotImplementedError


# %% tags=["nbval-check-output"]
ok = checks.run("moe.layer_parameters", layer_parameters_mine)

# %% [markdown]
# ```{solution-start} ex-moe-layer-parameters
# :class: dropdown
# ```

# %%
def layer_parameters_solution(d, n_experts, top_k, hidden, n_shared):
    expert = 3 * d * hidden  # gate, up, down
    router = n_experts * d  # the weight; the bias is a buffer
    shared = n_shared * expert
    return router + n_experts * expert + shared, router + top_k * expert + shared


ok = checks.run("moe.layer_parameters", layer_parameters_solution)

# %% [markdown]
# ```{solution-end}
# ```

# %% [markdown]
# ## Summary
#
# - An MoE layer holds $N_r$ routed experts and sends each token through $K_r$ of them, plus
#   $N_s$ shared ones: parameters scale with $N_r$, compute per token with $K_r + N_s$. Every
#   expert is a SwiGLU network; `transformers` stacks the routed ones as `gate_up_proj` and
#   `down_proj`.
# - The router scores each expert, with a sigmoid (DeepSeek-V3, Kimi K2) or a softmax
#   (Qwen3-Next, Mixtral). DeepSeek-V3 selects the top $K_r$ of $p_{t,i} + b_i$ and weighs with
#   the unbiased scores, renormalised and multiplied by $\rho$, so each token's weights sum to
#   $\rho$; the bias changes which experts run and never their weights, and no gradient reaches
#   it. Group-limited routing keeps the $K_g$ groups whose two best biased scores sum highest
#   (DeepSeek-V3: 8 groups, 4 kept); Kimi K2 routes over one group.
# - An expert loop, a sorted form and the library's padded batched form agree to round-off in
#   both precisions; which is faster depends on the machine and the number of tokens (timed
#   above), and the padding of the batched form is the price of an uneven load.
# - `moe.MoE` equals `transformers`' `DeepseekV3MoE` (random router bias, group-limited routing
#   on) and `Qwen3NextSparseMoeBlock` (softmax router, gated shared expert) to float32
#   round-off.
# - Auxiliary-loss-free balancing moves each bias by $\pm u$ a step against its expert's load.
#   The speed trades how fast the load balances against how much it oscillates once balanced;
#   DeepSeek-V3 used $u = 0.001$, then 0 for the last 500B tokens.
# - Kimi K3's Quantile Balancing sets each bias to the $K_r/N_r$ quantile of its required
#   biases (each token's $(K_r{+}1)$-th biased score minus the expert's score), mean-centred:
#   the bias at which the expert's load on the batch would be balanced if the others stayed
#   put. In training it is read off a 1,000-bin histogram pooled across devices. On a fixed
#   router it balances in a few updates; on a router that trains it balanced the toy task best
#   of the rules tried, with nothing to tune, and, like every rule, at some cost to a task
#   whose own structure is skewed.
# - `count_parameters` gives DeepSeek-V3 and Kimi K2 within a few percent of 671B/37B and
#   1T/32B; rounding, the MTP module (not built) and whether the input embedding counts as
#   active explain the differences, and the routed experts hold almost all the weights.
#
# The distances and counts this run measured:

# %%
for key, value in RESULTS.items():
    if isinstance(value, tuple):
        pub = PUBLISHED[key.split(" total")[0]]
        print(f"{key:>36s}: {value[0] / 1e9:.1f}B / {value[1] / 1e9:.2f}B "
              f"(published {pub[0] / 1e9:.0f}B / {pub[1] / 1e9:.0f}B)")
    else:
        print(f"{key:>36s}: {value:.1e}")

# %% [markdown]
# **Next.** Chapter 15 puts the pieces together in Kimi Linear: KDA and MLA layers in a 3:1
# pattern, each followed by a feed-forward layer, an MoE in all but the first.

# %%
print(f"This notebook ran in {time.perf_counter() - NOTEBOOK_START:.0f} s.")
