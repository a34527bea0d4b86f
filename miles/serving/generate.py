"""``POST /generate`` of ``miles serve``: single, batch and streamed (SSE) generation.

A request is parsed by ``miles.serving.protocol`` into engine requests; each is registered
under its ``rid`` (so ``/abort_request`` can find it by prefix) right before it enters the
engine — no await in between, so an abort either finds it or came before it existed, as in
SGLang. Responses follow SGLang's semantics:

- invalid input (checked by the parser, and an ``rid`` already in flight) fails the whole
  call with 400 before anything runs, as SGLang's tokenizer manager raises;
- an aborted request returns 200 with the tokens made so far and ``finish_reason`` abort;
- an engine failure during a request returns what was made (maybe nothing), with an abort
  ``finish_reason`` carrying the message and status 500 — the server keeps serving.

Streaming sends cumulative chunks (everything so far, SGLang's default) whenever new tokens
appeared, then the finished object, then ``data: [DONE]``. A client that disconnects from a
stream gets its request aborted (SGLang does the same).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from miles.serving.protocol import (
    SSE_DONE,
    Item,
    ProtocolError,
    build_response,
    finish_reason,
    parse_generate,
    spec_stats,
    sse,
)
from miles.serving.server import json_response, read_json
from miles.types import GenerateOutput

if TYPE_CHECKING:
    from miles.serving.server import Server


async def handle(server: Server, request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    mc = server.model_config
    parsed = parse_generate(body, tokenizer=server.tokenizer, vocab_size=mc.vocab_size,
                            max_seq_len=server.engine.config.max_seq_len, is_moe=mc.is_moe)
    busy = next((i.request.rid for i in parsed.items if i.request.rid in server.inflight), None)
    if busy is not None:
        raise ProtocolError(f"request id {busy!r} is already in flight")
    if parsed.stream:
        return await _stream(server, request, parsed.items[0])
    results = await asyncio.gather(*(_run(server, item) for item in parsed.items))
    objs = [respond(server, item, out, e2e) for item, (out, e2e) in zip(parsed.items, results)]
    return json_response(objs if parsed.batch else objs[0])


async def _run(server: Server, item: Item) -> tuple[GenerateOutput, float]:
    rid = item.request.rid
    start = time.monotonic()
    server.inflight.add(rid)
    try:
        out = await server.engine.generate(item.request)
    finally:
        server.inflight.discard(rid)
    return out, time.monotonic() - start


def respond(server: Server, item: Item, out: GenerateOutput, e2e: float) -> dict[str, Any]:
    finish = finish_reason(out.finish_reason, matched=out.matched_stop,
                           length=len(out.output_ids), error=out.error)
    decoder = getattr(server.engine, "spec", None)
    spec = (spec_stats(out.spec_verify_count, out.spec_accepted_tokens, decoder.cfg.speculative_num_steps)
            if decoder is not None else None)
    return build_response(item, output_ids=out.output_ids, logprobs=out.logprobs,
                          versions=out.versions, finish=finish, weight_version=server.engine.version,
                          tokenizer=server.tokenizer, routed=out.routed_experts, e2e_latency=e2e, spec=spec)


async def _stream(server: Server, request: web.Request, item: Item) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    rid = item.request.rid
    task = asyncio.create_task(_run(server, item))
    sent = 0
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=server.config.stream_interval_s)
            snap = None if task.done() else server.engine.snapshot(rid)
            if snap is not None and len(snap[0]) > sent:
                ids, lps, vs = snap
                sent = len(ids)
                chunk = build_response(item, output_ids=ids, logprobs=lps, versions=vs, finish=None,
                                       weight_version=server.engine.version, tokenizer=server.tokenizer)
                await resp.write(sse(chunk))
        out, e2e = task.result()
        await resp.write(sse(respond(server, item, out, e2e)))
        await resp.write(SSE_DONE)
    except ConnectionResetError:  # the client went away: stop generating for it
        await server.engine.abort(rid)
        await asyncio.gather(task, return_exceptions=True)
    return resp
