"""Chapter 15 exercises: Kimi Linear's layer pattern read from the released configuration's
1-based ``full_attn_layers``, and the context from which a hybrid needs less decoding memory than
the same model with MLA in every layer."""

from __future__ import annotations

from .core import Case, Exercise, Mistake, register

# -- kimi_linear.layer_kinds ----------------------------------------------------------------------


def layer_kinds(config):
    """Reference: the mixer of each layer, ``"mla"`` or ``"kda"``, 0-based list position ``i``,
    from a configuration dict as released: ``config["num_hidden_layers"]`` layers, and
    ``config["linear_attn_config"]["full_attn_layers"]``, the layers of full attention (MLA)
    numbered FROM 1. Every other layer is KDA."""
    full = set(config["linear_attn_config"]["full_attn_layers"])
    return ["mla" if i + 1 in full else "kda" for i in range(config["num_hidden_layers"])]


def _config(n_layer, full, kda=None):
    kda = [i for i in range(1, n_layer + 1) if i not in full] if kda is None else kda
    return {"num_hidden_layers": n_layer, "model_type": "kimi_linear",
            "linear_attn_config": {"full_attn_layers": list(full), "kda_layers": kda,
                                   "num_heads": 32, "head_dim": 128,
                                   "short_conv_kernel_size": 4}}


def _kinds_cases(gen) -> list[Case]:
    del gen  # the cases are fixed configurations

    def case(n_layer, full, label):
        return Case((_config(n_layer, full),),
                    label=f"{n_layer} layers, full_attn_layers {list(full)}: {label}")

    return [
        case(4, [4], "three KDA layers, then MLA"),
        case(8, [4, 8], "the 3:1 pattern twice"),
        case(27, [4, 8, 12, 16, 20, 24, 27], "Kimi Linear 48B's released config"),
        case(5, [1, 5], "the first layer is MLA"),
        case(6, [2, 3], "not every fourth"),
        case(93, list(range(4, 93, 4)) + [93], "Kimi K3's 93 layers: every fourth and the last"),
    ]


def _mistake_kinds(kind):
    def fn(config):
        n = config["num_hidden_layers"]
        full = set(config["linear_attn_config"]["full_attn_layers"])
        if kind == "zero_based":
            return ["mla" if i in full else "kda" for i in range(n)]
        if kind == "every_fourth":
            return ["mla" if (i + 1) % 4 == 0 else "kda" for i in range(n)]
        if kind == "swapped":
            return ["kda" if i + 1 in full else "mla" for i in range(n)]
        if kind == "converted_twice":  # made 0-based, then compared with i + 1 as well
            idx = {j - 1 for j in full}
            return ["mla" if i + 1 in idx else "kda" for i in range(n)]
        raise ValueError(kind)

    return fn


register(Exercise(
    id="kimi_linear.layer_kinds",
    title="the layer pattern from the released config",
    signature='layer_kinds(config: dict) -> list of "kda" / "mla", one per layer (0-based)',
    reference=layer_kinds,
    make_cases=_kinds_cases,
    chapter=15,
    mistakes=[
        Mistake("zero_based", _mistake_kinds("zero_based"),
                "you read full_attn_layers as 0-based: the released config counts layers from 1, "
                "so layer i of the list (0-based) is MLA when i + 1 is in full_attn_layers. "
                "Read 0-based, 27 would be a 28th layer, which does not exist."),
        Mistake("every_fourth", _mistake_kinds("every_fourth"),
                "you made every fourth layer MLA instead of reading the list: Kimi Linear's "
                "last layer (27) is MLA too, and a config may list any layers."),
        Mistake("swapped", _mistake_kinds("swapped"),
                "the kinds are swapped: full_attn_layers lists the MLA (full attention) layers; "
                "the others are KDA."),
        Mistake("converted_twice", _mistake_kinds("converted_twice"),
                "every MLA layer is one too early: you subtracted 1 from the listed numbers and "
                "then compared them with i + 1 as well. Convert once: layer i (0-based) is MLA "
                "when i + 1 is listed."),
    ],
    hint='full = set(config["linear_attn_config"]["full_attn_layers"]) (1-based); return '
         '["mla" if i + 1 in full else "kda" for i in range(config["num_hidden_layers"])].',
))


# -- kimi_linear.crossing_context -----------------------------------------------------------------


def crossing_context(config, state_bytes, cache_bytes):
    """Reference: the shortest context, in tokens, at which a hybrid's decoding memory for one
    sequence is smaller than that of the same model with MLA in every layer.

    ``config`` is a configuration dict as released (Kimi Linear's or K3's keys). A KDA layer
    keeps ``num_heads`` matrices of ``head_dim × head_dim`` and its three short convolutions'
    last ``short_conv_kernel_size − 1`` inputs (q, k, v, each ``num_heads·head_dim`` wide), at
    ``state_bytes`` a value; an MLA layer caches ``kv_lora_rank + qk_rope_head_dim`` values per
    token, at ``cache_bytes`` a value. With ``n_kda`` KDA layers of fixed size ``F`` and a cache
    of ``c`` per token, hybrid < all-MLA ⇔ ``n_kda·F + (L − n_kda)·c·T < L·c·T`` ⇔ ``F < c·T``:
    the layer split cancels, and the answer is ``F // c + 1``."""
    lin = config["linear_attn_config"]
    H, D, K = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    fixed = (H * D * D + 3 * H * D * (K - 1)) * state_bytes
    per_token = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * cache_bytes
    return fixed // per_token + 1


