"""Measured device ceilings (read bandwidth, bf16 matmul rate) that kernel benchmarks compare to."""

from __future__ import annotations

import torch


def _time_ms(fn, iters: int = 20) -> float:
    """Median milliseconds of `fn` over `iters` runs, with CUDA events, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def read_bandwidth_gbs(gib: float = 4.0) -> float:
    """GB/s (1e9) reading a large buffer once (a sum), the decode roofline's denominator."""
    x = torch.randn(int(gib * 2**30 / 2), dtype=torch.bfloat16, device="cuda")
    ms = _time_ms(lambda: x.sum(dtype=torch.float32))
    return x.numel() * 2 / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    """TFLOP/s of an n^3 bf16 matmul on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = _time_ms(lambda: a @ b, iters=10)
    return 2 * n**3 / ms / 1e9


def measure() -> dict:
    """Both ceilings and the device name."""
    return {
        "device": torch.cuda.get_device_name(),
        "read_gbs": round(read_bandwidth_gbs(), 1),
        "bf16_tflops": round(matmul_tflops(), 1),
    }


if __name__ == "__main__":
    print(measure())
