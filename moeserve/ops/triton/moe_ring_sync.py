"""How the ring kernel's programs (moe_ring.py) meet: the output row they add into, a grid barrier
before the tail, and the counters reset for the next launch. sync: [programs out, out zeroed,
programs done, logits in]."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from moeserve.ops.triton.moe_ring_plan import WIDE_H

_WIDE_H = gl.constexpr(WIDE_H)


@gluon.jit
def grid_barrier(sync_ptr):
    """Wait until every program has arrived (counter sync[0]); each program's earlier writes,
    every thread's, are visible to all after it (a release arrival after a CTA barrier)."""
    gl.thread_barrier()
    gl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    while gl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < gl.num_programs(0):
        pass
    gl.thread_barrier()


@gluon.jit
def zero_output(out_ptr, sync_ptr, pid, o_rows, o_cols, ACC_ROWS: gl.constexpr, HIDDEN: gl.constexpr,
                 out_l: gl.constexpr):
    """Program 0 zeroes out, which every program adds into, and raises sync[1]; after the PDL wait,
    since the kernel before may still read it."""
    if pid == 0:
        gl.store(out_ptr + o_rows * _WIDE_H + o_cols, gl.zeros([ACC_ROWS, _WIDE_H], gl.float32, out_l),
                 mask=o_rows < HIDDEN // _WIDE_H)
        gl.thread_barrier()
        gl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")


@gluon.jit
def add_into_output(out_ptr, acc_all, sync_ptr, zeroed, o_rows, o_cols, HIDDEN: gl.constexpr, out_l: gl.constexpr):
    """Once out is seen zeroed (program 0 raises sync[1]), the program's float32 output row is added
    into it by atomics."""
    while zeroed < 1:
        zeroed = gl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
    gl.atomic_add(out_ptr + o_rows * _WIDE_H + o_cols, acc_all.load(out_l), mask=o_rows < HIDDEN // _WIDE_H,
                  sem="relaxed", scope="gpu")


@gluon.jit
def release(ready, sync_ptr, last, SLOTS: gl.constexpr):
    """The ring's barriers invalidated; the last program out (`last`) resets the counters for the
    next launch, since every program is past its waits."""
    for i in gl.static_range(SLOTS):
        mbarrier.invalidate(ready.index(i))
    if last:
        gl.atomic_xchg(sync_ptr + 3, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
