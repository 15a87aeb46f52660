"""The benchmark command runs and records where it ran (timings are never asserted here)."""

from __future__ import annotations

import csv
import json

from tinyk3 import bench


def test_delta_rule_flop_count_matches_the_closed_form():
    """FACTS.md: chunked DeltaNet ≈ 6LD² + 10LCD + LC²/3 per head (L = T, Dk = Dv = D)."""
    for T, D, C in [(4096, 64, 64), (1024, 32, 16), (640, 128, 128)]:
        closed_form = 6 * T * D * D + 10 * T * C * D + T * C * C / 3
        assert abs(bench.delta_rule_flops(T, D, D, C) - closed_form) < 1e-6


def test_bench_command_writes_csv_json_and_plot_with_provenance(tmp_path):
    out = tmp_path / "b.csv"
    js = tmp_path / "b.json"
    png = tmp_path / "b.png"
    bench.main(["delta_rule", "--T", "32", "64", "--C", "16", "--B", "1", "--H", "1", "--D", "8",
                "--repeats", "1", "--csv", str(out), "--json", str(js), "--plot", str(png)])
    lines = out.read_text().splitlines()
    meta = [line for line in lines if line.startswith("# ")]
    assert any(line.startswith("# commit: ") for line in meta)
    assert any(line.startswith("# torch: ") for line in meta)
    assert any(line.startswith("# matmul_gflops_per_s: ") for line in meta)
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert {(r["form"], r["T"], r["C"]) for r in rows} == {
        ("recurrent", "32", "1"), ("recurrent", "64", "1"), ("chunked", "32", "16"), ("chunked", "64", "16")}
    assert all(float(r["seconds"]) > 0 for r in rows)
    data = json.loads(js.read_text())
    assert data["environment"]["threads"] >= 1 and len(data["rows"]) == 4
    assert png.stat().st_size > 1000


def test_time_fn_returns_the_median():
    calls = []
    seconds = bench.time_fn(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7 and seconds >= 0


def test_fla_rows_are_optional(monkeypatch, capsys):
    """--fla without flash-linear-attention installed: a message, and no fla rows."""
    monkeypatch.setattr(bench, "fla_chunkwise", lambda: None)
    rows = bench.bench_delta_rule((32,), B=1, H=1, D=8, chunk_sizes=(16,), repeats=1, fla=True)
    assert "fla (flash-linear-attention) is not installed" in capsys.readouterr().out
    assert {r["form"] for r in rows} == {"recurrent", "chunked"}


def test_fla_rows_when_a_chunkwise_function_is_available(monkeypatch):
    """With an fla function (a stand-in here), one fla_naive row per chunk size that divides T."""
    from tinyk3.ops import delta_rule

    def stand_in(q, k, v, beta, chunk_size=32):
        return delta_rule.chunked(q, k, v, beta, chunk_size=chunk_size)

    monkeypatch.setattr(bench, "fla_chunkwise", lambda: stand_in)
    rows = bench.bench_delta_rule((48,), B=1, H=1, D=8, chunk_sizes=(16, 32), repeats=1, fla=True)
    assert {(r["form"], r["C"]) for r in rows if r["form"] == "fla_naive"} == {("fla_naive", 16)}
