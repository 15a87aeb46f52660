"""One ``form`` from a model's configuration down to the kernels (``tinyk3.layers.forms``): every
registered mixer, in a two-layer model, in each of its forms, gives the same logits as in its
default form with the same weights, and decoding in pieces equals the full forward in every
form. The Triton forms run the kernels (under the interpreter on CPU) and are marked ``triton``:
without Triton they are skipped, and asking for them is a clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyk3.kernels import AVAILABLE as TRITON
from tinyk3.layers import (
    MIXER_CONFIGS,
    DeltaNetConfig,
    GatedAttentionConfig,
    GatedDeltaNetConfig,
    KDAConfig,
    LinearAttentionConfig,
    MLAConfig,
    SoftmaxAttentionConfig,
)
from tinyk3.layers.forms import FORMS
from tinyk3.models import LM, LMConfig

pytestmark = pytest.mark.triton  # the kernel forms; the others run with Triton hidden too

D = 16
SPECS = {  # kind -> (the op family of its forms, a tiny configuration)
    "softmax": ("attention", SoftmaxAttentionConfig(n_head=2)),
    "linear": ("linear_attention", LinearAttentionConfig(n_head=2, chunk_size=4)),
    "deltanet": ("delta_rule", DeltaNetConfig(n_head=2, conv_size=4, chunk_size=16)),
    "gated_deltanet": ("gated_delta_rule", GatedDeltaNetConfig(n_head=2, head_dim=8, n_v_head=4,
                                                               chunk_size=16)),
    "kda": ("kda", KDAConfig(n_head=2, head_dim=8, gate="lower_bound", output_gate="full",
                             chunk_size=16)),
    "mla": ("mla", MLAConfig(n_head=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                             v_head_dim=4, q_lora_rank=8)),
    "gated_attention": ("gated_attention", GatedAttentionConfig(n_head=2, n_kv_head=1, head_dim=8)),
}
CASES = [(kind, form) for kind, (family, _) in SPECS.items() for form in FORMS[family]]


def _model(kind: str, form: str, dtype) -> LM:
    spec = dataclasses.replace(SPECS[kind][1], form=form)
    cfg = LMConfig(vocab_size=40, block_size=64, n_embd=D, pattern=(spec, spec), pos_emb=False,
                   norm="rmsnorm", tie_embeddings=False)
    torch.manual_seed(0)  # the same weights in every form
    return LM(cfg).to(dtype).eval()


def test_every_registered_mixer_has_forms():
    assert set(SPECS) == set(MIXER_CONFIGS)
    for kind, (family, spec) in SPECS.items():
        assert spec.form == FORMS[family][0], kind  # the default is the first form
        with pytest.raises(ValueError, match="form must be one of"):
            dataclasses.replace(spec, form="bogus")


@pytest.mark.parametrize("kind, form", CASES, ids=[f"{k}-{f}" for k, f in CASES])
def test_every_form_gives_the_default_forms_logits(kind, form):
    if form == "triton" and not TRITON:
        pytest.skip("Triton is not installed")
    default = FORMS[SPECS[kind][0]][0]
    dtype = torch.float32 if form == "triton" else torch.float64  # kernels: no float64
    idx = torch.randint(0, 40, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = _model(kind, default, torch.float64)(idx)
        model = _model(kind, form, dtype)
        full = model(idx)
        cache, outs, t = model.new_cache(), [], 0
        for n in (9, 1, 11):  # a prompt, one token, a longer block
            outs.append(model(idx[:, t:t + n], cache))
            t += n
    tol = 1e-5 if dtype == torch.float32 else 1e-10  # float32 (the kernels): measured <= 1.6e-7
    assert (full.double() - ref).abs().max() < tol, (kind, form)
    assert (torch.cat(outs, 1).double() - full.double()).abs().max() < tol, (kind, form)


def test_triton_form_without_triton_is_a_clear_error(monkeypatch):
    import tinyk3.kernels.runtime as runtime
    monkeypatch.setattr(runtime, "AVAILABLE", False)
    monkeypatch.setattr(runtime, "REASON", "hidden by the test")
    with pytest.raises(ImportError, match="Triton"):
        KDAConfig(n_head=2, head_dim=8, form="triton")
