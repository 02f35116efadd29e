"""GPU presets from public datasheets and `--gpu-spec` JSON loading."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# Compute precisions the planner knows; KV caches use only the first two.
DTYPES = ("bf16", "fp8", "fp4")


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's datasheet figures: memory, bandwidths and dense peak throughput."""

    name: str
    # HBM capacity as datasheets print it ("80 GB"). HBM stacks are binary-sized, so the planner
    # reads this number as GiB, the same "GB" that SGLang's logs and seed 000's table use.
    hbm_gb: float
    hbm_tb_s: float  # HBM bandwidth, 1e12 bytes/s
    bf16_tflops: float  # dense (no structured sparsity), 1e12 FLOP/s
    fp8_tflops: float
    fp4_tflops: float | None  # None where the chip has no FP4 tensor cores
    nvlink_gb_s: float  # per GPU, both directions summed, as datasheets print it (1e9 B/s)
    network_gb_s: float  # per GPU scale-out NIC, one direction (400 Gb/s = 50 GB/s)
    nvlink_domain: int = 8  # GPUs that reach each other over NVLink (8 for HGX, 72 for NVL72)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name" or value is None:
                continue
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"GPU spec {self.name!r}: {f.name} must be a positive number, got {value!r}")

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak TFLOP/s for a dtype; FP4 math runs at FP8 speed on chips without FP4."""
        if dtype == "bf16":
            return self.bf16_tflops
        if dtype == "fp8":
            return self.fp8_tflops
        if dtype == "fp4":
            return self.fp4_tflops if self.fp4_tflops is not None else self.fp8_tflops
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")

    def to_dict(self) -> dict:
        """Plain dict, the same keys a `--gpu-spec` file uses."""
        return asdict(self)


# Dense figures are half the "with sparsity" headline numbers the datasheets lead with.
PRESETS: dict[str, GpuSpec] = {
    # NVIDIA H20 product brief (China SKU, Hopper): 96 GB HBM3, 4.0 TB/s, FP8 296 / BF16 148 dense.
    "H20": GpuSpec("H20", 96, 4.0, 148, 296, None, 900, 50, 8),
    # NVIDIA H800 SXM5 product brief: H100 compute with NVLink cut to 400 GB/s; 400 Gb/s NIC per GPU.
    "H800": GpuSpec("H800", 80, 3.35, 989, 1979, None, 400, 50, 8),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, NVLink 4 900 GB/s.
    "H100": GpuSpec("H100", 80, 3.35, 989, 1979, None, 900, 50, 8),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, H100 compute.
    "H200": GpuSpec("H200", 141, 4.8, 989, 1979, None, 900, 50, 8),
    # NVIDIA HGX B200 datasheet (per GPU of 8): 180 GB HBM3e, 8 TB/s, NVLink 5 1.8 TB/s.
    "B200": GpuSpec("B200", 180, 8.0, 2250, 4500, 9000, 1800, 50, 8),
    # NVIDIA GB200 NVL72 datasheet / GB200 superchip brief (384 GB per 2 GPUs, as seed 000 uses).
    "GB200": GpuSpec("GB200", 192, 8.0, 2500, 5000, 10000, 1800, 50, 72),
    # NVIDIA GB300 NVL72 datasheet (Blackwell Ultra): 288 GB HBM3e, FP4 15 PF dense, ConnectX-8 800 Gb/s.
    "GB300": GpuSpec("GB300", 288, 8.0, 2500, 5000, 15000, 1800, 100, 72),
}


def load_gpu_spec(path: str | Path) -> GpuSpec:
    """Read a `--gpu-spec` JSON file whose keys are GpuSpec's fields (fp4_tflops, nvlink_domain optional)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--gpu-spec: no such file {str(path)!r}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--gpu-spec {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--gpu-spec {str(path)!r} must hold a JSON object")
    known = {f.name for f in fields(GpuSpec)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--gpu-spec {str(path)!r}: unknown keys {unknown}; known keys are {sorted(known)}")
    raw.setdefault("name", path.stem)
    raw.setdefault("fp4_tflops", None)
    missing = sorted(known - set(raw) - {"nvlink_domain"})
    if missing:
        raise ValueError(f"--gpu-spec {str(path)!r}: missing keys {missing}")
    return GpuSpec(**raw)


def resolve_gpu(name: str | None, spec_path: str | Path | None = None) -> GpuSpec:
    """A preset by name (case-insensitive), or the `--gpu-spec` file when one is given."""
    if spec_path is not None:
        return load_gpu_spec(spec_path)
    if name is None:
        raise ValueError(f"name a GPU with --gpu ({', '.join(PRESETS)}) or give --gpu-spec FILE")
    spec = PRESETS.get(name.upper())
    if spec is None:
        raise ValueError(f"unknown GPU {name!r}; presets are {', '.join(PRESETS)} (or use --gpu-spec FILE)")
    return spec
