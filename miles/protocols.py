"""The contracts between miles' parts, as small Protocols in one module.

Each method's docstring says when the runtime calls it. Implementations compose; nothing
here needs to be subclassed. The embedded backends (``miles.engines``, ``miles.trainers``)
and the production ones (SGLang adapter, Megatron trainer) satisfy the same Protocols, so
moving from the CPU example to a cluster changes flags, not code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from miles.types import GenerateOutput, GenerateRequest, Reward, Trajectory

# ``NamedTensors`` is an iterable of (HF parameter name, tensor). Tensors are torch tensors
# inside a process; across processes the weight transports move them (object store, NCCL,
# CUDA IPC).
NamedTensors = Iterable[tuple[str, Any]]


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates tokens for a rollout worker. Embedded torch engine or SGLang adapter."""

    @property
    def version(self) -> int:
        """The policy version of the weights the next decode step will use."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Called by a worker once per (resumed) generation; many calls are in flight at
        once. Returns when the request stops, reaches its length, fails, or is aborted —
        on abort with every token made so far, each with its log-prob and version."""
        ...

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (or all when ``rid`` is None); the matching ``generate`` calls
        return promptly with ``finish_reason="abort"``. Called for partial rollouts and
        shutdown."""
        ...

    async def update_weights(
        self, named_tensors: NamedTensors, version: int, *, keep_kv_cache: bool = True
    ) -> None:
        """Called when the broadcaster delivers policy version ``version``. Weights are
        staged and swapped in between two decode steps; in-flight requests continue with
        the new weights (KV cache kept, or recomputed when ``keep_kv_cache`` is False)."""
        ...


@runtime_checkable
class TrainerBackend(Protocol):
    """Trains the policy. Embedded torch trainer or Megatron-core."""

    @property
    def version(self) -> int:
        """Policy version of the trainer's current weights (bumped by ``train_step``)."""
        ...

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        """Called by the PolicyTrainer with one batch of whole groups: computes advantages,
        log-probs, the loss and one optimizer step; bumps the version; returns metrics
        named ``train/...``."""
        ...

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
        """Called after a step to publish weights: yields HF-named tensors in buckets of
        about ``bucket_bytes`` bytes."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and RNG state for a checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (on --load)."""
        ...


# A reward function takes the finished trajectory (``.prompt``, ``.response``, ``.label``,
# ``.metadata``) and returns a float or a dict of named floats, sync or async. slime's
# ``fn(args, sample)`` form is adapted by the loader.
RewardFn = Callable[[Trajectory], Reward | Awaitable[Reward]]

# A group filter (dynamic sampling) sees one finished group and says whether to keep it.
GroupFilter = Callable[[Sequence[Trajectory]], bool]


@runtime_checkable
class Env(Protocol):
    """A multi-turn environment; one instance per episode (built from ``--env-path`` with
    ``--env-kwargs``). Methods may be sync (run in a thread pool) or async (awaited).
    Optional: ``stop`` / ``stop_token_ids`` attributes (what ends a model turn, besides
    EOS) and ``close()`` (called when the episode ends). See ``miles.envs``."""

    def reset(self, sample: Trajectory) -> str | Awaitable[str]:
        """Called once before the first turn; returns the first observation: "" keeps the
        data prompt, text (or a list of chat messages) becomes the prompt."""
        ...

    def step(
        self, action_text: str
    ) -> tuple[str, float, bool, dict[str, Any]] | Awaitable[tuple[str, float, bool, dict[str, Any]]]:
        """Called after each model turn with its decoded text; returns
        (observation_text, reward, done, info) — or gymnasium's
        (observation_text, reward, terminated, truncated, info)."""
        ...


class VersionProvider(Protocol):
    """Anything that knows the newest published policy version."""

    def get_version(self) -> int: ...
