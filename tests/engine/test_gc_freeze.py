"""Requests leave the collector's walks once admitted, and are still freed when they finish."""

from __future__ import annotations

import gc
import weakref

from moeserve import LLM, SamplingParams


def _in_collected_generations(obj: object) -> bool:
    """Whether any generation's pass walks `obj` (no generator or comprehension here: their frames
    would land in the object lists and make a reference cycle with them)."""
    for gen in range(3):
        objects = gc.get_objects(gen)
        for other in objects:
            if other is obj:
                return True
        del objects
    return False


def test_admitted_requests_are_frozen_then_freed_when_finished(v3_checkpoint):
    llm = LLM(str(v3_checkpoint), dtype="float32", device="cpu", page_size=4)
    core = llm.core
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    reqs = [core.add_request(str(i), [1, *range(10 + i, 29 + i)], params) for i in range(4)]
    assert _in_collected_generations(reqs[0].prompt_token_ids)
    # Cyclic garbage alive at the freeze would be kept for good: the engine collects first.
    cycle = [reqs[1]]
    cycle.append(cycle)
    garbage = weakref.ref(cycle[0])
    del cycle
    core.step()
    assert not any(_in_collected_generations(r.prompt_token_ids) for r in reqs)
    refs = [weakref.ref(r) for r in reqs]
    del reqs
    steps = 1
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    assert steps > 1
    core.kv.check_idle_accounting()
    # Reference counting frees finished requests whether frozen or not: nothing kept alive.
    assert garbage() is None and all(ref() is None for ref in refs)
    # No new requests: later steps freeze nothing more. (The count may fall: frozen objects that die
    # leave it, and what other tests left in the frozen generation can die during any step.)
    frozen = gc.get_freeze_count()
    core.step()
    assert gc.get_freeze_count() <= frozen
