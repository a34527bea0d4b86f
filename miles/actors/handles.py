"""One way to call another component, whether it is a Ray actor or a local object.

Actors are plain classes (STYLE 3): a RolloutWorker holds a "buffer" that is a Ray actor
handle in production and a ReplayBuffer instance in tests. ``Peer.call`` hides the
difference: ``await peer.call("lease", worker_id, 8)`` works for both, and never blocks the
event loop (no ``ray.get`` inside actors).
"""

from __future__ import annotations

import inspect
from typing import Any


class Peer:
    """Wraps a Ray actor handle or a plain object behind an async ``call``."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.is_ray = _is_ray_handle(target)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.is_ray:
            return await getattr(self.target, method).remote(*args, **kwargs)
        result = getattr(self.target, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    def fire(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start a call without waiting (Ray only returns an ObjectRef); local calls run now."""
        if self.is_ray:
            return getattr(self.target, method).remote(*args, **kwargs)
        return getattr(self.target, method)(*args, **kwargs)


def _is_ray_handle(obj: Any) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a hard dependency, but keep unit tests light
        return False
    return isinstance(obj, ActorHandle)
