"""The GPU's SM clock, power draw and throttle reasons, sampled by nvidia-smi while a workload runs.

An H200 at its 700 W cap lowers its SM clock (b256 decode on the lent H200s: 1.5-1.95 GHz with
the software power cap set, where batch 1 keeps about 1.98 GHz), and how far it lowers it differs
from card to card. Two cards with the same kernels then differ by several percent at b256, so a
result row carries what the clock and the power were while it ran.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
# NVML's clocks-event reason bits.
POWER_CAP = 0x4 | 0x80  # software power cap, hardware power brake
THERMAL = 0x8 | 0x20 | 0x40  # hardware slowdown, software and hardware thermal slowdown


@dataclass(frozen=True)
class Sample:
    """One nvidia-smi reading."""

    sm_mhz: float
    power_w: float
    reasons: int


def parse_samples(lines: Iterable[str]) -> list[Sample]:
    """Readings from `--format=csv,noheader,nounits` lines of QUERY; lines that do not parse
    (a value of [N/A], a line cut off when the sampler stopped) are skipped."""
    samples = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            samples.append(Sample(float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except ValueError:
            continue
    return samples


def summarize(samples: Sequence[Sample]) -> dict | None:
    """Median and 10th-percentile SM clock, mean power, and the share of readings with the power
    cap or a thermal slowdown set; None without readings."""
    if not samples:
        return None
    clocks = sorted(s.sm_mhz for s in samples)
    return {
        "samples": len(samples),
        "sm_mhz_median": statistics.median(clocks),
        "sm_mhz_p10": clocks[len(clocks) // 10],
        "power_w_mean": round(statistics.fmean(s.power_w for s in samples), 1),
        "power_capped_share": round(sum(bool(s.reasons & POWER_CAP) for s in samples) / len(samples), 3),
        "thermal_share": round(sum(bool(s.reasons & THERMAL) for s in samples) / len(samples), 3),
    }


def default_command(interval_ms: int = 100) -> list[str] | None:
    """nvidia-smi sampling the device torch computes on, or None without a GPU or nvidia-smi."""
    import torch

    smi = shutil.which("nvidia-smi")
    if smi is None or not torch.cuda.is_available():
        return None
    command = [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"]
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    if uuid is None:
        return command
    # nvidia-smi numbers GPUs its own way; a UUID names the same card whatever CUDA_VISIBLE_DEVICES says.
    name = str(uuid)
    return [*command, f"--id={name if name.startswith('GPU-') else 'GPU-' + name}"]


class GpuClocks:
    """Samples while the `with` block runs; `summary` afterwards (None when nothing was sampled).

    `command` prints one QUERY line per reading until stopped; by default nvidia-smi, or nothing
    when there is no GPU. Sampling never fails the workload: a sampler that cannot start is skipped.
    """

    def __init__(self, command: list[str] | None = None) -> None:
        self.command = command if command is not None else default_command()
        self.summary: dict | None = None
        self._proc: subprocess.Popen | None = None
        self._out = None

    def __enter__(self) -> GpuClocks:
        if self.command:
            # A file, not a pipe, which could fill and stall the sampler; closed in __exit__.
            self._out = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
            try:
                self._proc = subprocess.Popen(self.command, stdout=self._out, stderr=subprocess.DEVNULL)
            except OSError:
                self._proc = None
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._out is not None:
            self._out.seek(0)
            self.summary = summarize(parse_samples(self._out))
            self._out.close()
