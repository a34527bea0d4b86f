"""The default generate function: one model turn on the engine."""

from __future__ import annotations

from miles.rollout.context import GenerateContext, apply_output
from miles.types import Status, Trajectory


async def generate_single_turn(sample: Trajectory, ctx: GenerateContext) -> Trajectory:
    """The default: continue the response until stop, length, abort or error."""
    request = ctx.request_for(sample)
    if request.sampling.max_new_tokens <= request.num_prefix_tokens:
        sample.status = Status.TRUNCATED
        sample.finish_reason = "length"
        return sample
    out = await ctx.engine.generate(request)
    apply_output(sample, out)
    return sample
