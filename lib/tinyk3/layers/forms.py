"""How a mixer computes: its ``form``, one switch from a model's configuration down to the kernels.

Every token mixer's configuration has a ``form`` field, and its chunked forms a ``chunk_size``;
:class:`~tinyk3.models.LMConfig` holds the configurations, so a model can run any form its mixers
offer. The forms are those of the mixer's op module (:mod:`tinyk3.ops`), plus ``"triton"``, the
Triton kernel of the same contract (:mod:`tinyk3.kernels`; compiled on CUDA tensors, a real
launch under the interpreter on CPU ones), where Triton is installed:

======================  =======================================================  ===========
mixer kind              forms (the first is the default)                         op module
======================  =======================================================  ===========
softmax                 ``"sdpa"``, ``"masked"``, ``"loop"``                      ``attention``
linear                  ``"parallel"``, ``"chunked"``, ``"recurrent"``            ``linear_attention``
deltanet                ``"parallel"``, ``"chunked"``, ``"recurrent"``, ``"triton"``  ``delta_rule``
gated_deltanet          ``"chunked"``, ``"recurrent"``, ``"triton"``              ``gated_delta_rule``
kda                     ``"chunked"``, ``"recurrent"``, ``"triton"``              ``kda``
mla                     ``"expanded"``, ``"absorbed"`` (weight absorption)        (the layer's)
gated_attention         ``"masked"``                                              ``attention``
======================  =======================================================  ===========

A single new token (decoding) runs one step of the recurrent form whatever the form: that is
the efficient way to decode a fixed-size state, and every form gives the same numbers.
"""

from __future__ import annotations

from .. import ops

__all__ = ["FORMS", "check_form", "run_rule"]

FORMS: dict[str, tuple[str, ...]] = {
    "attention": ("sdpa", "masked", "loop"),
    "linear_attention": ("parallel", "chunked", "recurrent"),
    "delta_rule": ("parallel", "chunked", "recurrent", "triton"),
    "gated_delta_rule": ("chunked", "recurrent", "triton"),
    "kda": ("chunked", "recurrent", "triton"),
    "mla": ("expanded", "absorbed"),
    "gated_attention": ("masked",),
}


def check_form(form: str, family: str, where: str) -> str:
    """``form`` if ``family`` offers it, else ``ValueError`` naming the choices; ``"triton"`` also
    needs Triton installed (:class:`~tinyk3.kernels.TritonUnavailableError` says how)."""
    forms = FORMS[family]
    if form not in forms:
        raise ValueError(f"{where}: form must be one of {forms}, got {form!r}")
    if form == "triton":
        from ..kernels import runtime

        runtime.require_triton(f"{where}(form='triton')")
    return form


def run_rule(rule: str, form: str, *args, chunk_size: int, initial_state=None, **kwargs):
    """``(o, S)`` of the op module ``tinyk3.ops.<rule>`` (or its kernel, form ``"triton"``) on
    ``args`` (``q, k, v`` and, for the delta rules, ``beta`` and ``g``), continuing from
    ``initial_state``. One token (``T == 1``) takes one recurrent step, whatever the form."""
    module = getattr(ops, rule)
    if args[0].shape[2] == 1 or form == "recurrent":
        return module.recurrent(*args, initial_state=initial_state, **kwargs)
    if form == "parallel":
        return module.parallel(*args, initial_state=initial_state, **kwargs)
    if form == "chunked":
        return module.chunked(*args, chunk_size=chunk_size, initial_state=initial_state, **kwargs)
    if form == "triton":
        from .. import kernels

        return getattr(kernels, rule).chunked(*args, chunk_size=chunk_size,
                                              initial_state=initial_state, **kwargs)
    raise ValueError(f"{rule}: unknown form {form!r}")
