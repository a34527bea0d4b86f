"""SGLangEngine: a ``RolloutEngine`` over one SGLang HTTP server (or ``miles serve``).

A RolloutWorker drives it exactly as it drives the EmbeddedEngine: ``generate``, ``abort``,
``stage_weights`` + ``commit_weights(version, keep_kv_cache=...)``, ``version``. The adapter
connects to a server URL, or launches one (``python -m sglang.launch_server`` with flags
from SGLangConfig and the ``--sglang-*`` passthrough), and waits for ``/health_generate``.

Generation: ``POST /generate`` with ``input_ids``, ``sampling_params`` and ``return_logprob``
(``miles.engines.sglang.responses`` builds and reads the bodies). A cancelled ``generate``
sends ``/abort_request`` for its rid before re-raising: SGLang drops the output of a request
whose client disconnected, so a partial rollout must abort, not hang up (pitfall C.9).

Weight updates (A.10): ``stage_weights`` keeps the (HF-named) tensors; ``commit_weights``
pauses generation (``in_place`` when the worker keeps the KV cache, else ``abort``, see
SGLangConfig.sglang_pause_mode), sends the tensors and the new version, and continues.

- distributed: the adapter's process is rank 0 of a group it builds once with the server
  (``/init_weights_update_group`` sent concurrently with its own rendezvous, pitfall C.6);
  each bucket is one ``flattened_bucket`` broadcast, sent while the matching
  ``/update_weights_from_distributed`` call waits; the last bucket carries
  ``weight_version``. NCCL with CUDA, gloo without.
- disk: the tensors are written as ``model.safetensors`` (+ the checkpoint's config.json)
  under ``sglang_weight_dir/v{version}`` and loaded with ``/update_weights_from_disk``; the
  server must see that directory.

``version`` is the adapter's knowledge of the server's version: read from ``/model_info`` at
start, set by commits, raised by the versions responses report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import torch

from miles.engines.sglang.client import HttpClient, SGLangError, error_message
from miles.engines.sglang.config import SGLangConfig
from miles.engines.sglang.launch import ServerProcess, build_launch_command, server_port
from miles.engines.sglang.responses import generate_body, output_from_response, parse_version_label
from miles.protocols import NamedTensors
from miles.transports import weight_sync
from miles.types import GenerateOutput, GenerateRequest
from miles.utils.net import free_port
from miles.transports.weights import plan_buckets

log = logging.getLogger(__name__)

_MAX_BUCKET_BYTES = 1 << 30  # a staged call larger than this goes in several broadcasts


class SGLangEngine:
    def __init__(self, config: SGLangConfig, *, url: str | None = None, model_path: str | None = None,
                 version: int = 0, seed: int | None = None, index: int = 0) -> None:
        """``url`` connects; without it (and ``config.sglang_launch``) the adapter launches a
        server for ``model_path`` on ``config.sglang_port + index``."""
        self.config = config
        self.model_path = model_path
        self._initial_version = self._version = version
        self._process: ServerProcess | None = None
        if url is None:
            if not config.sglang_launch or not model_path:
                raise ValueError("SGLangEngine needs a url, or sglang_launch with a model_path")
            argv, url = build_launch_command(config, model_path=model_path, port=server_port(config, index),
                                             weight_version=version, seed=seed)
            self._process = ServerProcess(argv)
        self.url = url
        self.http = HttpClient(url, timeout_s=config.sglang_timeout_s)
        self.routing_shape = _routing_shape(model_path)
        self._staged: list[list[tuple[str, torch.Tensor]]] = []
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self._update_lock: asyncio.Lock | None = None
        self._group: Any = None
        self._group_name = ""
        self._broken_groups: list[str] = []  # names the server may still hold
        self._weight_dir: Path | None = None
        self._own_weight_dir = False
        self.counters = dict.fromkeys(("requests", "errors", "aborts", "weight_updates", "weight_update_s"), 0.0)

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        """Launch (if asked), wait until healthy, read the server's version. Idempotent."""
        if self._started:
            return
        self._start_lock = self._start_lock or asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            proc = self._process
            if proc is not None and proc.process is None:
                proc.start()
            await self.http.wait_healthy(self.config.sglang_startup_timeout_s,
                                         alive=proc.alive if proc else None,
                                         describe_death=proc.log_tail if proc else None)
            info = await self.http.call("/model_info", method="GET")
            label = info.get("weight_version") if isinstance(info, dict) else None
            self._version = max(self._version, parse_version_label(label, self._initial_version))
            self._started = True

    async def fetch_version(self) -> int:
        """Read the server's version now (``/model_info``) and remember it."""
        await self.start()
        info = await self.http.call("/model_info", method="GET")
        self._version = parse_version_label(info.get("weight_version"), self._initial_version)
        return self._version

    async def close(self) -> None:
        if self._group is not None:
            try:
                await self.http.call("/destroy_weights_update_group", {"group_name": self._group_name})
            except SGLangError as exc:
                log.warning("destroying the weight group: %s", exc)
            await asyncio.to_thread(weight_sync.destroy_group, self._group)
            self._group = None
        await self.http.close()
        if self._process is not None:
            await asyncio.to_thread(self._process.stop)
        if self._own_weight_dir and self._weight_dir is not None:
            shutil.rmtree(self._weight_dir, ignore_errors=True)

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if request.return_hidden_states:
            return GenerateOutput(rid=request.rid, finish_reason="error",
                                  error="return_hidden_states is not supported by the SGLang adapter")
        if request.sampling.max_new_tokens - request.num_prefix_tokens <= 0:
            return GenerateOutput(rid=request.rid, finish_reason="length")
        await self.start()
        dispatch_version = self._version
        self.counters["requests"] += 1
        try:
            status, data, text = await self.http.request("POST", "/generate", generate_body(request))
        except asyncio.CancelledError:
            await asyncio.shield(self._abort_quietly(request.rid))
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.counters["errors"] += 1
            return GenerateOutput(rid=request.rid, finish_reason="error",
                                  error=f"{self.url}/generate: {type(exc).__name__}: {exc}")
        if status != 200:
            self.counters["errors"] += 1
            return GenerateOutput(rid=request.rid, finish_reason="error",
                                  error=f"{self.url}/generate answered {status}: {error_message(data, text)}")
        out = output_from_response(data, request=request, dispatch_version=dispatch_version,
                                   routing_shape=self.routing_shape)
        label = data.get("meta_info", {}).get("weight_version") if isinstance(data, dict) else None
        try:
            self._version = max(self._version, parse_version_label(label, self._version))
        except ValueError:
            pass
        if out.finish_reason == "error":
            self.counters["errors"] += 1
        return out

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (SGLang matches ids by prefix) or all; their ``generate`` calls
        return with the tokens so far and finish_reason "abort". An unreachable server is
        logged, not raised: its requests are gone anyway (and shutdown must go on)."""
        if not self._started:
            return  # nothing was sent, nothing to abort
        self.counters["aborts"] += 1
        body = {"rid": "", "abort_all": True} if rid is None else {"rid": rid, "abort_all": False}
        try:
            await self.http.call("/abort_request", body)
        except SGLangError as exc:
            log.warning("abort %s: %s", rid or "all", exc)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.http.call("/abort_request", {"rid": rid, "abort_all": False})
        except SGLangError as exc:
            log.warning("aborting %s after cancellation: %s", rid, exc)

    async def pause(self, mode: str = "in_place") -> None:
        await self.start()
        await self.http.call("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.start()
        await self.http.call("/continue_generation", {})

    # ---- weights ---------------------------------------------------------------------------
    def stage_weights(self, named_tensors: NamedTensors) -> int:
        """Keep tensors (HF names) for the next commit; each call becomes one or more buckets."""
        items = [(name, t if isinstance(t, torch.Tensor) else torch.as_tensor(t)) for name, t in named_tensors]
        if items:
            self._staged.append(items)
        return len(items)

    async def commit_weights(self, version: int, *, keep_kv_cache: bool | None = None) -> None:
        """Send the staged tensors and ``version`` to the server between pause and continue.

        On failure (SGLangError) the staged tensors are dropped and generation continues;
        the server keeps its version, though a transfer that failed after some buckets may
        have applied those. The next full update (the broadcaster sends every tensor)
        repairs that."""
        if version < self._version:
            raise ValueError(f"weight version {version} is older than the server's {self._version}")
        keep = True if keep_kv_cache is None else keep_kv_cache
        mode = self.config.sglang_pause_mode
        if mode == "auto":
            mode = "in_place" if keep else "abort"
        self._update_lock = self._update_lock or asyncio.Lock()
        async with self._update_lock:
            await self.start()
            staged, self._staged = self._staged, []
            start = time.monotonic()
            await self.http.call("/pause_generation", {"mode": mode})
            try:
                flush = mode != "in_place"  # in_place keeps the KV cache on purpose
                if not staged:
                    await self.http.call("/update_weight_version",
                                         {"new_version": str(version), "abort_all_requests": False})
                elif self.config.sglang_weight_update == "distributed":
                    await self._send_distributed(staged, version, flush)
                else:
                    await self._send_disk(staged, version, flush)
            finally:
                await self.http.call("/continue_generation", {})
            self._version = version
            self.counters["weight_updates"] += 1
            self.counters["weight_update_s"] += time.monotonic() - start

    async def update_weights(self, named_tensors: NamedTensors, version: int, *,
                             keep_kv_cache: bool | None = None) -> None:
        self.stage_weights(named_tensors)
        await self.commit_weights(version, keep_kv_cache=keep_kv_cache)

    def _backend(self) -> str:
        backend = self.config.sglang_weight_backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        return backend

    async def _ensure_group(self) -> Any:
        if self._group is not None:
            return self._group
        for name in self._broken_groups:  # a transfer failed: the server's end may linger
            try:
                await self.http.call("/destroy_weights_update_group", {"group_name": name})
            except SGLangError:
                pass
        self._broken_groups.clear()
        self._group_name = f"miles-{uuid.uuid4().hex[:8]}"
        info = await self.http.call("/server_info", method="GET")
        tp = int(info.get("tp_size", 1) or 1) if isinstance(info, dict) else 1
        host = urlparse(self.url).hostname or "127.0.0.1"
        address = self.config.sglang_weight_master_address or _address_towards(host)
        port = self.config.sglang_weight_master_port or free_port()
        backend = self._backend()
        body = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": 1 + tp,
                "group_name": self._group_name, "backend": backend}
        remote = asyncio.ensure_future(self.http.call("/init_weights_update_group", body))
        local = asyncio.ensure_future(asyncio.to_thread(
            weight_sync.init_group, master_address=address, master_port=port, rank=0, world_size=1 + tp,
            group_name=self._group_name, backend=backend, timeout_s=self.config.sglang_timeout_s))
        done, _ = await asyncio.wait({remote, local}, return_when=asyncio.FIRST_EXCEPTION)
        if remote in done and remote.exception() is not None:
            local.add_done_callback(_destroy_if_built)  # the rendezvous times out on its own
            raise remote.exception()  # type: ignore[misc]
        self._group = await local
        await remote
        return self._group

    async def _send_distributed(self, staged: list[list[tuple[str, torch.Tensor]]], version: int,
                                flush: bool) -> None:
        group = await self._ensure_group()
        device = "cuda" if self._backend() == "nccl" else "cpu"
        buckets = [b for chunk in staged for b in plan_buckets(chunk, _MAX_BUCKET_BYTES)]
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            body = {**weight_sync.describe(bucket), "group_name": self._group_name,
                    "load_format": "flattened_bucket", "flush_cache": flush and last,
                    "abort_all_requests": False, "weight_version": str(version) if last else None}
            remote = asyncio.ensure_future(self.http.call("/update_weights_from_distributed", body))
            # In a thread: NCCL's first collective on a group blocks until the server makes
            # its own, which it does once this request reaches it (the loop must send it).
            works = await asyncio.to_thread(weight_sync.start_send, group, bucket, flattened=True, device=device)
            deadline = time.monotonic() + self.config.sglang_timeout_s
            while not all(w.is_completed() for w, _ in works):
                if remote.done() and remote.exception() is not None:
                    self._drop_group()  # the receiver left mid-transfer: rebuild next time
                    raise remote.exception()  # type: ignore[misc]
                if time.monotonic() > deadline:
                    self._drop_group()
                    raise SGLangError(f"{self.url}: broadcast of bucket {i} not received "
                                      f"within {self.config.sglang_timeout_s} s")
                await asyncio.sleep(0.002)
            for w, _ in works:
                w.wait()  # surfaces a failed collective
            await remote

    def _drop_group(self) -> None:
        # not destroyed here: a collective may still be pending on it
        self._broken_groups.append(self._group_name)
        self._group = None

    async def _send_disk(self, staged: list[list[tuple[str, torch.Tensor]]], version: int, flush: bool) -> None:
        if self._weight_dir is None:
            if self.config.sglang_weight_dir:
                self._weight_dir = Path(self.config.sglang_weight_dir)
            else:
                self._weight_dir, self._own_weight_dir = Path(tempfile.mkdtemp(prefix="miles-sglang-")), True
        target = self._weight_dir / f"v{version}"
        await asyncio.to_thread(_write_checkpoint, staged, target, self.model_path)
        try:
            await self.http.call("/update_weights_from_disk", {
                "model_path": str(target), "weight_version": str(version), "flush_cache": flush,
                "abort_all_requests": False})
        finally:
            await asyncio.to_thread(shutil.rmtree, target, True)

    def stats(self) -> dict[str, float]:
        out = {f"sglang/{k}": float(v) for k, v in self.counters.items()}
        out["engine/version"] = float(self._version)
        return out


def _destroy_if_built(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        weight_sync.destroy_group(task.result())


def _address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (what the server should dial)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))  # no packet is sent: this only picks the route
        return sock.getsockname()[0]


def _routing_shape(model_path: str | None) -> tuple[int, int] | None:
    """(MoE layers, experts per token) of the checkpoint, the trailing dims of routed_experts."""
    if not model_path or not (Path(model_path) / "config.json").is_file():
        return None
    try:
        from miles.models import load_config

        cfg = load_config(model_path)
        return (len(cfg.moe_layers), cfg.num_experts_per_tok) if cfg.is_moe else None
    except ValueError:  # an architecture miles does not build: every layer routes
        hf = json.loads((Path(model_path) / "config.json").read_text())
        k = hf.get("num_experts_per_tok")
        return (int(hf["num_hidden_layers"]), int(k)) if k else None


def _write_checkpoint(staged: list[list[tuple[str, torch.Tensor]]], target: Path, model_path: str | None) -> None:
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous().clone() for chunk in staged for name, t in chunk}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    for extra in ("config.json", "generation_config.json"):
        if model_path and (Path(model_path) / extra).is_file():
            shutil.copy(Path(model_path) / extra, target / extra)
