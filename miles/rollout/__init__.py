"""miles.rollout: generate functions, how one trajectory is rolled out on an engine.

- ``context.py``     the shared context (``GenerateContext``), ``apply_output`` (status rules)
                     and ``call_generate``
- ``single_turn.py`` the default: one model turn (``generate_single_turn``)
- ``env.py``         ``EnvRollout``: multi-turn environment episodes (budgets, failures, parking)
- ``occupancy.py``   ``Occupancy``: busy time and episodes in flight, integrated (env/ and agent/)

``load_generate_fn`` picks the run's function: the default, or ``--custom-generate-function-path``.
"""

from __future__ import annotations

import inspect

import msgspec

from miles.rollout.context import GenerateContext, GenerateFn, apply_output, call_generate
from miles.rollout.env import EnvRollout, build_env_rollout
from miles.rollout.single_turn import generate_single_turn
from miles.types import Trajectory
from miles.utils.loading import load_function, positional_arity


def load_generate_fn(ref: str | None) -> GenerateFn:
    """The default single-turn function, or the user's (adapting slime's 3-argument form)."""
    if not ref:
        return generate_single_turn
    fn = load_function(ref)
    if positional_arity(fn) >= 3:
        async def slime_style(sample: Trajectory, ctx: GenerateContext) -> Trajectory:
            result = fn(ctx, sample, msgspec.to_builtins(ctx.sampling))
            return await result if inspect.isawaitable(result) else result

        return slime_style
    return fn


__all__ = [
    "EnvRollout",
    "GenerateContext",
    "GenerateFn",
    "apply_output",
    "build_env_rollout",
    "call_generate",
    "generate_single_turn",
    "load_generate_fn",
]
