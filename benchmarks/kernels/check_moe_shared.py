"""A DeepSeek-V2-Lite MoE layer with its shared experts fused into the MoE kernels vs run as GEMMs.

    python benchmarks/kernels/check_moe_shared.py [--tokens 1,8,64,256]

Times `MoE.forward` (router included) per token count both ways, each step of a CUDA graph
walking four distinct layers so that no weight is still in L2, to set FUSED_SHARED_MAX_TOKENS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moeserve.config.model_config import ModelConfig  # noqa: E402
from moeserve.layers import moe  # noqa: E402

LAYERS = 4


def make_layers(config: ModelConfig) -> list[moe.MoE]:
    layers = []
    for _ in range(LAYERS):
        layer = moe.MoE(config).to(device="cuda", dtype=torch.bfloat16)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        layers.append(layer)
    return layers


def layer_us(layers: list[moe.MoE], x: torch.Tensor, fused_max: int, reps: int = 5) -> float:
    moe.FUSED_SHARED_MAX_TOKENS = fused_max
    for layer in layers:
        layer(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for layer in layers:
                layer(x)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(layers)))
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=str(ROOT / "shared/model-shapes/deepseek-v2-lite.json"))
    ap.add_argument("--tokens", default="1,2,4,8,16,24,32,48,64,96,128,192,256,384,512")
    a = ap.parse_args()
    config = ModelConfig.from_path(a.shape)
    layers = make_layers(config)
    for tokens in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        fused, separate = layer_us(layers, x, 1 << 30), layer_us(layers, x, 0)
        print(
            f"T={tokens:5d}  fused {fused:8.1f} us  separate {separate:8.1f} us  "
            f"({'fused' if fused < separate else 'separate'} by {abs(fused - separate):.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
