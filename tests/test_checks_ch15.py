"""Chapter 15's exercises (Kimi Linear), answered the way learners get them wrong and right.

The wrong answers are written independently of the registered Mistake functions; the
references are tied to the library: the layer pattern to the presets and the hub-config reader,
the break-even context to the layers' `state_numel` on both sides of it and to built models'
caches after decoding.
"""

from __future__ import annotations

import math

import torch

from helpers import right, run, wrong
from tinyk3 import checks
from tinyk3.layers import KDAConfig, MLAConfig, SwiGLUConfig
from tinyk3.models import LM, LMConfig, presets
from tinyk3.models.hub import lm_config_from_hf

# -- kimi_linear.layer_kinds ----------------------------------------------------------------------


def _full(config):
    return config["linear_attn_config"]["full_attn_layers"]


@wrong("kimi_linear.layer_kinds", "zero_based")
def lk_zero_based(config):
    full = _full(config)
    return ["mla" if i in full else "kda" for i in range(config["num_hidden_layers"])]


@wrong("kimi_linear.layer_kinds", "zero_based")
def lk_zero_based_loop(config):
    kinds = ["kda"] * config["num_hidden_layers"]
    for j in _full(config):
        if j < len(kinds):  # 27 does not fit: skipped, "an off-by-one at the end"
            kinds[j] = "mla"
    return kinds


@wrong("kimi_linear.layer_kinds", "every_fourth")
def lk_every_fourth(config):
    return ["mla" if i % 4 == 3 else "kda" for i in range(config["num_hidden_layers"])]


@wrong("kimi_linear.layer_kinds", "swapped")
def lk_kda_list_as_mla(config):
    kda = config["linear_attn_config"]["kda_layers"]
    return ["mla" if i + 1 in kda else "kda" for i in range(config["num_hidden_layers"])]


@wrong("kimi_linear.layer_kinds", "converted_twice")
def lk_converted_twice(config):
    zero = [j - 1 for j in _full(config)]
    return ["mla" if i + 1 in zero else "kda" for i in range(config["num_hidden_layers"])]


@right("kimi_linear.layer_kinds")
def lk_ok_loop(config):
    kinds = ["kda"] * config["num_hidden_layers"]
    for j in _full(config):
        kinds[j - 1] = "mla"
    return kinds


@right("kimi_linear.layer_kinds")
def lk_ok_from_kda_list(config):
    kda = set(config["linear_attn_config"]["kda_layers"])
    return tuple("kda" if n in kda else "mla" for n in range(1, config["num_hidden_layers"] + 1))


# -- kimi_linear.crossing_context -----------------------------------------------------------------


def _sizes(config):
    lin = config["linear_attn_config"]
    return (lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"],
            config["kv_lora_rank"], config["qk_rope_head_dim"])


@wrong("kimi_linear.crossing_context", "own_cache")
def cc_states_vs_own_cache(config, sb, cb):
    H, D, K, r, dr = _sizes(config)
    n_mla = len(config["linear_attn_config"]["full_attn_layers"])
    n_kda = len(config["linear_attn_config"]["kda_layers"])
    states = n_kda * (H * D * D + 3 * H * D * (K - 1)) * sb
    return states // (n_mla * (r + dr) * cb) + 1  # "when the cache outgrows the states"


@wrong("kimi_linear.crossing_context", "equal_not_smaller")
def cc_ceil(config, sb, cb):
    H, D, K, r, dr = _sizes(config)
    return math.ceil((H * D * D + 3 * H * D * (K - 1)) * sb / ((r + dr) * cb))


@wrong("kimi_linear.crossing_context", "no_conv_state")
def cc_matrices_only(config, sb, cb):
    H, D, K, r, dr = _sizes(config)
    return H * D * D * sb // ((r + dr) * cb) + 1


@wrong("kimi_linear.crossing_context", "no_rope_dims")
def cc_latent_only(config, sb, cb):
    H, D, K, r, dr = _sizes(config)
    return (H * D * D + 3 * H * D * (K - 1)) * sb // (r * cb) + 1  # "NoPE: no rope channels"


@wrong("kimi_linear.crossing_context", "same_widths")
def cc_values(config, sb, cb):
    H, D, K, r, dr = _sizes(config)
    return (H * D * D + 3 * H * D * (K - 1)) // (r + dr) + 1


@wrong("kimi_linear.crossing_context", None)
def cc_float(config, sb, cb):
    H, D, K, r, dr = _sizes(config)
    return (H * D * D + 3 * H * D * (K - 1)) * sb / ((r + dr) * cb)  # not rounded to tokens


@right("kimi_linear.crossing_context")
def cc_ok_search(config, sb, cb):
    """Walk T up until the whole hybrid is smaller than the whole all-MLA model."""
    H, D, K, r, dr = _sizes(config)
    n = config["num_hidden_layers"]
    n_mla = len(config["linear_attn_config"]["full_attn_layers"])
    fixed, per = (H * D * D + 3 * H * D * (K - 1)) * sb, (r + dr) * cb
    lo, hi = 0, 1
    while (n - n_mla) * fixed + n_mla * per * hi >= n * per * hi:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # the smallest T in (lo, hi] where the hybrid is smaller
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if (n - n_mla) * fixed + n_mla * per * mid < n * per * mid \
            else (mid, hi)
    return hi


@right("kimi_linear.crossing_context")
def cc_ok_float(config, sb, cb):
    H, D, K, r, dr = _sizes(config)
    return math.floor((H * D * D + 3 * H * D * (K - 1)) * sb / ((r + dr) * cb)) + 1


