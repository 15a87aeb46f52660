"""Chapter 15's exercises (Kimi Linear), answered the way learners get them wrong and right.

The wrong answers are written independently of the registered Mistake functions; the
references are tied to the library: the layer pattern to the presets and the hub-config reader,
the state bytes to a built model's cache after decoding and to the layers' ``state_numel``.
"""

from __future__ import annotations

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


# -- kimi_linear.state_bytes ----------------------------------------------------------------------


@wrong("kimi_linear.state_bytes", "nope_drops_rope_dim")
def sb_latent_only(kinds, T, H, D, K, r, dr, B, nb):
    per = {"kda": H * D * D + 3 * H * D * (K - 1), "mla": T * r}  # "NoPE: no rope channels"
    return B * nb * sum(per[k] for k in kinds)


@wrong("kimi_linear.state_bytes", "no_conv_state")
def sb_matrices_only(kinds, T, H, D, K, r, dr, B, nb):
    return B * nb * sum(H * D * D if k == "kda" else T * (r + dr) for k in kinds)


@wrong("kimi_linear.state_bytes", "conv_k_taps")
def sb_conv_full_window(kinds, T, H, D, K, r, dr, B, nb):
    per = {"kda": H * D * D + 3 * H * D * K, "mla": T * (r + dr)}
    return B * nb * sum(per[k] for k in kinds)


@wrong("kimi_linear.state_bytes", "kda_grows")
def sb_kda_per_token(kinds, T, H, D, K, r, dr, B, nb):
    per = {"kda": T * (H * D * D + 3 * H * D * (K - 1)), "mla": T * (r + dr)}
    return B * nb * sum(per[k] for k in kinds)


@wrong("kimi_linear.state_bytes", "all_layers_cache")
def sb_every_layer_caches(kinds, T, H, D, K, r, dr, B, nb):
    return B * nb * len(kinds) * T * (r + dr)


@wrong("kimi_linear.state_bytes", "no_batch")
def sb_one_sequence(kinds, T, H, D, K, r, dr, B, nb):
    per = {"kda": H * D * D + 3 * H * D * (K - 1), "mla": T * (r + dr)}
    return nb * sum(per[k] for k in kinds)


@right("kimi_linear.state_bytes")
def sb_ok_lib(kinds, T, H, D, K, r, dr, B, nb):
    kda = KDAConfig(n_head=H, head_dim=D, conv_size=K)
    mla = MLAConfig(n_head=1, kv_lora_rank=r, qk_rope_head_dim=dr, use_rope=False)
    return nb * sum(kda.state_numel(B) if k == "kda" else mla.state_numel(B, T) for k in kinds)


@right("kimi_linear.state_bytes")
def sb_ok_counted(kinds, T, H, D, K, r, dr, B, nb):
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    state = H * D * D  # S per head
    conv = (K - 1) * (H * D + H * D + H * D)  # q, k, v windows
    latent = r + dr
    return n_kda * B * (state + conv) * nb + n_mla * B * T * latent * nb


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


def test_the_bytes_reference_is_a_decoded_models_cache():
    """At every small case: build the model, decode ``length`` tokens in two pieces through its
    cache, and compare ``cache.nbytes()`` (measured from the tensors) with the reference; in
    float32 and float64, scaled for the bf16 cases. Also: the 1M-token case is the preset's
    own ``state_numel`` sum."""
    ex = checks.EXERCISES["kimi_linear.state_bytes"]
    for c in ex.cases():
        kinds, T, H, D, K, r, dr, B, nb = c.args
        if T > 1000:
            cfg = presets.kimi_linear_48b()
            assert tuple(kinds) == cfg.kinds and (H, D, K) == (32, 128, 4)
            values = sum(s.state_numel(B, T) for s in cfg.layer_mixers)
            assert ex.reference(*c.args) == values * nb
            continue
        dtype = torch.float64 if nb == 8 else torch.float32
        model = _built(kinds, H, D, K, r, dr, dtype)
        idx = torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(0))
        cache = model.new_cache()
        with torch.no_grad():
            cut = max(1, T // 2)
            model(idx[:, :cut], cache)
            if cut < T:
                model(idx[:, cut:], cache)
        elem = torch.empty((), dtype=dtype).element_size()
        assert ex.reference(*c.args) == cache.nbytes() * nb // elem, c.label
