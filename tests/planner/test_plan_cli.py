"""`moeserve plan` end to end through the parser moeserve/cli.py builds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SEED = ["--gpu", "GB300", "--weight-dtype", "fp4", "--kv-dtype", "fp8", "--tp", "16", "--ep", "16",
        "--weights-gb-per-gpu", "40", "--isl", "128000", "--osl", "8000", "--mem-fraction-static", "0.75"]


def run(parser, argv, capsys):
    args = parser.parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_capacity_json_has_the_issue_keys(plan_parser, capsys):
    code, out, _ = run(plan_parser, ["plan", "capacity", *SEED, "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    for key in ("kv_bytes_per_token", "kv_pool_gb", "kv_per_request_gib", "max_requests_per_gpu",
                "practical_requests_per_gpu", "total_concurrent_requests"):
        assert key in data
    assert data["kv_bytes_per_token"] == 35_136 and data["kv_pool_gb"] == 176
    assert data["kv_per_request_gib"] == pytest.approx(4.45, abs=0.005)
    assert round(data["max_requests_per_gpu"]) == 40
    assert data["layout"] == {"tp": 16, "ep": 16, "dp_attention": True, "gpus": 16}
    assert "GiB" in data["units"]["memory"]


def test_capacity_table_states_units(plan_parser, capsys):
    code, out, _ = run(plan_parser, ["plan", "capacity", "--gpu", "GB200", "--weight-dtype", "fp4",
                                     "--kv-dtype", "fp8", "--tp", "16", "--ep", "16"], capsys)
    assert code == 0
    assert "GiB" in out and "35,136 B" in out and "practical target" in out and "routed_experts" in out


def test_decode_json_and_plot(plan_parser, capsys, tmp_path):
    png = tmp_path / "decode.png"
    argv = ["plan", "decode", *SEED, "--batch-sizes", "1,16,36,64", "--mtp-accept-length", "2.37",
            "--plot", str(png), "--json"]
    code, out, _ = run(plan_parser, argv, capsys)
    assert code == 0
    data = json.loads(out)
    assert [r["batch_size"] for r in data["rows"]] == [1, 16, 36, 64]
    assert len(data["mtp_rows"]) == 4 and data["mtp"]["accept_length"] == 2.37
    assert data["context_tokens"] == 132_000
    assert [r["fits_kv"] for r in data["rows"]] == [True, True, True, False]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_table(plan_parser, capsys):
    code, out, _ = run(plan_parser, ["plan", "decode", "--gpu", "H200", "--model-config", "deepseek-v2-lite",
                                     "--isl", "1000", "--osl", "2000", "--batch-sizes", "1,64"], capsys)
    assert code == 0 and "TPS/GPU" in out and "memory" in out


def test_cuda_graphs_from_prometheus_file(plan_parser, capsys, tmp_path):
    metrics = tmp_path / "metrics.txt"
    lines = [f'moeserve:decode_batch_size_bucket{{le="{b}"}} {c}' for b, c in ((128, 10), (256, 40), (512, 100))]
    metrics.write_text("\n".join([*lines, 'moeserve:decode_batch_size_bucket{le="+Inf"} 100']) + "\n")
    code, out, _ = run(plan_parser, ["plan", "cuda-graphs", "--histogram", str(metrics), "--max-graphs", "8",
                                     "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert [s["name"] for s in data["sets"]] == ["x2", "+64", "+8"]
    assert [s["num_graphs"] for s in data["sets"]] == [23, 49, 259]
    assert data["optimized"]["num_graphs"] <= 8 and data["optimized"]["sizes"][-1] == 512
    assert data["distribution"]["max"] == 512


def test_cuda_graphs_table_with_synthetic_distribution(plan_parser, capsys, tmp_path):
    png = tmp_path / "graphs.png"
    argv = ["plan", "cuda-graphs", "--distribution", "uniform:100-700", "--model-config", "deepseek-v3",
            "--kv-dtype", "fp8", "--plot", str(png)]
    code, out, _ = run(plan_parser, argv, capsys)
    assert code == 0 and "optimal<=23" in out and "KV tokens lost" in out
    assert png.exists()


@pytest.mark.parametrize(
    "argv, match",
    [(["plan", "capacity", "--gpu", "A100"], "unknown GPU"),
     (["plan", "capacity", "--gpu", "H100"], "do not fit"),
     (["plan", "cuda-graphs", "--distribution", "zipf:2"], "unknown distribution"),
     (["plan", "decode", "--gpu", "H200", "--model-config", "deepseek-v2-lite", "--mtp-accept-length", "9"],
      "accept-length")],
)
def test_bad_input_exits_2_with_one_line(plan_parser, capsys, argv, match):
    code, _, err = run(plan_parser, argv, capsys)
    assert code == 2 and match in err and "Traceback" not in err


def test_cli_does_not_import_torch_or_matplotlib():
    code = (
        "import sys; from moeserve.planner.cli import main; "
        "main(['plan', 'capacity', '--gpu', 'GB300', '--tp', '16', '--ep', '16', '--json']); "
        "bad = [m for m in ('torch', 'matplotlib') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total_gpus"] == 16


@pytest.mark.parametrize("sub", [["decode", "--gpu", "H200", "--model-config", "deepseek-v2-lite"],
                                 ["cuda-graphs", "--distribution", "uniform:1-512", "--max-graphs", "40"]])
def test_plots_are_png_files(plan_parser, capsys, tmp_path, sub):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    code, _, _ = run(plan_parser, ["plan", *sub, "--plot", str(png)], capsys)
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
