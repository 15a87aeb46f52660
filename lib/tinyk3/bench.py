"""Benchmarks: ``python -m tinyk3.bench`` prints a table and can save CSV and a plot.

Performance claims in the course come from here, never from timed unit tests. Every file
written records the hardware, the versions and the git commit it was measured at.

    python -m tinyk3.bench delta_rule --T 1024 4096 --csv out.csv --plot out.png
    python -m tinyk3.bench matmul

Forms timed for the delta rule: the token loop (``recurrent``, up to ``--loop-max-T``) and
the chunked PyTorch form (``chunked``, several chunk sizes); with ``--fla``, also the reference
chunked code of flash-linear-attention (``fla.ops.delta_rule.naive.delta_rule_chunkwise``,
form ``fla_naive``), when fla is installed (it is optional: without it the rows are skipped
with a message). The matmul benchmark gives the machine's reachable FLOP/s, measured in the
same run, so the chunked form's FLOP rate can be read as a fraction of it (chapter 8).

    python -m tinyk3.bench delta_rule --T 4096 --C 32 64 128 --fla --csv out.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

__all__ = ["environment", "time_fn", "matmul_flops", "delta_rule_flops", "fla_chunkwise", "bench_delta_rule",
           "main"]


def environment() -> dict:
    """Hardware, versions and commit, recorded with every result."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5, cwd=Path(__file__).parent).stdout.strip()
    except Exception:  # pragma: no cover - no git
        commit = ""
    from . import __version__

    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tinyk3": __version__,
        "commit": commit or "unknown",
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }


