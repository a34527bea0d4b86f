"""The ``miles serve`` HTTP server: an EmbeddedEngine behind SGLang's HTTP protocol.

``Server`` holds the engine and the little state the protocol needs (in-flight request ids
for prefix aborts, the pause mode, weight-update groups) and builds the aiohttp app. Route
handlers for generation live in ``miles.serving.generate``, for weight updates in
``miles.serving.weight_updates``; this module has the control and info endpoints. The list
of endpoints, and where their behaviour differs from SGLang's, is in docs/sglang.md.

Everything runs on one asyncio loop; the engine decodes on its own thread, and blocking work
(rendezvous, broadcasts, reading checkpoints) goes to worker threads, so the server keeps
answering — health, loads, aborts — while a weight update or a long generation is under way.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from miles.engines import EmbeddedEngine
from miles.serving.protocol import ProtocolError, dumps
from miles.types import GenerateRequest, SamplingParams

PAUSE_MODES = ("abort", "retract", "in_place")


class ServeConfig(msgspec.Struct, kw_only=True):
    """``miles serve`` flags besides the engine's (``EngineConfig``)."""

    host: str = "127.0.0.1"  # loopback unless asked: the API has no authentication
    port: int = 30000  # 0 picks a free port (printed on start)
    hf_checkpoint: str | None = None  # the model: an HF checkpoint directory (config.json + *.safetensors)
    weight_version: int = 0  # version of the checkpoint's weights (SGLang: a label)
    served_model_name: str | None = None  # the model name /get_model_info reports (default: the checkpoint path)
    weight_sync_timeout_s: float = 600.0  # rendezvous and broadcasts of a weight update
    health_timeout_s: float = 20.0  # /health_generate's one-token generation
    stream_interval_s: float = 0.02  # how often a stream checks for new tokens


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def error_response(message: str, status: int = 400, *, generate: bool = False) -> web.Response:
    """SGLang's error bodies: ``{"error": {...}}`` from /generate, ``{success, message}`` else."""
    if generate:
        return json_response({"error": {"message": message, "code": status}}, status)
    return json_response({"success": False, "message": message, "object": "error", "code": status}, status)


async def read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    return body


def parse_version(value: Any, where: str) -> int:
    """miles versions are integers; SGLang carries them as strings ("3")."""
    try:
        if isinstance(value, bool):
            raise ValueError
        version = int(value)
    except (TypeError, ValueError):
        raise ProtocolError(f"{where}={value!r}: miles weight versions are integers") from None
    if version < 0:
        raise ProtocolError(f"{where} must be >= 0, got {version}")
    return version


