"""Programmatic dependent launch (PDL, Hopper and newer): a kernel starts while the one before drains.

At decode sizes most kernels run for a few microseconds, so the gap between one kernel's last
block and the next one's first (launch, block scheduling, prologue) is a large share of a step.
With PDL the next kernel's blocks are placed on the SMs early and park in `griddepcontrol.wait`
until the previous grid has finished and its writes are visible.

The rule that keeps this safe: every kernel launched with `pdl_launch` calls `wait_for_prior_grid`
before it writes global memory or reads anything the kernel before it may have written, and lets
the next kernel launch only after that wait. Stream order then holds for memory exactly as
without PDL. Kernels not launched this way (cuBLAS, PyTorch) are ordinary stream-ordered
launches. MOESERVE_PDL=0 turns it off (for A/B timing).

What a kernel may read before its wait: weights (no kernel writes them), and anything written
two or more kernels back: when kernel N + 1 starts, kernel N has passed its wait, so kernel
N - 1 has completed and flushed. Such reads bypass L1 (`.cg`), which is not coherent with the
writer's SM.

The one exception, `launch_next_early`: a kernel may let the next one launch before its own wait
when that next kernel reads only weights and the step's inputs (written before the layers) ahead
of its wait, and itself keeps the rule. Its weights then stream while this kernel still waits and
computes; the chain's guarantee holds again from the next kernel's wait on.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr, LAUNCHED: tl.constexpr = False):
    """Block until the previous kernel in the stream is done, then let the next one launch
    (LAUNCHED: `launch_next_early` already did)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if not LAUNCHED:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def launch_next_early(PDL: tl.constexpr):
    """Let the next kernel launch before this one's wait; only for a next kernel that reads nothing
    but weights and the step's inputs before its own wait (see the module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=8)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and os.environ.get("MOESERVE_PDL", "1") != "0"


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel working on `t`'s device: PDL on Hopper+ GPUs, off elsewhere."""
    if t.device.type != "cuda":
        return {"PDL": False}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if not _supported(index):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}
