"""The benchmark command runs and records where it ran (timings are never asserted here)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from tinyk3 import bench

# Reaches Triton, tinyk3.kernels or fla: rerun with Triton hidden by `make unit-no-triton`.
pytestmark = pytest.mark.triton


def test_delta_rule_flop_count_matches_the_closed_form():
    """Summed over T/C chunks, the per-chunk count is 6TD² + 10TCD + TC²/3 per head (Dk = Dv = D)."""
    from tinyk3 import cost

    for T, D, C in [(4096, 64, 64), (1024, 32, 16), (640, 128, 128)]:
        closed_form = 6 * T * D * D + 10 * T * C * D + T * C * C / 3
        assert abs(cost.chunked_delta_rule_flops(T, D, C) - closed_form) < 1e-6
        assert cost.chunked_delta_rule_flops(T, D, C, Dv=D) == cost.chunked_delta_rule_flops(T, D, C)


def test_bench_command_writes_csv_json_and_plot_with_provenance(tmp_path):
    out = tmp_path / "b.csv"
    js = tmp_path / "b.json"
    png = tmp_path / "b.png"
    bench.main(["delta_rule", "--T", "32", "64", "--C", "16", "--B", "1", "--H", "1", "--D", "8",
                "--repeats", "1", "--csv", str(out), "--json", str(js), "--plot", str(png)])
    lines = out.read_text().splitlines()
    meta = [line for line in lines if line.startswith("# ")]
    assert any(line.startswith("# commit: ") for line in meta)
    assert any(line.startswith("# dirty: ") for line in meta)
    assert any(line.startswith("# torch: ") for line in meta)
    assert any(line.startswith("# matmul_gflops_per_s: ") for line in meta)
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert {(r["form"], r["T"], r["C"]) for r in rows} == {
        ("recurrent", "32", "1"), ("recurrent", "64", "1"), ("chunked", "32", "16"), ("chunked", "64", "16")}
    assert all(float(r["seconds"]) > 0 for r in rows)
    data = json.loads(js.read_text())
    assert data["environment"]["threads"] >= 1 and len(data["rows"]) == 4
    assert png.stat().st_size > 1000


def test_bench_times_with_the_one_timing_helper():
    from tinyk3 import timing

    assert bench.time_fn is timing.time_fn


def test_fla_rows_are_optional(monkeypatch, capsys):
    """--fla without flash-linear-attention installed: a message, and no fla rows."""
    monkeypatch.setattr(bench, "fla_chunkwise", lambda rule="delta_rule": None)
    rows = bench.bench_delta_rule((32,), B=1, H=1, D=8, chunk_sizes=(16,), repeats=1, fla=True)
    assert "fla (flash-linear-attention) is not installed" in capsys.readouterr().out
    assert {r["form"] for r in rows} == {"recurrent", "chunked"}


def test_fla_rows_when_a_chunkwise_function_is_available(monkeypatch):
    """With an fla function (a stand-in here), one fla_naive row per chunk size that divides T."""
    from tinyk3.ops import delta_rule

    def stand_in(q, k, v, beta, g, C):  # fla_chunkwise's calling convention
        return delta_rule.chunked(q, k, v, beta, chunk_size=C)

    monkeypatch.setattr(bench, "fla_chunkwise", lambda rule="delta_rule": stand_in)
    rows = bench.bench_delta_rule((48,), B=1, H=1, D=8, chunk_sizes=(16, 32), repeats=1, fla=True)
    assert {(r["form"], r["C"]) for r in rows if r["form"] == "fla_naive"} == {("fla_naive", 16)}


def test_triton_and_sdpa_rows_on_cpu(capsys):
    """--triton on CPU runs chapter 9's kernel under the interpreter (chunk sizes 16, 32, 64 only);
    --sdpa adds causal softmax attention, with its own flop count."""
    from tinyk3 import kernels

    rows = bench.bench_delta_rule((40,), B=1, H=1, D=16, chunk_sizes=(16, 128), repeats=1, loop_max_T=0,
                                  triton=True, sdpa=True)
    forms = {(r["form"], r["C"]) for r in rows}
    assert ("sdpa", 40) in forms and ("chunked", 128) in forms
    sdpa = next(r for r in rows if r["form"] == "sdpa")
    assert sdpa["gflops_per_s"] == pytest.approx(bench.sdpa_flops(40, 16) / sdpa["seconds"] / 1e9)
    if kernels.AVAILABLE:
        assert ("triton", 16) in forms and ("triton", 128) not in forms
        assert "Triton interpreter" in capsys.readouterr().out
    else:
        assert not any(f == "triton" for f, _ in forms)


def test_triton_rows_skipped_with_a_message_without_triton(monkeypatch, capsys):
    monkeypatch.setattr(bench, "triton_chunked", lambda rule="delta_rule": None)
    rows = bench.bench_delta_rule((32,), B=1, H=1, D=8, chunk_sizes=(16,), repeats=1, triton=True)
    assert "skipping the triton rows" in capsys.readouterr().out
    assert {r["form"] for r in rows} == {"recurrent", "chunked"}


def test_cuda_without_a_gpu_fails_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        bench.bench_delta_rule((32,), device="cuda")
    with pytest.raises(SystemExit):
        bench.main(["delta_rule", "--device", "cuda"])


def test_gated_rules_share_one_run(tmp_path):
    """Several rules in one command: one matmul rate, a row per (rule, form, T, C), and fla's
    reference chunked code for each rule where fla is installed (T a multiple of C)."""
    js = tmp_path / "g.json"
    bench.main(["delta_rule", "gated_delta_rule", "kda", "--T", "32", "--C", "16", "--H", "1",
                "--D", "8", "--repeats", "1", "--fla", "--json", str(js)])
    rows = json.loads(js.read_text())["rows"]
    have = {(r["rule"], r["form"]) for r in rows}
    for rule in bench.RULES:
        assert {(rule, "recurrent"), (rule, "chunked")} <= have
        if bench.fla_chunkwise(rule) is not None:
            assert (rule, "fla_naive") in have
    assert all(r["seconds"] > 0 and "fraction_of_matmul" in r for r in rows)


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="rule must be one of"):
        bench.bench_delta_rule((32,), rule="mamba")


def test_git_commit_is_dirty_for_code_but_not_for_stored_notebook_outputs(tmp_path):
    import subprocess

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "notebooks" / "src").mkdir(parents=True)
    files = {"notebooks/01.ipynb": "{}", "notebooks/src/01.py": "x = 1", "lib.py": "y = 2"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert bench.git_commit(tmp_path)[1] is False
    (tmp_path / "notebooks/01.ipynb").write_text('{"outputs": 1}')  # a run stores its outputs
    assert bench.git_commit(tmp_path)[1] is False
    for name in ("notebooks/src/01.py", "lib.py"):  # code is what makes a record dirty
        (tmp_path / name).write_text("changed")
        assert bench.git_commit(tmp_path)[1] is True
        git("checkout", "-q", "--", name)
    (tmp_path / "untracked.py").write_text("z = 3")  # untracked files do not count, as before
    assert bench.git_commit(tmp_path)[1] is False


def test_backward_mode_times_both_backwards_and_records_what_each_keeps(tmp_path):
    js = tmp_path / "bw.json"
    bench.main(["delta_rule", "kda", "--backward", "--T", "40", "--C", "16", "--H", "1",
                "--D", "8", "--repeats", "1", "--json", str(js)])
    data = json.loads(js.read_text())
    assert {"commit", "torch"} <= set(data["environment"])
    rows = data["rows"]
    assert [(r["rule"], r["form"]) for r in rows] == [
        ("delta_rule", "derived"), ("delta_rule", "autograd"), ("kda", "derived"),
        ("kda", "autograd")]
    for r in rows:
        assert r["seconds"] > 0 and r["kept_bytes"] > 0 and r["speedup"] > 0
        # the derived backward keeps the boundary states: 3 chunks of [8, 8] floats
        assert r["kept_ratio"] < 1
    assert rows[0]["kept_bytes"] == 3 * 8 * 8 * 4
