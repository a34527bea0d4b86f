"""Full cyclic-GC collections on a clock, for actor processes that hold many token lists.

CPython's full (generation 2) collection visits every element of every list the process
holds, and it runs whenever the long-lived objects have grown by a quarter — which, in a
process that keeps receiving and dropping trajectories, is every few steps. A replay buffer
holding a few thousand long trajectories spends a tenth of a second or more in one such
pass, which makes it the buffer's longest call by far, and the same pause, holding the GIL,
stalls an engine's stepping thread or a trainer.

miles' trajectories hold no reference cycles, so reference counting frees them; the cyclic
collector only matters for the odd cycle elsewhere (tracebacks, Ray and asyncio internals).
``install`` therefore leaves the young generations' automatic collections as they are
(they visit only new objects) and turns off the automatic full ones; a daemon thread runs a
full collection every ``every_s`` seconds instead — or less often, so that the passes take
at most ``MAX_SHARE`` of the time, since the pass itself grows with what the process holds
— so the pause comes at a known rate and is measured (``stats``). With a buffer holding
thousands of ready trajectories while it cycles a batch at a time, the policy cuts the
buffer's longest call by an order of magnitude and its time per cycle by about a third
(``benchmarks/gc_pass.py``).

Most of what a full pass visits is not the trajectories at all. It is what the process
built before its first step: importing torch, Ray and miles leaves hundreds of thousands of
tracked objects, and one pass over them alone is about the size of a busy buffer's whole
pass. So ``install`` runs one
full pass right away and then calls ``gc.freeze()``. What survived that pass (the imports)
moves to the permanent generation, which later passes skip. The first timed pass freezes
again, taking in what the actor built after ``install`` (its model, its compiled graphs).
From then on, each pass costs only what the process made since. The expensive pass happens
while the actor starts, not in its first minute of work. Frozen objects are still freed by
reference counting when they are dropped. The one cost is a cycle among them that becomes
garbage later: it is not collected. That is a bounded set (what existed at the first timed
pass), not a growing one. ``benchmarks/gc_pass.py`` measures the pass both ways.
"""

from __future__ import annotations

import gc
import threading
import time

FULL_EVERY_S = 30.0
MAX_SHARE = 0.0025  # of wall time spent in the timed full collections
_NEVER = 1 << 30  # a generation-2 threshold that the count of generation-1 passes never reaches

_lock = threading.Lock()
_state = {"installed": False, "count": 0, "seconds": 0.0, "longest": 0.0}


def install(every_s: float = FULL_EVERY_S, *, young: bool = True) -> None:
    """Automatic full collections off, one every ``every_s`` seconds from a daemon thread.
    ``young=False`` turns the automatic young collections off too (``gc.disable``): for a
    process whose new objects are acyclic token lists that it keeps (the replay buffer), a
    young pass only re-visits every element of each list it just received, twice (generation
    0, then 1) — a third of the buffer actor's time a trajectory on the CPU dev machine
    (``benchmarks/buffer_actor.py``) — and the timed full passes still collect any cycle.
    Idempotent per process (the first call's settings hold)."""
    if every_s <= 0:
        raise ValueError(f"every_s must be > 0, got {every_s}")
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    if not young:
        gc.disable()
    young_n, middle, _ = gc.get_threshold()
    gc.set_threshold(young_n, middle, _NEVER)
    full_collect()
    gc.freeze()  # the imports' objects: out of every later pass
    threading.Thread(target=_loop, args=(every_s,), name="miles-full-gc", daemon=True).start()


def full_collect() -> float:
    """One full collection now; returns its seconds (also added to ``stats``)."""
    start = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - start
    with _lock:
        _state["count"] += 1
        _state["seconds"] += took
        _state["longest"] = max(_state["longest"], took)
    return took


def stats() -> dict[str, float]:
    """Full collections run by this module: count, total and longest seconds."""
    with _lock:
        return {"count": float(_state["count"]), "seconds": _state["seconds"], "longest": _state["longest"]}


def _loop(every_s: float) -> None:
    wait = every_s
    time.sleep(wait)
    full_collect()
    gc.freeze()  # and what the actor built after install
    while True:
        time.sleep(wait)
        wait = max(every_s, full_collect() / MAX_SHARE)
