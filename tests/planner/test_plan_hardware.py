"""GPU presets and --gpu-spec files."""

from __future__ import annotations

import json

import pytest

from moeserve.planner.hardware import PRESETS, GpuSpec, load_gpu_spec, resolve_gpu


def test_every_issue_preset_exists_with_datasheet_figures():
    assert set(PRESETS) == {"H20", "H800", "H100", "H200", "B200", "GB200", "GB300"}
    for spec in PRESETS.values():
        assert spec.hbm_gb > 0 and spec.hbm_tb_s > 0 and spec.nvlink_gb_s > 0 and spec.network_gb_s > 0
        assert spec.fp8_tflops == pytest.approx(2 * spec.bf16_tflops, rel=0.01)


def test_fp4_only_on_blackwell_and_falls_back_to_fp8_elsewhere():
    hopper = ("H20", "H800", "H100", "H200")
    assert all(PRESETS[n].fp4_tflops is None for n in hopper)
    assert all(PRESETS[n].fp4_tflops > PRESETS[n].fp8_tflops for n in ("B200", "GB200", "GB300"))
    assert PRESETS["H100"].peak_tflops("fp4") == PRESETS["H100"].fp8_tflops


def test_seed_000_capacities_and_nvl72_domains():
    assert PRESETS["GB300"].hbm_gb == 288 and PRESETS["GB200"].hbm_gb == 192
    assert PRESETS["GB300"].nvlink_domain == 72 and PRESETS["H200"].nvlink_domain == 8
    assert PRESETS["H800"].nvlink_gb_s < PRESETS["H100"].nvlink_gb_s


def test_resolve_is_case_insensitive_and_names_presets_on_error():
    assert resolve_gpu("gb300") is PRESETS["GB300"]
    with pytest.raises(ValueError, match="H20, H800"):
        resolve_gpu("A100")
    with pytest.raises(ValueError, match="--gpu"):
        resolve_gpu(None)


def test_gpu_spec_file_round_trips(tmp_path):
    spec = PRESETS["H200"].to_dict() | {"name": "MI-x", "hbm_gb": 256, "fp4_tflops": None}
    path = tmp_path / "mi.json"
    path.write_text(json.dumps(spec))
    loaded = resolve_gpu("ignored", path)
    assert loaded == GpuSpec(**spec)


def test_gpu_spec_file_errors_name_the_problem(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"hbm_gb": 80, "hbm_tbs": 3}))
    with pytest.raises(ValueError, match="unknown keys.*hbm_tbs"):
        load_gpu_spec(path)
    path.write_text(json.dumps({"hbm_gb": 80}))
    with pytest.raises(ValueError, match="missing keys"):
        load_gpu_spec(path)
    good = PRESETS["H100"].to_dict() | {"hbm_gb": -1}
    path.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="hbm_gb must be a positive"):
        load_gpu_spec(path)
    with pytest.raises(ValueError, match="no such file"):
        load_gpu_spec(tmp_path / "missing.json")
