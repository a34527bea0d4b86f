"""Weight-update endpoints of ``miles serve`` (SGLang's, REFERENCES A.7).

- ``/init_weights_update_group`` joins a sender's group (``miles.transports.weight_sync``) as
  rank ``rank_offset`` — the server is a single engine rank.
- ``/update_weights_from_distributed`` receives the broadcasts described by ``names``,
  ``dtypes``, ``shapes`` (one per tensor, or one ``flattened_bucket`` buffer), stages them
  into the engine and commits them between two decode steps, then sets ``weight_version``.
  Once the metadata is well formed it always receives every broadcast before it validates
  names and shapes, so a bad update is answered with 400 without leaving the sender blocked.
- ``/update_weights_from_disk`` reads every ``*.safetensors`` file of ``model_path`` (HF
  names; a subset of the parameters is allowed, as SGLang loads whatever the files hold).
- ``/destroy_weights_update_group`` leaves the group.
- ``/update_weights_from_tensor`` is refused: SGLang's payload is a pickled object carrying
  CUDA IPC handles, and ``miles serve`` never unpickles request data. docs/sglang.md says so.

Differences from SGLang, all on purpose: an update on an unpaused server does not wait for
in-flight requests to finish (the engine swaps weights between two decode steps and every
token records its version); ``flush_cache`` is accepted and has nothing to flush (no prefix
cache); an update on a server paused with ``retract`` recomputes the paused requests' KV
cache with the new weights, with ``in_place`` it keeps it. Updates are serialised.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from miles.engines import WeightError
from miles.transports import weight_sync
from miles.serving.protocol import ProtocolError
from miles.serving.server import error_response, json_response, parse_version, read_json

if TYPE_CHECKING:
    from miles.serving.server import Server

DEFAULT_GROUP = "weight_update_group"
_TENSOR_REFUSAL = (
    "miles serve does not implement /update_weights_from_tensor: SGLang's payload is a pickled "
    "(ForkingPickler) object carrying CUDA IPC handles, and miles never unpickles request data. "
    "Use /update_weights_from_distributed (backend gloo on the CPU, nccl on GPUs) or "
    "/update_weights_from_disk."
)


def routes(server: Server) -> list[web.RouteDef]:
    def bind(fn: Any) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await fn(server, request)
        return handler

    return [
        web.post("/init_weights_update_group", bind(init_group)),
        web.post("/update_weights_from_distributed", bind(update_from_distributed)),
        web.post("/destroy_weights_update_group", bind(destroy_group)),
        web.post("/update_weights_from_disk", bind(update_from_disk)),
        web.post("/update_weights_from_tensor", bind(refuse_tensor)),
    ]


def _fail(message: str, **extra: Any) -> web.Response:
    return json_response({"success": False, "message": message, **extra}, 400)


def _str(body: dict[str, Any], key: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _optional_version(body: dict[str, Any]) -> int | None:
    value = body.get("weight_version")
    return None if value is None else parse_version(value, "weight_version")


async def init_group(server: Server, request: web.Request) -> web.Response:
    body = await read_json(request)
    name = _str(body, "group_name", DEFAULT_GROUP)
    backend = _str(body, "backend", "nccl")
    ints = {}
    for key in ("master_port", "rank_offset", "world_size"):
        value = body.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{key} must be an integer, got {value!r}")
        ints[key] = value
    address = _str(body, "master_address")
    if name in server.groups:
        return _fail(f"group {name!r} already exists; destroy it first")
    if backend == "nccl" and server.engine.device.type != "cuda":
        return _fail("backend 'nccl' needs the engine on a GPU (--device cuda); use 'gloo'")
    try:
        weight_sync.check_backend(backend)
        group = await asyncio.to_thread(
            weight_sync.init_group, master_address=address,
            master_port=ints["master_port"], rank=ints["rank_offset"], world_size=ints["world_size"],
            group_name=name, backend=backend, timeout_s=server.config.weight_sync_timeout_s)
    except Exception as exc:  # rendezvous failures are the client's to fix; keep serving
        return _fail(f"Failed to init group {name!r}: {type(exc).__name__}: {exc}")
    server.groups[name] = (group, backend)
    return json_response({"success": True, "message": "Succeeded to initialize custom process group."})


async def destroy_group(server: Server, request: web.Request) -> web.Response:
    name = _str(await read_json(request), "group_name", DEFAULT_GROUP)
    entry = server.groups.pop(name, None)
    if entry is None:
        return _fail(f"group {name!r} does not exist")
    await asyncio.to_thread(weight_sync.destroy_group, entry[0])
    return json_response({"success": True, "message": "Succeeded to destroy custom process group."})


async def update_from_distributed(server: Server, request: web.Request) -> web.Response:
    body = await read_json(request)
    name = _str(body, "group_name", DEFAULT_GROUP)
    if name not in server.groups:
        return _fail(f"group {name!r} does not exist; call /init_weights_update_group first")
    load_format = body.get("load_format")
    if load_format not in (None, "flattened_bucket"):
        return _fail(f"load_format {load_format!r} is not one of null, 'flattened_bucket'")
    try:
        metas = weight_sync.plan(body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or [])
    except weight_sync.WeightSyncError as exc:
        return _fail(str(exc))
    group, backend = server.groups[name]
    device = server.engine.device if backend == "nccl" else "cpu"
    if body.get("abort_all_requests", False):
        await server.engine.abort(None)
    async with server.weights_lock:
        try:
            tensors = await asyncio.to_thread(weight_sync.receive, group, metas,
                                              flattened=load_format == "flattened_bucket", device=device)
        except Exception as exc:
            return _fail(f"Failed to receive weights over group {name!r}: {type(exc).__name__}: {exc}")
        return await _stage_and_commit(server, tensors, _optional_version(body),
                                       "Succeeded to update parameter online.")


async def update_from_disk(server: Server, request: web.Request) -> web.Response:
    body = await read_json(request)
    path = _str(body, "model_path")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        return _fail(f"load_format {body.get('load_format')!r} is not supported (safetensors only)",
                     num_paused_requests=0)
    version = _optional_version(body)
    if body.get("abort_all_requests", False):
        await server.engine.abort(None)
    async with server.weights_lock:
        try:
            tensors = await asyncio.to_thread(_read_safetensors, path)
        except Exception as exc:  # missing or corrupt files: the client's to fix
            return _fail(f"Failed to read {path}: {exc}", num_paused_requests=0)
        return await _stage_and_commit(server, tensors, version,
                                       f"Succeeded to update model weights from {path}.",
                                       num_paused_requests=0)


async def refuse_tensor(server: Server, request: web.Request) -> web.Response:
    return error_response(_TENSOR_REFUSAL)


async def _stage_and_commit(server: Server, tensors: list[tuple[str, Any]], version: int | None,
                            message: str, **extra: Any) -> web.Response:
    """Stage (all or nothing) and commit; the caller holds the weights lock."""
    if version is not None and version < server.engine.version:
        return _fail(f"weight_version {version} is older than the server's {server.engine.version}", **extra)
    try:
        n = await asyncio.to_thread(server.engine.stage_weights, tensors)
    except WeightError as exc:
        return _fail(f"Failed to update weights: {exc}", **extra)
    try:
        await server.commit(version)
    except Exception as exc:
        server.engine.stager.clear()
        return _fail(f"Failed to apply weights: {exc}", **extra)
    if version is not None:
        message += f" Weight version updated to {version}."
    return json_response({"success": True, "message": f"{message} ({n} tensors)", **extra})


def _read_safetensors(path: str) -> list[tuple[str, Any]]:
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                if not key.endswith("rotary_emb.inv_freq"):  # buffers some exporters write
                    tensors.append((key, fh.get_tensor(key)))
    return tensors
