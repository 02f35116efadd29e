"""The SwiGLU MLP used by dense layers and shared experts."""

from __future__ import annotations

import torch
from torch import nn

from moeserve import ops


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up stored as one [2 * inter, hidden] matrix.

    One matrix means one GEMM per call; the loader fills its halves from the checkpoint's
    `gate_proj` and `up_proj`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ops.silu_and_mul(ops.linear(x, self.gate_up_proj.weight))
        return ops.linear(act, self.down_proj.weight)
