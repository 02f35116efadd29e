"""The clock / power sampler: parsing nvidia-smi's lines, the summary, and a real sampler process."""

import stat
import sys
import time

import pytest

from moeserve.bench import gpu_clocks
from moeserve.bench.gpu_clocks import GpuClocks, Sample, parse_samples, summarize


def test_parse_skips_what_does_not_parse():
    lines = [
        "1905, 694.59, 0x0000000000000004\n",
        "1980, 398.47, 0x0000000000000000",
        "[N/A], 398.47, 0x0000000000000000",  # a value nvidia-smi could not read
        "1755, 69",  # cut off when the sampler stopped
        "",
    ]
    assert parse_samples(lines) == [Sample(1905.0, 694.59, 4), Sample(1980.0, 398.47, 0)]


def test_summary_counts_power_cap_and_thermal_readings():
    samples = [Sample(1500.0 + 10 * i, 600.0 + i, 0x4 if i % 2 else 0x0) for i in range(20)]
    samples += [Sample(1400.0, 700.0, 0x80), Sample(1450.0, 650.0, 0x20)]
    s = summarize(samples)
    assert s["samples"] == 22
    clocks = sorted(x.sm_mhz for x in samples)
    assert s["sm_mhz_median"] == (clocks[10] + clocks[11]) / 2
    assert s["sm_mhz_p10"] == clocks[2]
    assert s["power_w_mean"] == pytest.approx(sum(x.power_w for x in samples) / 22, abs=0.05)
    assert s["power_capped_share"] == pytest.approx(11 / 22, abs=1e-3)  # ten 0x4 and one 0x80
    assert s["thermal_share"] == pytest.approx(1 / 22, abs=1e-3)
    assert summarize([]) is None


def test_no_gpu_means_no_sampler():
    # CI has no GPU: the default command is None and the block runs unsampled.
    if gpu_clocks.default_command() is not None:
        pytest.skip("a GPU and nvidia-smi are here")
    with GpuClocks() as clocks:
        pass
    assert clocks.summary is None


def test_samples_a_running_process(tmp_path):
    # A stand-in for nvidia-smi: one reading every 10 ms until it is stopped.
    fake = tmp_path / "fake_smi.py"
    fake.write_text(
        "import sys, time\n"
        "i = 0\n"
        "while True:\n"
        "    print(f'{1500 + 10 * (i % 3)}, {650.5 + i % 2}, 0x{4 if i % 2 else 0:016x}', flush=True)\n"
        "    i += 1\n"
        "    time.sleep(0.01)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with GpuClocks([sys.executable, str(fake)]) as clocks:
        time.sleep(0.5)
    s = clocks.summary
    assert s is not None and s["samples"] >= 5
    assert 1500 <= s["sm_mhz_p10"] <= s["sm_mhz_median"] <= 1520
    assert 650.5 <= s["power_w_mean"] <= 651.5
    assert 0.2 <= s["power_capped_share"] <= 0.8
    assert s["thermal_share"] == 0


def test_a_sampler_that_cannot_start_is_skipped(tmp_path):
    with GpuClocks([str(tmp_path / "missing-nvidia-smi")]) as clocks:
        pass
    assert clocks.summary is None


@pytest.mark.gpu
def test_samples_the_gpu_under_load():
    # On the GPU machine: nvidia-smi finds the card torch computes on and reads a live clock.
    import torch

    if gpu_clocks.default_command() is None:
        pytest.skip("no nvidia-smi")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with GpuClocks() as clocks:
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            a @ a
            torch.cuda.synchronize()
    s = clocks.summary
    assert s is not None and s["samples"] >= 3, clocks.command
    assert 500 < s["sm_mhz_median"] < 3000
    assert s["power_w_mean"] > 50