# -- the lists --------------------------------------------------------------------------------------


def test_the_layer_reference_is_the_presets_and_the_hub_reader():
    """On the released 48B config the reference gives the preset's kinds (MLA at 0-based 3, 7,
    ..., 23, 26), on K3's 93 layers its mixers' kinds, and on every case what the library's
    reader of hub configs builds."""
    ex = checks.EXERCISES["kimi_linear.layer_kinds"]
    cases = ex.cases()
    by_layers = {c.args[0]["num_hidden_layers"]: c.args[0] for c in cases}
    assert tuple(ex.reference(by_layers[27])) == presets.kimi_linear_48b().kinds
    assert tuple(ex.reference(by_layers[93])) == presets.kimi_k3_mixers().kinds
    hub = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, kv_lora_rank=8,
               qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, intermediate_size=8,
               moe_intermediate_size=4, num_local_experts=4, num_experts_per_tok=2,
               model_type="kimi_linear")
    for c in cases:
        cfg = dict(hub, **c.args[0])
        assert tuple(ex.reference(c.args[0])) == lm_config_from_hf(cfg).kinds, c.label
    # the cases tell the mistakes apart: the every-fourth rule passes the first case only
    assert run("kimi_linear.layer_kinds", lk_every_fourth).n_passed >= 1
    assert any(27 in _full(c.args[0]) and c.args[0]["num_hidden_layers"] == 27 for c in cases)


def _built(kinds, H, D, K, r, dr, dtype):
    kda = KDAConfig(n_head=H, head_dim=D, conv_size=K)
    mla = MLAConfig(n_head=2, kv_lora_rank=r, qk_nope_head_dim=4, qk_rope_head_dim=dr,
                    v_head_dim=4, use_rope=False)
    cfg = LMConfig(vocab_size=32, block_size=256, n_embd=16,
                   pattern=[kda if k == "kda" else mla for k in kinds], mlp=SwiGLUConfig(16),
                   pos_emb=False, norm="rmsnorm", tie_embeddings=False)
    return LM(cfg).to(dtype).eval()


def _memory(mixers, T, sb, cb):
    """Bytes of one sequence's decoding memory after T tokens, from the layers' formulas."""
    return sum(s.state_numel(1, T) * cb if s.kind == "mla" else s.state_numel(1) * sb
               for s in mixers)


def test_the_crossing_reference_is_where_the_presets_memories_cross():
    """On the released configurations (and the tiny ones, rebuilt as layer configurations)
    the hybrid is not smaller than all-MLA one token before the reference and is smaller at
    it, counted with the layers' own ``state_numel``."""
    ex = checks.EXERCISES["kimi_linear.crossing_context"]
    for c in ex.cases():
        config, sb, cb = c.args
        n = config["num_hidden_layers"]
        if n in (27, 93):
            cfg = presets.kimi_linear_48b() if n == 27 else presets.kimi_k3_mixers()
            mixers = cfg.layer_mixers
            mla = next(s for s in mixers if s.kind == "mla")
        else:
            H, D, K, r, dr = _sizes(config)
            kda = KDAConfig(n_head=H, head_dim=D, conv_size=K)
            mla = MLAConfig(n_head=2, kv_lora_rank=r, qk_nope_head_dim=4, qk_rope_head_dim=dr,
                            v_head_dim=4, use_rope=False)
            full = config["linear_attn_config"]["full_attn_layers"]
            mixers = [mla if i + 1 in full else kda for i in range(n)]
        T = ex.reference(*c.args)
        for t, smaller in ((T - 1, False), (T, True)):
            assert (_memory(mixers, t, sb, cb) < _memory([mla] * n, t, sb, cb)) is smaller, c.label


def test_the_crossing_holds_for_built_models_caches():
    """Decode T − 1 and then T tokens through a built hybrid and a built all-MLA model and
    compare ``cache.nbytes()`` (the tensors themselves): the float32 case, where the state and
    the cache have the same width."""
    ex = checks.EXERCISES["kimi_linear.crossing_context"]
    c = next(c for c in ex.cases() if c.args[1:] == (4, 4))
    config = c.args[0]
    H, D, K, r, dr = _sizes(config)
    full = config["linear_attn_config"]["full_attn_layers"]
    kinds = ["mla" if i + 1 in full else "kda" for i in range(config["num_hidden_layers"])]
    T = ex.reference(*c.args)
    hybrid = _built(kinds, H, D, K, r, dr, torch.float32)
    all_mla = _built(["mla"] * len(kinds), H, D, K, r, dr, torch.float32)
    idx = torch.randint(0, 32, (1, T), generator=torch.Generator().manual_seed(0))
    for t, smaller in ((T - 1, False), (T, True)):
        sizes = []
        for model in (hybrid, all_mla):
            cache = model.new_cache()
            with torch.no_grad():
                model(idx[:, :t], cache)
            sizes.append(cache.nbytes())
        assert (sizes[0] < sizes[1]) is smaller, (t, sizes)
    # the split of the layers does not move the answer; the "own cache" mistake depends on it
    same = [x for x in ex.cases() if _sizes(x.args[0]) == _sizes(config) or
            _sizes(x.args[0]) == (2, 8, 4, 13, 4)]
    assert len({ex.reference(*x.args) for x in same if x.args[1:] == (2, 2)}) == 1
    assert len({cc_states_vs_own_cache(*x.args) for x in same if x.args[1:] == (2, 2)}) == 2
