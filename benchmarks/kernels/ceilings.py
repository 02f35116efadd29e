"""Measured device ceilings (read bandwidth, bf16 matmul rate) that kernel benchmarks compare to."""

from __future__ import annotations

import torch

from moeserve.bench.roofline import matmul_tflops, read_bandwidth_gbs, time_ms

__all__ = ["time_ms", "matmul_tflops", "measure", "read_bandwidth_gbs"]


def measure() -> dict:
    """Both ceilings and the device name."""
    return {
        "device": torch.cuda.get_device_name(),
        "read_gbs": round(read_bandwidth_gbs(), 1),
        "bf16_tflops": round(matmul_tflops(), 1),
    }


if __name__ == "__main__":
    print(measure())
