"""Benchmarks: ``python -m tinyk3.bench`` prints a table and can save CSV and a plot.

Performance claims in the course come from here, never from timed unit tests. Every file
written records the hardware, the versions and the git commit it was measured at.

    python -m tinyk3.bench delta_rule --T 1024 4096 --csv out.csv --plot out.png
    python -m tinyk3.bench delta_rule gated_delta_rule kda --T 4096 --C 64 --fla
    python -m tinyk3.bench matmul

Rules (``rule`` column): ``delta_rule`` (chapters 8 and 9), ``gated_delta_rule`` (chapter 10) and
``kda`` (chapter 11); several in one run share the same matmul rate, so their times compare.
Forms timed for each rule (``form`` column):

* ``recurrent``: the token loop (up to ``--loop-max-T``);
* ``chunked``: the chunked PyTorch form, several chunk sizes;
* ``fla_naive`` (``--fla``, CPU): flash-linear-attention's reference chunked code
  (``delta_rule_chunkwise``, ``naive_chunk_gated_delta_rule``, ``naive_chunk_kda``), where fla
  is installed;
* ``triton`` (``--triton``; default on a GPU): the kernels of ``tinyk3.kernels`` (on CPU they
  run under the Triton interpreter: a correctness path, slow, for tiny sizes only);
* ``fla_chunk`` (``--fla`` on a GPU): fla's Triton kernels ``chunk_delta_rule``,
  ``chunk_gated_delta_rule``, ``chunk_kda``;
* ``sdpa`` (``--sdpa``; default on a GPU): causal softmax attention at the same shapes
  (``torch.nn.functional.scaled_dot_product_attention``), the quadratic baseline.

``--backward`` times training instead (chapters 19 and 20): for each rule, forward and backward
of ``chunked`` with its derived backward (``form`` ``derived``) and with autograd through the
PyTorch forward (``autograd``), in the same run, and the bytes each keeps between forward and
backward beyond the inputs' own storages (``kept_bytes``; :func:`tinyk3.grad_memory.saved_bytes`).

    python -m tinyk3.bench delta_rule gated_delta_rule kda --backward --T 1024 4096 16384 --C 64

A form whose package is missing is skipped with a message. The matmul benchmark gives the
machine's reachable FLOP/s, measured in the same run (before and after the forms), so every
form's FLOP rate can be read as a fraction of it (chapter 8).

    python -m tinyk3.bench delta_rule --T 4096 --C 32 64 128 --fla --csv out.csv
    python -m tinyk3.bench delta_rule --device cuda --dtype bfloat16 --T 2048 8192 \\
        --B 4 --H 16 --D 128 --C 64 --fla
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from .cost import chunked_delta_rule_flops, sdpa_flops
from .timing import Timing, time_fn

__all__ = ["environment", "git_commit", "stamp", "time_fn", "Timing", "matmul_flops", "fla_chunkwise",
           "fla_chunk_kernel", "triton_chunked", "bench_delta_rule", "bench_backward", "RULES", "main"]


def git_commit(cwd: Path | None = None) -> tuple[str, bool | None]:
    """``(short commit, dirty)`` of the checkout the library runs from; ``("unknown", None)``
    outside git. ``dirty`` is True when tracked files differ from that commit, so a record made
    with uncommitted changes says so. The stored notebooks (``notebooks/*.ipynb``) do not count:
    they hold the outputs a full run writes one chapter after another, and their code is
    ``notebooks/src/*.py``, which does (the tests hold the two in step)."""
    cwd = cwd or Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5, cwd=cwd).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, cwd=cwd)
    except Exception:  # pragma: no cover - no git
        return "unknown", None
    if not commit or status.returncode != 0:
        return "unknown", None
    changed = [line[3:].split(" -> ")[-1].strip('"') for line in status.stdout.splitlines()]
    return commit, any(not _STORED_NOTEBOOK.fullmatch(path) for path in changed if path)


_STORED_NOTEBOOK = re.compile(r"notebooks/[^/]+\.ipynb")


def environment() -> dict:
    """Hardware, versions and commit (with a dirty flag), recorded with every result."""
    from . import __version__

    commit, dirty = git_commit()
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tinyk3": __version__,
        "commit": commit,
        "dirty": dirty,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }


def stamp(env: dict | None = None) -> str:
    """One line naming the commit (``+dirty`` when uncommitted changes were present), the
    versions and the hardware, for a printed result or a figure."""
    env = env or environment()
    commit = env["commit"] + ("+dirty" if env.get("dirty") else "")
    where = env["cuda"] if env["cuda"] != "none" else f"{env['processor']}, {env['threads']} thread(s)"
    return f"tinyk3 {env['tinyk3']} @ {commit}, torch {env['torch']}, {where}"


def matmul_flops(n: int = 512, dtype=torch.float32, repeats: int = 10, device: str = "cpu") -> float:
    """FLOP/s of an ``n × n`` by ``n × n`` matrix product on this machine (``2n³`` flops)."""
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    seconds = time_fn(lambda: a @ b, repeats=repeats, warmup=2, cuda=device == "cuda")
    return 2 * n**3 / seconds



# rule -> fla's code for it: (module, name) of its reference chunked form (CPU) and of its
# Triton kernel (GPU), and whether it takes a gate (fla's order: g before beta). A rule added to
# tinyk3.ops is one more row here.
FLA_CODE = {
    "delta_rule": (("fla.ops.delta_rule.naive", "delta_rule_chunkwise"),
                   ("fla.ops.delta_rule", "chunk_delta_rule"), False),
    "gated_delta_rule": (("fla.ops.gated_delta_rule.naive", "naive_chunk_gated_delta_rule"),
                         ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), True),
    "kda": (("fla.ops.kda.naive", "naive_chunk_kda"), ("fla.ops.kda", "chunk_kda"), True),
}
RULES = tuple(FLA_CODE)
GATE_SHAPES = {"delta_rule": None, "gated_delta_rule": "head", "kda": "channel"}


def _fla(rule: str, which: int):
    """fla's function (``which`` 0: the reference chunked form, 1: the kernel) and whether it
    is gated, or ``(None, gated)`` when fla is not installed or its import fails."""
    import importlib

    *code, gated = FLA_CODE[rule]
    module, name = code[which]
    try:
        return getattr(importlib.import_module(module), name), gated
    except Exception:  # not installed, or its import fails (it needs triton)
        return None, gated


def fla_chunkwise(rule: str = "delta_rule"):
    """fla's reference chunked code for ``rule``, as a function of our arguments
    ``(q, k, v, beta, g, chunk_size)`` in our layout, or ``None`` when flash-linear-attention is not
    installed. ``delta_rule``: ``delta_rule_chunkwise`` (layout ``[B, H, T, D]``);
    ``gated_delta_rule``: ``naive_chunk_gated_delta_rule`` (``[B, T, H, D]``, and ``g`` before
    ``beta``); ``kda``: ``naive_chunk_kda`` (``[B, T, H, D]``, ``T`` a multiple of the chunk). The
    transposes to fla's layout are done once, outside the timed call (:func:`bench_delta_rule`). fla
    scales ``q`` by ``Dk^-0.5``, which does not change its speed."""
    f, gated = _fla(rule, 0)
    if f is None:
        return None
    if gated:
        return lambda q, k, v, beta, g, C: f(q, k, v, g, beta, chunk_size=C)
    return lambda q, k, v, beta, g, C: f(q, k, v, beta, chunk_size=C)


def fla_chunk_kernel(rule: str = "delta_rule"):
    """fla's Triton kernel for ``rule`` (GPU only: ``chunk_delta_rule``, ``chunk_gated_delta_rule``,
    ``chunk_kda``), as a function of ``(q, k, v, beta, g)`` in fla's layout ``[B, T, H, D]``
    with ``scale=1.0``, or ``None`` without fla."""
    f, gated = _fla(rule, 1)
    if f is None:
        return None
    if gated:
        return lambda q, k, v, beta, g: f(q, k, v, g, beta, scale=1.0)
    return lambda q, k, v, beta, g: f(q, k, v, beta, scale=1.0)


def triton_chunked(rule: str = "delta_rule"):
    """``tinyk3.kernels.<rule>.chunked``, or ``None`` without Triton (or without that kernel)."""
    from . import kernels

    if not kernels.AVAILABLE:
        return None
    return getattr(getattr(kernels, rule, None), "chunked", None)


def _rule_inputs(rule, B, H, T, D, seed):
    """q, k (unit rows), v, β ∈ (0, 1) and, for the gated rules, log decays in (−1, 0)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(B, H, T, generator=g)
    shape = {None: None, "head": (B, H, T), "channel": (B, H, T, D)}[GATE_SHAPES[rule]]
    gate = None if shape is None else -torch.rand(*shape, generator=g)
    return q, k, v, beta, gate


def bench_delta_rule(Ts=(256, 1024, 4096), *, B=1, H=4, D=64, chunk_sizes=(16, 32, 64, 128),
                     loop_max_T=1024, repeats=3, dtype=torch.float32, fla=False, triton=None,
                     sdpa=None, device="cpu", rule="delta_rule") -> list[dict]:
    """Time the forms of ``rule`` (``"delta_rule"``, ``"gated_delta_rule"``, ``"kda"``); returns one
    row per (form, T, C), with a ``rule`` column.

    ``fla=True`` adds fla's code: its reference chunked code on CPU (``fla_naive``, chunk sizes
    that divide ``T``), its Triton kernel on a GPU (``fla_chunk``, its own chunk size, 64).
    ``triton`` adds the Triton kernel (chunk sizes 16, 32, 64; on CPU under the interpreter),
    ``sdpa`` causal softmax attention; both default to on for ``device="cuda"``, off on CPU.
    A form whose package is missing is skipped with a message. The FLOP rate of every chunked
    form uses the delta rule's count (:func:`tinyk3.cost.chunked_delta_rule_flops`): the gates add
    elementwise work only, so the gated rules' rates are the rate of the same matrix products.
    """
    from . import ops

    if rule not in RULES:
        raise ValueError(f"bench_delta_rule: rule must be one of {RULES}, got {rule!r}")
    op = getattr(ops, rule)
    gated = rule != "delta_rule"
    device = torch.device(device).type
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench_delta_rule: device='cuda' but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"bench_delta_rule: device must be 'cpu' or 'cuda', got {device!r}")
    on_gpu = device == "cuda"
    triton = on_gpu if triton is None else triton
    sdpa = on_gpu if sdpa is None else sdpa
    fla_fn = (fla_chunk_kernel(rule) if on_gpu else fla_chunkwise(rule)) if fla else None
    if fla and fla_fn is None:
        print("# fla (flash-linear-attention) is not installed: skipping the fla rows")
    triton_fn = triton_chunked(rule) if triton else None
    if triton and triton_fn is None:
        from . import kernels

        print(f"# skipping the triton rows of {rule}: "
              f"{kernels.REASON if not kernels.AVAILABLE else 'no kernel for this rule'}")
    if triton_fn is not None and not on_gpu:
        print("# triton rows on CPU run under the Triton interpreter: a correctness path, not a speed")
    rows = []
    for T in Ts:
        q, k, v, beta, gate = _rule_inputs(rule, B, H, T, D, seed=T)
        q, k, v, beta = (t.to(device=device, dtype=dtype) for t in (q, k, v, beta))
        if gated:
            gate = gate.to(device=device, dtype=dtype)
        args = (q, k, v, beta, gate) if gated else (q, k, v, beta)
        forms = [("recurrent", 1)] if T <= loop_max_T else []
        forms += [("chunked", C) for C in chunk_sizes]
        if triton_fn is not None:
            forms += [("triton", C) for C in chunk_sizes if C in (16, 32, 64)]
        if fla_fn is not None:
            forms += [("fla_chunk", 64)] if on_gpu else [("fla_naive", C) for C in chunk_sizes if T % C == 0]
        if sdpa:
            forms += [("sdpa", T)]
        fla_args = (q, k, v, beta, gate)  # fla's delta-rule code takes our layout [B, H, T, D]
        if fla_fn is not None and (gated or on_gpu):  # the others take [B, T, H, D]
            fla_args = tuple(None if x is None else x.transpose(1, 2).contiguous() for x in fla_args)
        with torch.no_grad():
            for name, C in forms:
                if name == "recurrent":
                    fn = lambda: op.recurrent(*args)  # noqa: E731, B023
                elif name == "chunked":
                    fn = lambda: op.chunked(*args, chunk_size=C)  # noqa: E731, B023
                elif name == "triton":
                    fn = lambda: triton_fn(*args, chunk_size=C)  # noqa: E731, B023
                elif name == "fla_naive":
                    fn = lambda: fla_fn(*fla_args, C)  # noqa: E731, B023
                elif name == "fla_chunk":
                    fn = lambda: fla_fn(*fla_args)  # noqa: E731, B023
                else:  # sdpa
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                        q, k, v, is_causal=True)  # noqa: B023
                seconds = time_fn(fn, repeats=repeats, cuda=on_gpu)
                if name == "recurrent":
                    flops = 0.0
                elif name == "sdpa":
                    flops = B * H * sdpa_flops(T, D)
                else:
                    flops = B * H * chunked_delta_rule_flops(T, D, C, Dv=D)
                rows.append({"rule": rule, "form": name, "T": T, "C": C, "B": B, "H": H, "D": D,
                             "dtype": str(dtype).replace("torch.", ""), "device": device,
                             "seconds": seconds, "tokens_per_s": B * T / seconds,
                             "gflops_per_s": flops / seconds / 1e9})
    return rows


def bench_backward(Ts=(1024, 4096), *, B=1, H=4, D=64, C=64, repeats=3, dtype=torch.float32,
                   device="cpu", rule="delta_rule") -> list[dict]:
    """Forward + backward of ``ops.<rule>.chunked`` with ``backward="derived"`` and with
    ``backward="autograd"``: one row per (form, T) with the time (one statistic, :func:`time_fn`)
    and ``kept_bytes``, what autograd holds between the two passes beyond the inputs' storages.
    The loss is ``⟨o, dO⟩ + ⟨S_T, dS⟩`` with fixed random ``dO``, ``dS``; every input requires a
    gradient. Rows of one T also carry ``kept_ratio`` and ``speedup`` (derived against autograd).
    """
    from . import ops
    from .grad_memory import saved_bytes

    if rule not in RULES:
        raise ValueError(f"bench_backward: rule must be one of {RULES}, got {rule!r}")
    op = getattr(ops, rule)
    rows = []
    for T in Ts:
        q, k, v, beta, gate = _rule_inputs(rule, B, H, T, D, seed=T)
        args = [t.to(device=device, dtype=dtype) for t in (q, k, v, beta, gate) if t is not None]
        leaves = [t.requires_grad_() for t in args]
        gen = torch.Generator().manual_seed(T + 1)
        dO = torch.randn(B, H, T, D, generator=gen).to(device=device, dtype=dtype)
        dS = torch.randn(B, H, D, D, generator=gen).to(device=device, dtype=torch.float32)
        pair = {}
        for mode in ("derived", "autograd"):
            def step(mode=mode, leaves=leaves, dO=dO, dS=dS):
                o, S = op.chunked(*leaves, chunk_size=C, backward=mode)
                return torch.autograd.grad((o * dO).sum() + (S * dS).sum(), leaves)

            kept = saved_bytes(lambda *xs, m=mode: op.chunked(*xs, chunk_size=C, backward=m),
                               *leaves)
            seconds = time_fn(step, repeats=repeats, cuda=device == "cuda")
            pair[mode] = {"rule": rule, "form": mode, "T": T, "C": C, "B": B, "H": H, "D": D,
                          "dtype": str(dtype).replace("torch.", ""), "device": device,
                          "seconds": seconds, "tokens_per_s": B * T / seconds,
                          "kept_bytes": kept.bytes, "input_bytes": kept.input_bytes}
        for r in pair.values():
            r["kept_ratio"] = pair["derived"]["kept_bytes"] / pair["autograd"]["kept_bytes"]
            r["speedup"] = pair["autograd"]["seconds"] / pair["derived"]["seconds"]
        rows += list(pair.values())
    return rows


def _print_table(rows: list[dict], keys: list[str]) -> None:
    widths = [max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(k)).rjust(w) for k, w in zip(keys, widths)))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _save(rows: list[dict], env: dict, csv_path: str | None, json_path: str | None) -> None:
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            for key, value in env.items():  # provenance first, as comment lines
                f.write(f"# {key}: {value}\n")
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if json_path:
        Path(json_path).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))


_NO_CHUNK_SIZE = ("recurrent", "sdpa", "fla_chunk")  # forms whose C column is not a chunk size we chose


def _plot(rows: list[dict], env: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series: dict[str, list] = {}  # one line per form and chunk size; sdpa, recurrent, fla_chunk per form
    several = len({r.get("rule", "delta_rule") for r in rows}) > 1
    for r in rows:
        label = r["form"] if r["form"] in _NO_CHUNK_SIZE else f"{r['form']}, C={r['C']}"
        if several:
            label = f"{r.get('rule', 'delta_rule')}: {label}"
        series.setdefault((r["form"], 0 if r["form"] in _NO_CHUNK_SIZE else r["C"], label), []).append(
            (r["T"], r["tokens_per_s"]))
    styles = {"chunked": "o-", "triton": "s-", "fla_naive": "^--", "fla_chunk": "^--", "sdpa": "k*-",
              "recurrent": "kx:"}
    for (form, _, label), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(form, "o-"), label=label)
    rules = ", ".join(sorted({r.get("rule", "delta_rule") for r in rows}))
    where = env["cuda"] if env.get("device") == "cuda" else env["processor"]
    ax.set(xscale="log", yscale="log", xlabel="T", ylabel="tokens / s",
           title=f"{rules} forward, {where}, {env.get('dtype', 'float32')}, torch {env['torch']}")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.text(0.01, 0.01, stamp(env), fontsize=7)
    fig.savefig(path, bbox_inches="tight", dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tinyk3.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=[*RULES, "matmul"], nargs="*", default=["delta_rule"],
                    help="the rules to time (several in one run share one matmul rate), or matmul")
    ap.add_argument("--T", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--C", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS or 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loop-max-T", type=int, default=1024, help="time the token loop up to this T")
    ap.add_argument("--fla", action="store_true",
                    help="also time fla's code: its reference chunked form on CPU, chunk_delta_rule on a GPU")
    ap.add_argument("--triton", action=argparse.BooleanOptionalAction, default=None,
                    help="time chapter 9's Triton kernel (default: on a GPU only; on CPU it is interpreted)")
    ap.add_argument("--sdpa", action=argparse.BooleanOptionalAction, default=None,
                    help="time causal softmax attention at the same shapes (default: on a GPU only)")
    ap.add_argument("--backward", action="store_true",
                    help="time forward+backward of chunked, derived backward against autograd, "
                         "and the bytes each keeps (one chunk size: the first --C)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--csv")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    dtype = getattr(torch, args.dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    env = environment()
    env["device"], env["dtype"] = args.device, args.dtype
    print("# " + ", ".join(f"{k}={v}" for k, v in env.items()))
    # the reachable matmul rate: 512x512 float32 on one CPU core, 4096x4096 in the run's dtype on a GPU
    n_peak, dtype_peak = (4096, dtype) if args.device == "cuda" else (512, torch.float32)
    label = f"matmul {n_peak}x{n_peak} {str(dtype_peak).replace('torch.', '')}"
    peak = matmul_flops(n_peak, dtype_peak, device=args.device)
    print(f"# {label}: {peak / 1e9:.1f} GFLOP/s")
    if "matmul" in args.what and len(args.what) > 1:
        ap.error("matmul is timed alone")
    if args.what == ["matmul"]:
        rows = [{"n": n, "gflops_per_s": matmul_flops(n, dtype_peak, device=args.device) / 1e9}
                for n in (64, 128, 256, 512, 1024)]
        _print_table(rows, ["n", "gflops_per_s"])
    elif args.backward:
        rows = []
        for rule in args.what:
            rows += bench_backward(args.T, B=args.B, H=args.H, D=args.D, C=args.C[0],
                                   repeats=args.repeats, dtype=dtype, device=args.device, rule=rule)
        _print_table(rows, ["rule", "form", "T", "C", "seconds", "tokens_per_s", "kept_bytes",
                            "kept_ratio", "speedup"])
    else:
        rows = []
        for rule in args.what:
            rows += bench_delta_rule(args.T, B=args.B, H=args.H, D=args.D, chunk_sizes=args.C,
                                     loop_max_T=args.loop_max_T, repeats=args.repeats, fla=args.fla,
                                     triton=args.triton, sdpa=args.sdpa, device=args.device,
                                     dtype=dtype, rule=rule)
        # measured again after the forms, and the higher rate kept: on a shared machine a busy
        # moment lowers one measurement, and a fraction of a rate that is too low flatters
        after = matmul_flops(n_peak, dtype_peak, device=args.device)
        print(f"# {label} after the forms: {after / 1e9:.1f} GFLOP/s")
        peak = max(peak, after)
        for r in rows:
            r["fraction_of_matmul"] = r["gflops_per_s"] * 1e9 / peak if r["gflops_per_s"] else 0.0
        keys = ["rule", "form", "T", "C", "seconds", "tokens_per_s", "gflops_per_s",
                "fraction_of_matmul"]
        _print_table(rows, keys)
        if args.plot:
            _plot(rows, env, args.plot)
    env["matmul_gflops_per_s"] = round(peak / 1e9, 2)
    env["matmul"] = label
    _save(rows, env, args.csv, args.json)


if __name__ == "__main__":
    main()