def time_fn(fn, *, repeats: int = 5, warmup: int = 1, min_seconds: float = 0.0) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def matmul_flops(n: int = 512, dtype=torch.float32, repeats: int = 10) -> float:
    """FLOP/s of an ``n × n`` by ``n × n`` matrix product on this machine (``2n³`` flops)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = time_fn(lambda: a @ b, repeats=repeats, warmup=2)
    return 2 * n**3 / seconds


def delta_rule_flops(T: int, Dk: int, Dv: int, C: int) -> float:
    """Matmul flops of the chunked delta rule, per head (counted from ``ops.delta_rule.chunked``).

    Per chunk of ``C`` tokens: ``K Kᵀ`` (2C²Dk), inverting the unit triangular ``C × C``
    matrix (C³/3), ``W = T K`` and ``U = T V`` (2C²(Dk + Dv)), ``Q Kᵀ`` (2C²Dk), ``W S``,
    ``Q S`` and ``Kᵀ U'`` (2C·Dk·Dv each) and ``(QKᵀ ⊙ M) U'`` (2C²Dv). Dense counts: the
    masked products do the full work in PyTorch. (FACTS.md's ≈ 6LD² + 10LCD + LC²/3 per head
    is the same count for Dk = Dv = D, with these terms summed over T/C chunks.)
    """
    n_chunks = -(-T // C)
    per_chunk = (2 * C * C * Dk + C**3 / 3 + 2 * C * C * (Dk + Dv) + 2 * C * C * Dk
                 + 3 * 2 * C * Dk * Dv + 2 * C * C * Dv)
    return n_chunks * per_chunk


def fla_chunkwise():
    """fla's reference chunked delta rule (``delta_rule_chunkwise(q, k, v, beta, chunk_size)``),
    or ``None`` when flash-linear-attention is not installed. It scales ``q`` by ``Dk^-0.5``
    and needs ``T`` to be a multiple of the chunk size; neither changes its speed."""
    try:
        from fla.ops.delta_rule.naive import delta_rule_chunkwise
    except Exception:  # not installed, or its import fails (it needs triton)
        return None
    return delta_rule_chunkwise


def bench_delta_rule(Ts=(256, 1024, 4096), *, B=1, H=4, D=64, chunk_sizes=(16, 32, 64, 128),
                     loop_max_T=1024, repeats=3, dtype=torch.float32, fla=False) -> list[dict]:
    """Time the delta-rule forms; returns one row per (form, T, C).

    ``fla=True`` adds fla's reference chunked code (form ``fla_naive``) where fla is installed
    and ``C`` divides ``T``; without fla a message is printed and those rows are skipped.
    """
    from .ops import delta_rule

    fla_fn = fla_chunkwise() if fla else None
    if fla and fla_fn is None:
        print("# fla (flash-linear-attention) is not installed: skipping the fla_naive rows")
    rows = []
    for T in Ts:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))
        k = torch.nn.functional.normalize(k, dim=-1)
        beta = torch.rand(B, H, T, generator=g, dtype=dtype)
        forms = [("recurrent", 1)] if T <= loop_max_T else []
        forms += [("chunked", C) for C in chunk_sizes]
        if fla_fn is not None:
            forms += [("fla_naive", C) for C in chunk_sizes if T % C == 0]
        with torch.no_grad():
            for name, C in forms:
                if name == "recurrent":
                    seconds = time_fn(lambda: delta_rule.recurrent(q, k, v, beta), repeats=repeats)  # noqa: B023
                elif name == "fla_naive":
                    seconds = time_fn(lambda: fla_fn(q, k, v, beta, chunk_size=C), repeats=repeats)  # noqa: B023
                else:
                    seconds = time_fn(lambda: delta_rule.chunked(q, k, v, beta, chunk_size=C),  # noqa: B023
                                      repeats=repeats)
                flops = B * H * delta_rule_flops(T, D, D, C) if name != "recurrent" else 0.0
                rows.append({"form": name, "T": T, "C": C, "B": B, "H": H, "D": D, "seconds": seconds,
                             "tokens_per_s": B * T / seconds, "gflops_per_s": flops / seconds / 1e9})
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


def _plot(rows: list[dict], env: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (form, C) in sorted({(r["form"], r["C"]) for r in rows}):
        pts = sorted((r["T"], r["tokens_per_s"]) for r in rows if r["form"] == form and r["C"] == C)
        label = form if form == "recurrent" else f"{form}, C={C}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="T", ylabel="tokens / s",
           title=f"delta rule forward, {env['processor']}, {env['threads']} thread(s), torch {env['torch']}")
    ax.legend()
    fig.text(0.01, 0.01, f"tinyk3 {env['tinyk3']} @ {env['commit']}", fontsize=7)
    fig.savefig(path, bbox_inches="tight", dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tinyk3.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["delta_rule", "matmul"], nargs="?", default="delta_rule")
    ap.add_argument("--T", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--C", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS or 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loop-max-T", type=int, default=1024, help="time the token loop up to this T")
    ap.add_argument("--fla", action="store_true",
                    help="also time fla's reference chunked code (skipped if fla is not installed)")
    ap.add_argument("--csv")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    env = environment()
    print("# " + ", ".join(f"{k}={v}" for k, v in env.items()))
    peak = matmul_flops()
    print(f"# matmul 512x512 float32: {peak / 1e9:.1f} GFLOP/s")
    if args.what == "matmul":
        rows = [{"n": n, "gflops_per_s": matmul_flops(n) / 1e9} for n in (64, 128, 256, 512, 1024)]
        _print_table(rows, ["n", "gflops_per_s"])
    else:
        rows = bench_delta_rule(args.T, B=args.B, H=args.H, D=args.D, chunk_sizes=args.C,
                                loop_max_T=args.loop_max_T, repeats=args.repeats, fla=args.fla)
        # measured again after the forms, and the higher rate kept: on a shared machine a busy
        # moment lowers one measurement, and a fraction of a rate that is too low flatters
        after = matmul_flops()
        print(f"# matmul 512x512 float32 after the delta-rule forms: {after / 1e9:.1f} GFLOP/s")
        peak = max(peak, after)
        for r in rows:
            r["fraction_of_matmul"] = r["gflops_per_s"] * 1e9 / peak if r["gflops_per_s"] else 0.0
        keys = ["form", "T", "C", "seconds", "tokens_per_s", "gflops_per_s", "fraction_of_matmul"]
        _print_table(rows, keys)
        if args.plot:
            _plot(rows, env, args.plot)
    env["matmul_gflops_per_s"] = round(peak / 1e9, 2)
    _save(rows, env, args.csv, args.json)


if __name__ == "__main__":
    main()
