"""Helpers for the ``miles serve`` / SGLang adapter tests: a tiny checkpoint, a server
subprocess on 127.0.0.1 (one per test module), and small HTTP/SSE helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import torch

from miles.models import CausalLM, build_tiny_tokenizer, load_pretrained, save_pretrained, tiny_config

REPO = Path(__file__).resolve().parents[2]


def make_checkpoint(path: Path, *, seed: int = 0, moe: bool = False) -> Path:
    """A tiny random float32 checkpoint with the tiny tokenizer (std 0.1: peaked, far from ties)."""
    torch.manual_seed(seed)
    model = CausalLM(tiny_config(initializer_range=0.1, moe=moe)).eval()
    save_pretrained(model, path, tokenizer=build_tiny_tokenizer())
    return path


def load(path: Path) -> CausalLM:
    return load_pretrained(path, dtype=torch.float32).eval()


@contextlib.contextmanager
def serve(checkpoint: Path, *args: str, log_dir: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``python -m miles serve`` on a free port; yields its base URL; stops it after."""
    # Keep the caller's PYTHONPATH after the repo (a GPU machine installs ray/msgspec there).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **(env or {}))
    log = open(log_dir / "serve.log", "w")
    cmd = [sys.executable, "-m", "miles", "serve", "--hf-checkpoint", str(checkpoint), "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    try:
        try:
            first = lines.get(timeout=120)
        except queue.Empty:
            first = ""
        match = re.search(r"listening on (http://\S+)", first)
        if match is None:
            proc.kill()
            raise RuntimeError(f"miles serve did not start: {first!r}\n{(log_dir / 'serve.log').read_text()}")
        yield match.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def request(url: str, path: str, body: Any = None, *, method: str = "POST",
                  raw: bytes | None = None) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one call."""
    async with aiohttp.ClientSession() as session:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else ({"json": body} if body is not None else {})
        async with session.request(method, url + path, **kwargs) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


async def stream(url: str, body: dict[str, Any]) -> list[Any]:
    """The SSE events of a streamed /generate: parsed JSON objects, then the string [DONE]."""
    events: list[Any] = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                text = line.decode().strip()
                if text.startswith("data: "):
                    data = text[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def wait_running(url: str, n: int = 1) -> None:
    """Until the server reports ``n`` running requests (generation has started)."""
    for _ in range(2000):
        _, loads = await request(url, "/v1/loads", method="GET")
        if loads["loads"][0]["num_running_reqs"] >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never saw {n} running requests")


def full_forward_logprobs(model: CausalLM, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token under a full forward (the trainer's view)."""
    from miles.models import token_logprobs

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return token_logprobs(logits[len(prompt) - 1 : -1], torch.tensor(tokens), temperature)