def _hybrid_config(n_layer, full, H, D, K, r, dr):
    cfg = _config(n_layer, full)
    cfg["linear_attn_config"].update(num_heads=H, head_dim=D, short_conv_kernel_size=K)
    cfg.update(kv_lora_rank=r, qk_rope_head_dim=dr)
    return cfg


def _crossing_cases(gen) -> list[Case]:
    del gen  # the cases are fixed configurations

    def case(n_layer, full, H, D, K, r, dr, sb, cb, label):
        cfg = _hybrid_config(n_layer, full, H, D, K, r, dr)
        n_mla = len(full)
        return Case((cfg, sb, cb),
                    label=f"{n_layer - n_mla} KDA + {n_mla} MLA layers, H={H}, head_dim={D}, "
                          f"conv {K}, r={r}, dr={dr}, state {sb} B, cache {cb} B: {label}")

    kl = [4, 8, 12, 16, 20, 24, 27]
    k3 = list(range(4, 93, 4)) + [93]
    return [
        case(27, kl, 32, 128, 4, 512, 64, 4, 2, "Kimi Linear 48B, float32 states"),
        case(27, kl, 32, 128, 4, 512, 64, 2, 2, "Kimi Linear 48B, everything in bf16"),
        case(93, k3, 96, 128, 4, 512, 64, 4, 2, "Kimi K3, float32 states"),
        case(4, [4], 2, 8, 4, 13, 4, 2, 2, "tiny: the state is exactly 16 tokens of cache"),
        case(8, [2, 3, 4, 5, 6, 7, 8], 2, 8, 4, 13, 4, 2, 2, "the same layers, 1 KDA of 8"),
        case(8, [8], 4, 16, 2, 32, 8, 4, 4, "7 KDA of 8, conv of 2, float32"),
        case(6, [3, 6], 3, 6, 3, 10, 2, 8, 2, "float64 states, bf16 cache"),
    ]


def _mistake_crossing(kind):
    def fn(config, state_bytes, cache_bytes):
        lin = config["linear_attn_config"]
        H, D, K = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
        if kind == "one_head":
            H = 1
        taps = {"no_conv_state": 0, "conv_k_taps": K}.get(kind, K - 1)
        fixed = H * D * D + 3 * H * D * taps
        c = config["kv_lora_rank"] + (0 if kind == "no_rope_dims" else
                                      config["qk_rope_head_dim"])
        if kind == "same_widths":
            return fixed // c + 1
        fixed, c = fixed * state_bytes, c * cache_bytes
        if kind == "equal_not_smaller":
            return -(-fixed // c)  # the ceiling: where they are equal, not where it is smaller
        if kind == "own_cache":  # the hybrid's states against the hybrid's own MLA cache
            n_mla = len(lin["full_attn_layers"])
            n_kda = config["num_hidden_layers"] - n_mla
            return n_kda * fixed // (n_mla * c) + 1
        return fixed // c + 1

    return fn


register(Exercise(
    id="kimi_linear.crossing_context",
    title="the break-even context",
    signature="crossing_context(config: dict, state_bytes: int, cache_bytes: int) -> int",
    reference=crossing_context,
    make_cases=_crossing_cases,
    chapter=15,
    mistakes=[
        Mistake("own_cache", _mistake_crossing("own_cache"),
                "you found where the hybrid's KDA states weigh as much as the hybrid's own MLA "
                "cache. The question compares the whole hybrid with the same model all-MLA: "
                "write both memories for T tokens and subtract; the MLA layers they share "
                "cancel, and so does the number of KDA layers."),
        Mistake("equal_not_smaller", _mistake_crossing("equal_not_smaller"),
                "at your T the two memories are equal, not smaller: you rounded the ratio up. "
                "The hybrid is smaller when c·T > F, so T = F // c + 1 (one case divides "
                "exactly)."),
        Mistake("no_conv_state", _mistake_crossing("no_conv_state"),
                "your KDA state is the matrices S only: the three short convolutions (q, k, v, "
                "each num_heads·head_dim wide) also keep their last K − 1 inputs."),
        Mistake("conv_k_taps", _mistake_crossing("conv_k_taps"),
                "your convolution state keeps short_conv_kernel_size inputs: the current "
                "token arrives with the next call, so the state holds the last K − 1."),
        Mistake("no_rope_dims", _mistake_crossing("no_rope_dims"),
                "your MLA cache holds kv_lora_rank values per token: the layers are NoPE, but "
                "the cache also keeps the shared key channels, qk_rope_head_dim of them."),
        Mistake("same_widths", _mistake_crossing("same_widths"),
                "you compared numbers of values: the state and the cache are stored at "
                "different widths (state_bytes and cache_bytes), so compare bytes."),
        Mistake("one_head", _mistake_crossing("one_head"),
                "your KDA state is one head's: a layer keeps num_heads matrices of "
                "head_dim × head_dim (and convolution windows num_heads·head_dim wide)."),
    ],
    hint="per KDA layer F = (H·D² + 3·H·D·(K − 1))·state_bytes bytes, fixed; per MLA layer "
         "c = (kv_lora_rank + qk_rope_head_dim)·cache_bytes bytes per token. The hybrid "
         "is smaller when n_kda·F < n_kda·c·T, so return F // c + 1.",
))