class Server:
    def __init__(self, engine: EmbeddedEngine, *, config: ServeConfig, tokenizer: Any = None) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = engine.model.config
        self.inflight: set[str] = set()
        self.pause_mode: str | None = None
        self.weights_lock = asyncio.Lock()
        self.groups: dict[str, tuple[Any, str]] = {}  # group name → (process group, backend)
        self.closing = False

    # ---- shared helpers ------------------------------------------------------------------
    def keep_kv_cache(self) -> bool | None:
        """KV policy for a weight commit: in_place keeps it, retract recomputes it, and an
        unpaused server uses the engine's default."""
        return {"in_place": True, "retract": False}.get(self.pause_mode or "")

    async def abort(self, rid: str | None, *, abort_all: bool = False) -> int:
        """Abort requests whose id starts with ``rid`` (SGLang matches by prefix), or all."""
        if abort_all:
            n = len(self.inflight)
            await self.engine.abort(None)
            return n
        if not rid:
            return 0  # SGLang ignores an empty rid without abort_all
        hits = [r for r in self.inflight if r.startswith(rid)]
        for r in hits:
            await self.engine.abort(r)
        return len(hits)

    async def commit(self, version: int | None) -> None:
        """Apply staged tensors (if any) and set the version; caller holds weights_lock."""
        target = self.engine.version if version is None else version
        if target < self.engine.version:
            raise ProtocolError(f"weight_version {target} is older than the server's {self.engine.version}")
        await self.engine.commit_weights(target, keep_kv_cache=self.keep_kv_cache())

    # ---- info -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.closing else 200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once a one-token generation comes back (SGLang's check); a paused server is
        healthy and would hold the probe, so it answers at once."""
        if self.closing:
            return web.Response(status=503)
        if self.pause_mode is not None:
            return web.Response(status=200)
        probe = GenerateRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                                sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            out = await asyncio.wait_for(self.engine.generate(probe), self.config.health_timeout_s)
        except asyncio.TimeoutError:
            return web.Response(status=503)
        return web.Response(status=503 if out.finish_reason == "error" else 200)

    def _model_info(self) -> dict[str, Any]:
        mc = self.model_config
        return {
            "model_path": self.config.hf_checkpoint,
            "tokenizer_path": self.config.hf_checkpoint if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(self.engine.version),
            "model_type": mc.model_type,
            "architectures": mc.to_hf()["architectures"],
            "served_model_name": self.config.served_model_name or self.config.hf_checkpoint,
        }

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(self._model_info())

    async def weight_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": str(self.engine.version)})

    async def server_info(self, request: web.Request) -> web.Response:
        from miles import __version__

        ec = self.engine.config
        return json_response({
            **msgspec.to_builtins(self.config),
            **msgspec.to_builtins(ec),
            "model_path": self.config.hf_checkpoint,
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
            "max_running_requests": ec.max_batch_size,
            "max_total_num_tokens": ec.max_batch_size * ec.max_seq_len,
            "weight_version": str(self.engine.version),
            "pause_mode": self.pause_mode,
            "internal_states": [self.engine.stats()],
            "version": f"miles-{__version__}",
        })

    async def loads(self, request: web.Request) -> web.Response:
        from miles import __version__

        s, ec = self.engine.stats(), self.engine.config
        load = {
            "dp_rank": 0,
            "num_running_reqs": int(s["engine/num_running"]),
            "num_waiting_reqs": int(s["engine/num_waiting"]),
            "max_running_requests": ec.max_batch_size,
            "max_total_num_tokens": ec.max_batch_size * ec.max_seq_len,
            "gen_throughput": s["rollout/tokens_per_s"],
            "utilization": s["engine/batch_occupancy"],
            "cache_hit_rate": 0.0,
        }
        return json_response({"timestamp": time.time(), "version": f"miles-{__version__}", "loads": [load]})

    # ---- control --------------------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise ProtocolError("abort_request takes {rid: str, abort_all: bool}")
        await self.abort(rid, abort_all=abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await read_json(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"mode {mode!r} is not one of {PAUSE_MODES}")
        if mode == "abort":  # in-flight requests come back with their tokens so far
            await self.engine.abort(None)
        # retract and in_place both freeze requests in the batch; they differ in what a
        # weight update does to their KV cache (recomputed vs kept), see keep_kv_cache
        await self.engine.pause()
        self.pause_mode = mode
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_json(request)  # torch_empty_cache: nothing to free here
        await self.engine.resume()
        self.pause_mode = None
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """The engine has no prefix cache to flush; like SGLang it refuses while busy."""
        s = self.engine.stats()
        busy = bool(self.inflight) or s["engine/num_running"] + s["engine/num_waiting"] > 0
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n")
        return web.Response(text=text, status=400 if busy else 200)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        version = parse_version(body.get("new_version"), "new_version")
        if body.get("abort_all_requests", True):  # SGLang's default, pitfall C.1
            await self.engine.abort(None)
        async with self.weights_lock:
            await self.commit(version)
        return json_response({"success": True, "message": f"Weight version updated to {version}",
                              "new_version": str(version)})

    async def close(self) -> None:
        self.closing = True
        await self.engine.abort(None)
        await self.engine.resume()
        from miles.transports.weight_sync import destroy_group

        for group, _ in self.groups.values():
            await asyncio.to_thread(destroy_group, group)
        self.groups.clear()
        await self.engine.close()

    # ---- app ------------------------------------------------------------------------------
    def app(self) -> web.Application:
        from miles.serving import generate, weight_updates

        app = web.Application(client_max_size=256 * 1024**2, middlewares=[_protocol_errors])
        get, post = web.get, web.post
        gen = lambda request: generate.handle(self, request)  # noqa: E731
        app.add_routes([
            post("/generate", gen), web.put("/generate", gen),
            get("/health", self.health), get("/health_generate", self.health_generate),
            get("/model_info", self.model_info), get("/get_model_info", self.model_info),
            get("/server_info", self.server_info), get("/get_server_info", self.server_info),
            get("/get_weight_version", self.weight_version), get("/weight_version", self.weight_version),
            get("/v1/loads", self.loads), get("/get_load", self.loads),
            post("/abort_request", self.abort_request),
            post("/pause_generation", self.pause_generation),
            post("/continue_generation", self.continue_generation),
            get("/flush_cache", self.flush_cache), post("/flush_cache", self.flush_cache),
            post("/update_weight_version", self.update_weight_version),
        ])
        app.add_routes(weight_updates.routes(self))
        return app


@web.middleware
async def _protocol_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A ProtocolError anywhere in a handler is a 400 naming the problem."""
    try:
        return await handler(request)
    except ProtocolError as exc:
        return error_response(str(exc), generate=request.path == "/generate")
