"""Turning requests into SGLang ``/generate`` bodies and responses into GenerateOutputs.

Pure functions, unit-tested without a server. What is read, and from which SGLang version,
is listed in docs/sglang.md. The parts that need care:

- **Tokens and log-probs** come from ``meta_info.output_token_logprobs`` (``[logprob,
  token_id, text]``), as slime and miles read them; its length must equal
  ``completion_tokens`` (pitfall C.11).
- **Per-token versions.** SGLang 0.5.23 sends ``weight_versions`` spans ``{version, start,
  end}`` over the output tokens: exact. 0.5.15.post1 only sends ``weight_version``, the
  server's label when the response was emitted, which is newer than the tokens whenever an
  update landed mid-request. Then every token gets the version the adapter knew when it sent
  the request: exact when no update happened in between (emission == dispatch), otherwise a
  lower bound — older than the truth, so staleness is over-counted, never under-counted.
- **finish_reason**: stop → "stop" (``matched``), length → "length"; abort without a
  status code is a requested abort → "abort" (the worker keeps the prefix, PARTIAL); an
  abort carrying an HTTP status (SGLang's way to fail a request) → "error" with its message.
- **Routed experts**: base64 int32 rows over positions ``[start, P + n - 1)`` with ``start =
  meta_info.routed_experts_start_len`` (0 when absent, stock SGLang); response token i
  used the row of position ``P - 1 + i``, i.e. the last ``n`` rows.
- **Resumes**: the engine contract counts ``max_new_tokens`` from the original prompt, SGLang
  from this call, so the body asks for ``max_new_tokens - num_prefix_tokens``; the prefix
  length also travels in ``custom_params`` for servers that offset seeded draws by it
  (``miles serve``; SGLang ignores it).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from miles.types import FinishReason, GenerateOutput, GenerateRequest

PREFIX_KEY = "miles_num_prefix_tokens"  # same key as miles.serving.protocol


def parse_version_label(label: Any, default: int) -> int:
    """SGLang's string label → miles' integer version ("default", the label of a server
    started without --weight-version, is the adapter's initial version)."""
    if label is None or label == "default":
        return default
    try:
        return int(label)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version {label!r} is not an integer; start SGLang with "
                         f"--weight-version N (miles versions are integers)") from None


def generate_body(request: GenerateRequest) -> dict[str, Any]:
    sp = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens - request.num_prefix_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "ignore_eos": sp.ignore_eos,
    }
    if sp.stop:
        params["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        params["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.seed is not None:
        params["sampling_seed"] = sp.seed
    if request.num_prefix_tokens:
        params["custom_params"] = {PREFIX_KEY: request.num_prefix_tokens}
    body: dict[str, Any] = {"rid": request.rid, "input_ids": list(request.input_ids),
                            "sampling_params": params, "return_logprob": True}
    if request.return_routed_experts:
        body["return_routed_experts"] = True
    return body


def versions_from_spans(spans: Any, n: int, default: int) -> list[int] | None:
    """Expand ``weight_versions`` spans; None if absent or not a tiling of [0, n)."""
    if not isinstance(spans, list) or not spans:
        return None
    out: list[int] = []
    try:
        for span in spans:
            if int(span["start"]) != len(out) or int(span["end"]) < len(out):
                return None
            out += [parse_version_label(span["version"], default)] * (int(span["end"]) - int(span["start"]))
    except (KeyError, TypeError, ValueError):
        return None
    return out if len(out) == n else None


def finish_from(reason: Any) -> tuple[FinishReason, int | str | None, str | None]:
    """SGLang finish_reason object → (finish reason, matched stop, error message)."""
    if not isinstance(reason, dict):  # null: the server stopped answering mid-request
        return "error", None, "the response has no finish_reason"
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched"), None
    if kind == "length":
        return "length", None, None
    if kind == "abort":
        if reason.get("status_code"):
            return "error", None, str(reason.get("message") or "aborted by the server")
        return "abort", None, None
    return "error", None, f"unknown finish_reason {reason!r}"


def decode_routed(data: str, *, start: int, prompt_len: int, n: int,
                  shape: tuple[int, int]) -> list[list[list[int]]]:
    """Rows of the ``n`` output tokens; ``shape`` is the model's (MoE layers, top_k)."""
    arr = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    rows = prompt_len + n - 1 - start
    if n == 0:
        return []
    if rows < n or arr.size != rows * shape[0] * shape[1]:
        raise ValueError(f"routed_experts has {arr.size} values, not {rows} rows × {shape[0]} layers × "
                         f"top_k {shape[1]} covering {n} output tokens (start {start})")
    return arr.reshape(rows, *shape)[rows - n:].tolist()


def output_from_response(data: Any, *, request: GenerateRequest, dispatch_version: int,
                         routing_shape: tuple[int, int] | None = None) -> GenerateOutput:
    """A non-streaming ``/generate`` response object → GenerateOutput."""
    rid = request.rid
    try:
        meta = data["meta_info"]
        entries = meta["output_token_logprobs"]
        ids = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        return GenerateOutput(rid=rid, finish_reason="error",
                              error=f"malformed /generate response ({type(exc).__name__}: {exc})")
    n = len(ids)
    if meta.get("completion_tokens", n) != n:
        return GenerateOutput(rid=rid, finish_reason="error",
                              error=f"{n} output_token_logprobs for {meta['completion_tokens']} tokens")
    finish, matched, error = finish_from(meta.get("finish_reason"))
    versions = versions_from_spans(meta.get("weight_versions"), n, dispatch_version)
    if versions is None:
        versions = [dispatch_version] * n
    routed = None
    if request.return_routed_experts and meta.get("routed_experts") is not None:
        if routing_shape is None:
            return GenerateOutput(rid=rid, finish_reason="error", error="routed experts need the "
                                  "model's MoE shape: build the adapter with model_path")
        try:
            routed = decode_routed(meta["routed_experts"], start=int(meta.get("routed_experts_start_len", 0)),
                                   prompt_len=len(request.input_ids), n=n, shape=routing_shape)
        except ValueError as exc:
            return GenerateOutput(rid=rid, finish_reason="error", error=str(exc))
    return GenerateOutput(rid=rid, output_ids=ids, logprobs=logprobs, versions=versions,
                          finish_reason=finish, matched_stop=matched, error=error, routed_experts=routed)
