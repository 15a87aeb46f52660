"""Chapter 15 exercises: Kimi Linear's layer pattern read from the released configuration's
1-based ``full_attn_layers``, and the bytes a hybrid's decoding state holds at a context."""

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


# -- kimi_linear.state_bytes ----------------------------------------------------------------------


def state_bytes(kinds, length, n_head, head_dim, conv_size, kv_lora_rank, rope_dim, batch,
                bytes_per_value):
    """Reference: bytes of a Kimi Linear model's decoding state after ``length`` tokens.

    ``kinds``: one ``"kda"`` or ``"mla"`` per layer. A KDA layer keeps, per sequence, ``n_head``
    matrices ``S`` of ``head_dim × head_dim`` and its three short convolutions' last
    ``conv_size − 1`` inputs of q, k and v, each ``n_head·head_dim`` wide: a fixed size. A NoPE
    MLA layer caches, per token, the latent (``kv_lora_rank``) and the shared key channels
    (``rope_dim``: kept without rotation). Times ``batch`` and ``bytes_per_value``."""
    H, D, K = n_head, head_dim, conv_size
    kda = H * D * D + 3 * H * D * (K - 1)
    mla = length * (kv_lora_rank + rope_dim)
    values = sum(kda if k == "kda" else mla for k in kinds)
    return batch * values * bytes_per_value


def _bytes_cases(gen) -> list[Case]:
    del gen

    def case(kinds, T, H, D, K, r, dr, B, nb, label):
        return Case((tuple(kinds), T, H, D, K, r, dr, B, nb),
                    label=f"{len(kinds)} layers {''.join(k[0].upper() for k in kinds)}, "
                          f"T={T:,}, H={H}, head_dim={D}, conv_size={K}, r={r}, dr={dr}, "
                          f"batch={B}, {nb} bytes per value: {label}")

    kl = ["mla" if i + 1 in (4, 8, 12, 16, 20, 24, 27) else "kda" for i in range(27)]
    return [
        case(["kda"] * 3 + ["mla"], 10, 2, 8, 4, 16, 4, 1, 4, "a tiny 3:1 hybrid, float32"),
        case(["kda", "mla"], 7, 3, 6, 4, 12, 8, 2, 8, "two sequences, float64"),
        case(["kda"] * 4, 100, 2, 8, 3, 16, 4, 1, 2, "no MLA layer: the same bytes at any T"),
        case(["mla"] * 2, 33, 2, 8, 4, 24, 6, 3, 2, "only MLA: grows with T"),
        case(["kda", "kda", "mla", "kda"], 1, 4, 16, 2, 32, 8, 1, 4, "one token"),
        case(kl, 1_048_576, 32, 128, 4, 512, 64, 1, 2, "Kimi Linear 48B at 1M tokens, bf16"),
    ]


def _mistake_bytes(kind):
    def fn(kinds, T, H, D, K, r, dr, B, nb):
        kda = H * D * D + (0 if kind == "no_conv_state" else
                           3 * H * D * (K if kind == "conv_k_taps" else K - 1))
        if kind == "kda_grows":
            kda *= T
        mla = T * (r if kind == "nope_drops_rope_dim" else r + dr)
        if kind == "all_layers_cache":
            values = len(kinds) * mla
        else:
            values = sum(kda if k == "kda" else mla for k in kinds)
        return (1 if kind == "no_batch" else B) * values * nb

    return fn


register(Exercise(
    id="kimi_linear.state_bytes",
    title="the bytes of a hybrid's decoding state",
    signature="state_bytes(kinds, length, n_head, head_dim, conv_size, kv_lora_rank, rope_dim, "
              "batch, bytes_per_value) -> int",
    reference=state_bytes,
    make_cases=_bytes_cases,
    chapter=15,
    mistakes=[
        Mistake("nope_drops_rope_dim", _mistake_bytes("nope_drops_rope_dim"),
                "your MLA cache holds kv_lora_rank numbers per token: Kimi Linear's MLA is NoPE "
                "(nothing is rotated), but it keeps the shared key channels, so a token adds "
                "kv_lora_rank + rope_dim numbers."),
        Mistake("no_conv_state", _mistake_bytes("no_conv_state"),
                "your KDA state is the matrices S only: the three short convolutions (q, k, v, "
                "each n_head·head_dim wide) also keep their last conv_size − 1 inputs."),
        Mistake("conv_k_taps", _mistake_bytes("conv_k_taps"),
                "your convolution state keeps conv_size inputs: the current token arrives with "
                "the next call, so the state holds the last conv_size − 1."),
        Mistake("kda_grows", _mistake_bytes("kda_grows"),
                "your KDA state grows with the length: S is head_dim × head_dim per head "
                "whatever the number of tokens; only the MLA layers grow."),
        Mistake("all_layers_cache", _mistake_bytes("all_layers_cache"),
                "you gave every layer an MLA cache: only the layers of kind 'mla' keep one; the "
                "KDA layers keep a fixed-size state."),
        Mistake("no_batch", _mistake_bytes("no_batch"),
                "your count is for one sequence: every sequence of the batch has its own state "
                "and cache, so multiply by batch."),
    ],
    hint="per KDA layer n_head·head_dim² + 3·n_head·head_dim·(conv_size − 1) values; per MLA "
         "layer length·(kv_lora_rank + rope_dim); sum over kinds, times batch and "
         "bytes_per_value.",
))
