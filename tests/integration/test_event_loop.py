"""Inside a Ray actor of this cluster, async methods run on uvloop where it is installed:
Ray builds an async actor's loop with uvloop (``RAY_USE_UVLOOP`` not 0), so miles' actors
(buffer, rollout workers, trainer, broadcaster) run their awaits on it. The driver's loop:
tests/unit/test_event_loop.py."""

from __future__ import annotations

import importlib.util


def test_an_async_actor_runs_on_uvloop(ray_cluster) -> None:
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Probe:
        async def loop(self) -> str:
            from miles.utils import aio

            return aio.loop_name()

    probe = Probe.remote()
    try:
        name = ray.get(probe.loop.remote(), timeout=120)
    finally:
        ray.kill(probe)
    assert name == ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio")
