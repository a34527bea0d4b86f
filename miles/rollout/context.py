"""Generate functions: how one trajectory is rolled out on an engine.

A generate function takes a trajectory (possibly PARTIAL, with a prefix from an earlier
policy version) and a ``GenerateContext`` and returns the trajectory with new tokens appended
and its status set. The default is single-turn generation; ``--custom-generate-function-path``
names another with the same signature, ``fn(sample, ctx)`` sync or async (slime's
``fn(args, sample, sampling_params)`` is accepted too: ``args`` is then the context). The
multi-turn environment rollout is one more such function.

Status rules: an engine abort (partial rollout, shutdown) leaves the trajectory PARTIAL with
its prefix kept — the worker returns it to the buffer's unfinished queue; an engine error
marks it FAILED with the reason; otherwise stop → COMPLETED, length → TRUNCATED.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from miles.protocols import RolloutEngine
from miles.types import GenerateOutput, GenerateRequest, SamplingParams, Status, Trajectory, finish_to_status


@dataclass
class GenerateContext:
    """What a generate function may use. One per worker, shared by its trajectories."""

    engine: RolloutEngine
    tokenizer: Any
    sampling: SamplingParams
    max_response_len: int
    seed: int = 0
    config: Any = None  # the run's MilesConfig, for custom functions that need flags
    extras: dict[str, Any] = field(default_factory=dict)
    # Bumped by the worker each time it aborts its in-flight generations: a multi-turn
    # function checks it between turns and parks (PARTIAL) instead of starting a new one.
    aborts: int = 0
    # Rollout routing replay (--use-rollout-routing-replay with an MoE model): every fresh
    # trajectory records the experts each sampled token was routed through.
    record_routing: bool = False

    def sample_seed(self, traj: Trajectory) -> int:
        """A per-trajectory seed: resume after abort re-draws the same random numbers."""
        digest = hashlib.blake2b(f"{self.seed}:{traj.id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF

    def request_for(self, traj: Trajectory, *, max_new_tokens: int | None = None, **overrides: Any) -> GenerateRequest:
        """A request continuing ``traj`` from its current end (prompt + response so far).

        ``max_new_tokens`` optionally caps this call (a turn); the request's budget is
        counted from the original prompt, as the engine contract says, so it is the
        response length so far plus what this call may add."""
        done = len(traj.response_tokens)
        if self.record_routing and traj.routed_experts is None and not done:
            traj.routed_experts = []  # starts with the response: row j is token j's routing
        remaining = self.max_response_len - done
        if max_new_tokens is not None:
            remaining = min(remaining, max_new_tokens)
        sampling = msgspec.structs.replace(
            self.sampling, max_new_tokens=done + max(remaining, 0), seed=self.sample_seed(traj), **overrides
        )
        return GenerateRequest(
            rid=traj.id,
            input_ids=traj.prompt_tokens + traj.response_tokens,
            sampling=sampling,
            num_prefix_tokens=len(traj.response_tokens),
            return_routed_experts=traj.routed_experts is not None,
        )


def apply_output(traj: Trajectory, out: GenerateOutput, *, kind: str = "model") -> None:
    """Append an engine output to a trajectory and set its status from the finish reason."""
    traj.append(out.output_ids, out.logprobs, out.versions, kind=kind,  # type: ignore[arg-type]
                kv_versions=out.kv_versions)
    if out.routed_experts is not None and traj.routed_experts is not None:
        traj.routed_experts.extend(out.routed_experts)
    if out.finish_reason == "abort":
        traj.status = Status.PARTIAL
        traj.finish_reason = None
    elif out.finish_reason == "error":
        traj.status = Status.FAILED
        traj.finish_reason = f"engine_error: {out.error}"
    else:
        traj.status = finish_to_status(out.finish_reason)
        traj.finish_reason = out.finish_reason


GenerateFn = Callable[[Trajectory, GenerateContext], Any]


async def call_generate(fn: GenerateFn, sample: Trajectory, ctx: GenerateContext) -> Trajectory:
    result = fn(sample, ctx)
    if inspect.isawaitable(result):
        result = await result
    if not isinstance(result, Trajectory):
        raise TypeError(f"generate function returned {type(result).__name__}, expected the Trajectory")
    return result
