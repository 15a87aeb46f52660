"""Chapter 21 exercises: the grids of the five backward launches, and the adjoint state pass
of the delta rule as a Triton kernel.

The learner writes the body of a Triton kernel (a plain function; a ``@triton.jit`` one is
accepted too). ``check_adjoint_kernel`` launches it under the Triton interpreter on the cases
below and compares with the PyTorch reference (``tinyk3.ops.delta_rule.adjoint_state_pass``)::

    adjoint_kernel(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT, BC, BK, BV)   grid (B·H,)
    for c = NT − 1 .. 0:   dU'_[c] = P_[c] + K_[c] dS          (stored in du_new)
                           dS      = dS + Q_[c]ᵀ dO_[c] − W_[c]ᵀ dU'_[c]
    dS starts at ds_T = ∂L/∂S_T and ends as ∂L/∂S_0 (stored in ds0)

Every tensor sits in the middle of a larger buffer filled with NaN (as in chapter 9's exercise,
``tinyk3.checks.core``), so a load without a mask past the last token reads NaN,
and a store without a mask lands in the margin of an output, where the launcher sees it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.delta_rule import adjoint_state_pass
from .core import Case, CheckResult, Exercise, Mistake, NanMargins, check_kernel, interpret, register

tl = None  # triton.language, set by check_adjoint_kernel (the solution's body names it)


def adjoint_pass(k, w, q, p, do, ds_T, C):
    """Reference: the adjoint state pass of the delta rule over chunks of ``C`` tokens.
    ``k, w, q [BH, T, Dk]``, ``p, do [BH, T, Dv]`` (``P = Ωᵀ dO``), ``ds_T [BH, Dk, Dv]``.
    Returns ``(dU' [BH, T, Dv], dS_0 [BH, Dk, Dv])``."""
    return _pass(k, w, q, p, do, ds_T, C)


def _pass(k, w, q, p, do, ds_T, C, *, forward=False, update_first=False, sign=-1.0,
          with_q=True, from_zero=False, nan_p_past_T=False):
    """The adjoint pass with one thing changed: each keyword switches on a typical mistake."""
    BH, T, Dk = k.shape
    N, pad = -(-T // C), -T % C
    kc, wc, qc, pc, doc = (F.pad(x, (0, 0, 0, pad)).view(BH, N, C, -1) for x in (k, w, q, p, do))
    if nan_p_past_T and pad:  # P loaded without a row mask: the last head's rows t ≥ T are NaN
        pc = pc.clone()
        pc[-1, -1, C - pad:] = float("nan")
    R = qc.mT @ doc if with_q else torch.zeros(BH, N, Dk, do.shape[-1])
    dS = torch.zeros_like(ds_T) if from_zero else ds_T.clone()
    if not (forward or update_first or sign != -1.0):
        du, _, dS0 = adjoint_state_pass(pc, R, wc, kc, dS)
        return du.reshape(BH, N * C, -1)[:, :T], dS0
    du = torch.zeros_like(pc)
    order = range(N) if forward else reversed(range(N))
    for c in order:
        if update_first:  # dS updated first, dU'_[c] then formed from dS_[c] (its own update)
            dS = dS + R[:, c] + sign * wc[:, c].mT @ (pc[:, c] + kc[:, c] @ dS)
            du[:, c] = pc[:, c] + kc[:, c] @ dS
            continue
        du[:, c] = pc[:, c] + kc[:, c] @ dS
        dS = dS + R[:, c] + sign * wc[:, c].mT @ du[:, c]
    return du.reshape(BH, N * C, -1)[:, :T], dS


def _cases(g: torch.Generator) -> list[Case]:
    def case(BH, T, Dk, Dv, C, label):
        def r(*shape):
            return torch.randn(*shape, generator=g)

        k = F.normalize(r(BH, T, Dk), dim=-1)
        w = 0.5 * r(BH, T, Dk)
        args = (k, w, r(BH, T, Dk), r(BH, T, Dv), r(BH, T, Dv), r(BH, Dk, Dv), C)
        return Case(args, label=f"B·H={BH}, T={T}, Dk={Dk}, Dv={Dv}, C={C}: {label}")

    return [
        case(1, 16, 16, 16, 16, "one whole chunk"),
        case(2, 64, 16, 32, 16, "four whole chunks, two heads"),
        case(2, 37, 16, 16, 16, "the last chunk has 5 tokens"),
        case(3, 50, 20, 12, 16, "Dk = 20 and Dv = 12 padded to 32 and 16, last chunk partial"),
        case(2, 70, 32, 24, 32, "C = 32, the last chunk has 6 tokens"),
    ]


def _launch(kernel):
    """The learner's kernel as a function of a case's arguments, launched under the interpreter
    with every tensor inside NaN margins; raises (so the check reports it) if it stored outside
    an output."""

    def launch(k, w, q, p, do, ds_T, C):
        from ..kernels.runtime import tile_size

        BH, T, Dk = k.shape
        Dv, N = p.shape[-1], -(-T // C)
        margins = NanMargins()
        ins = [margins.place(x) for x in (k, w, q, p, do, ds_T)]
        du = margins.place(torch.full((BH, T, Dv), float("nan")), output=True)
        ds0 = margins.place(torch.full((BH, Dk, Dv), float("nan")), output=True)
        interpret(kernel, (BH,), *ins, du, ds0, T, Dk, Dv, N, BC=C, BK=tile_size(Dk),
                  BV=tile_size(Dv))
        outside = margins.stored_outside()
        if outside:
            raise RuntimeError(
                f"your kernel stored {outside} values outside du_new or ds0: the stores need "
                "masks (rows t < T and columns d < Dv for dU', rows d < Dk for dS_0), so that "
                "padded rows and columns are not written")
        return du.clone(), ds0.clone()

    return launch


_EXERCISE = register(Exercise(
    id="backward.adjoint_kernel",
    title="the adjoint state pass as a Triton kernel",
    signature="adjoint_kernel(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT, BC: tl.constexpr, "
              "BK: tl.constexpr, BV: tl.constexpr), one program per head; checked with "
              "checks.ch21_kernel_backward.check_adjoint_kernel(adjoint_kernel)",
    reference=adjoint_pass,
    make_cases=_cases,
    chapter=21,
    atol=1e-4,
    rtol=1e-4,
    mistakes=[
        Mistake("forward_order", lambda *a: _pass(*a, forward=True),
                "the loop runs forward: the state's gradient flows from the last chunk to the "
                "first, so visit i_c = NT − 1 − i for i = 0 .. NT − 1."),
        Mistake("update_before_delta", lambda *a: _pass(*a, update_first=True),
                "the dU'_[c] you store was formed after dS was updated: it needs dS_[c+1], the "
                "gradient before this chunk's update. Form dU', store it, and update dS with that "
                "same dU'."),
        Mistake("plus_w", lambda *a: _pass(*a, sign=1.0),
                "U' = U − W S, so dS loses Wᵀ dU': subtract tl.dot(tl.trans(w), du)."),
        Mistake("no_output_term", lambda *a: _pass(*a, with_q=False),
                "the outputs O = Q S + … read the state too: add tl.dot(tl.trans(q), do) to dS "
                "for every chunk."),
        Mistake("zero_start", lambda *a: _pass(*a, from_zero=True),
                "dS starts at ds_T, the final state's gradient (the loss may read S_T), not 0."),
        Mistake("p_without_row_mask", lambda *a: _pass(*a, nan_p_past_T=True),
                "the padded rows t ≥ T of P are loaded without a mask and read NaN: load P (and "
                "every [C, D] tile) with mask=m_t[:, None] & m_d[None, :] and other=0.0."),
    ],
    hint="b_dS = load ds_T ([BK, BV]); for i in range(NT): i_c = NT − 1 − i, o_t = i_c·BC + o_i; "
         "load K, W, Q ([BC, BK]), P, dO ([BC, BV]), each masked with other=0.0; "
         "du = p + tl.dot(k, b_dS); store du (masked); "
         "b_dS += tl.dot(tl.trans(q), do) − tl.dot(tl.trans(w), du); after the loop store b_dS "
         "into ds0 (masked). Use input_precision=\"ieee\" in every tl.dot.",
))


def check_adjoint_kernel(kernel, *, verbose: bool = True) -> CheckResult:
    """Run the learner's adjoint-pass kernel under the Triton interpreter on every case of
    ``backward.adjoint_kernel`` and report (case, distance, hint), as :func:`tinyk3.checks.run`
    does. Never raises because of the kernel; without Triton it says how to install it."""
    global tl
    from ..kernels import runtime

    if runtime.AVAILABLE:
        import triton.language as tl  # noqa: F811 (the module's name for the solution kernel)
    return check_kernel(_EXERCISE, _launch, kernel, verbose)


def adjoint_kernel_solution(k, w, q, p, do, ds_T, du_new, ds0, T, Dk, Dv, NT, BC: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr):
    """A solution of ``backward.adjoint_kernel`` (what the tests and the chapter check against)."""
    i_bh = tl.program_id(0)
    o_i = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k, m_v = o_k < Dk, o_v < Dv
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
    b_dS = tl.load(ds_T + p_s, mask=m_kv, other=0.0)  # dS_[N] = ∂L/∂S_T
    for i in range(0, NT):
        i_c = NT - 1 - i  # backward over the chunks
        o_t = i_c * BC + o_i
        m_tk = (o_t[:, None] < T) & m_k[None, :]
        m_tv = (o_t[:, None] < T) & m_v[None, :]
        p_tk = i_bh * T * Dk + o_t[:, None] * Dk + o_k[None, :]
        p_tv = i_bh * T * Dv + o_t[:, None] * Dv + o_v[None, :]
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.0)
        b_p = tl.load(p + p_tv, mask=m_tv, other=0.0)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_du = b_p + tl.dot(b_k, b_dS, input_precision="ieee")  # dU'_[c] = P + K dS_[c+1]
        tl.store(du_new + p_tv, b_du, mask=m_tv)
        b_dS += tl.dot(tl.trans(b_q), b_do, input_precision="ieee")  # + Qᵀ dO
        b_dS -= tl.dot(tl.trans(b_w), b_du, input_precision="ieee")  # − Wᵀ dU'
    tl.store(ds0 + p_s, b_dS, mask=m_kv)


# -- backward.launch_grids ---------------------------------------------------------------------


def launch_grids(B, H, T, Dk, Dv, C, cfg):
    """Reference: the grid of each backward launch (chapter 21's table), in launch order
    ``(wy, dv_local, adjoint, ut_backward, dqk)``, for ``B·H`` heads of ``T`` tokens in chunks of
    ``C`` and the tiles ``cfg = {stage: {"BK": ..., "BV": ...}}``. Each grid is a tuple of ints,
    the program axes in the order the kernels read them (``program_id(0)`` first)."""
    return _grids(B, H, T, Dk, Dv, C, cfg)


def _grids(B, H, T, Dk, Dv, C, cfg, *, floor=False, adjoint_chunks=False, dqk_over="Dk",
           dv_over="Dv", ut_blocks=False):
    NT = T // C if floor else -(-T // C)
    BH = B * H

    def blocks(D, tile):
        return -(-D // tile)

    dv_tile = cfg["dv_local"]["BV"] if dv_over == "Dv" else cfg["dv_local"]["BK"]
    dv = (blocks(Dv if dv_over == "Dv" else Dk, dv_tile), NT, BH)
    adjoint = ((blocks(Dv, cfg["adjoint"]["BV"]), NT, BH) if adjoint_chunks
               else (blocks(Dv, cfg["adjoint"]["BV"]), BH))
    ut = (blocks(Dv, cfg["ut_backward"]["BV"]), NT, BH) if ut_blocks else (NT, BH)
    dqk_dim, dqk_tile = (Dk, cfg["dqk"]["BK"]) if dqk_over == "Dk" else (Dv, cfg["dqk"]["BV"])
    return ((NT, BH), dv, adjoint, ut, (blocks(dqk_dim, dqk_tile), NT, BH))


def _grid_cases(g: torch.Generator) -> list[Case]:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    def case(B, H, T, Dk, Dv, C, label):
        cfg = {stage: {"BK": pick((16, 32, 64)), "BV": pick((16, 32, 64))}
               for stage in ("wy", "dv_local", "adjoint", "ut_backward", "dqk")}
        cfg["adjoint"]["BK"] = 1 << max(4, (Dk - 1).bit_length())  # all of Dk
        return Case((B, H, T, Dk, Dv, C, cfg),
                    label=f"B={B}, H={H}, T={T}, Dk={Dk}, Dv={Dv}, C={C}: {label}")

    return [
        case(1, 1, 128, 64, 64, 64, "two whole chunks"),
        case(2, 4, 100, 128, 96, 64, "the last chunk has 36 tokens"),
        case(1, 8, 4096, 128, 128, 64, "a long sequence"),
        case(3, 2, 37, 20, 12, 16, "small heads, the last chunk has 5 tokens"),
        case(1, 16, 1000, 192, 128, 32, "Dk > Dv"),
    ]


register(Exercise(
    id="backward.launch_grids",
    title="the grids of the five backward launches",
    signature="launch_grids(B, H, T, Dk, Dv, C, cfg) -> (wy, dv_local, adjoint, ut_backward, "
              "dqk), each a tuple of ints",
    reference=launch_grids,
    make_cases=_grid_cases,
    chapter=21,
    mistakes=[
        Mistake("adjoint_with_chunk_axis", lambda *a: _grids(*a, adjoint_chunks=True),
                "the adjoint pass is the sequential launch: one program loops over all the chunks "
                "of its head, so its grid has no chunk axis: (Dv blocks, B·H)."),
        Mistake("floor_chunks", lambda *a: _grids(*a, floor=True),
                "a partial last chunk still needs its programs: the number of chunks is "
                "⌈T / C⌉, (T + C − 1) // C, not T // C."),
        Mistake("dqk_over_dv", lambda *a: _grids(*a, dqk_over="Dv"),
                "launch 5 splits the key dimension: each program forms a block of Dk columns of "
                "dQ and dK (and KDA's dg), so its first axis is ⌈Dk / BK⌉ with the dqk tiles."),
        Mistake("dv_local_over_dk", lambda *a: _grids(*a, dv_over="Dk"),
                "P = Ωᵀ dO has Dv columns, like dO: launch 2's first axis is ⌈Dv / BV⌉."),
        Mistake("ut_backward_blocks", lambda *a: _grids(*a, ut_blocks=True),
                "d𝒯 = dW K̃ᵀ + dU' Vᵀ is a C × C matrix summed over all of Dk and Dv, so one "
                "program holds a whole chunk: launch 4's grid is (chunks, B·H)."),
    ],
    hint="NT = ⌈T / C⌉ and BH = B·H. The two parallel per-chunk launches without column blocks "
         "(wy, ut_backward) are (NT, BH); launch 2 splits Dv: (⌈Dv / BV⌉, NT, BH); the adjoint "
         "pass loops over chunks: (⌈Dv / BV⌉, BH); launch 5 splits Dk: (⌈Dk / BK⌉, NT, BH), each "
         "with its own stage's tiles from cfg.",
))
