"""SGLang's ``/generate`` protocol, the subset ``miles serve`` speaks: request parsing and
response building, as pure functions (no HTTP here; ``miles.serving.generate`` wires them).

Read from SGLang 0.5.15.post1 and 0.5.23 (see docs/sglang.md and REFERENCES A.1-A.5):
``GenerateReqInput`` fields (single or batch), ``SamplingParams`` keys, the response object
``{text, output_ids, meta_info}``, ``finish_reason`` objects, ``output_token_logprobs``
entries ``[logprob, token_id, text|null]``, the 0.5.23 ``weight_versions`` spans and the
base64 int32 ``routed_experts``. Anything the embedded engine cannot honour is rejected with
a message naming the field (a silently ignored sampling knob would corrupt an RL run);
knobs that only shape the returned ``text`` are accepted.

One extension, invisible to other clients: ``sampling_params.custom_params`` (a free-form
dict SGLang passes to custom logit processors) may carry ``miles_num_prefix_tokens``, the
number of response tokens generated before this call. The engine offsets its seeded draws by
it, so an aborted and resumed request reproduces an uninterrupted one.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from miles.types import GenerateRequest, SamplingParams

PREFIX_KEY = "miles_num_prefix_tokens"

# sampling_params keys the engine honours
_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
             "ignore_eos", "sampling_seed", "custom_params"}
# keys that only shape the decoded text
_TEXT_ONLY = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False}
# keys accepted only at their neutral value
_SAMPLING_NEUTRAL: dict[str, Any] = {
    "n": 1, "min_p": 0.0, "min_new_tokens": 0, "repetition_penalty": 1.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "stop_regex": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
}
_REQUEST = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
            "return_text_in_logprobs", "return_routed_experts", "routed_experts_start_len",
            "return_prompt_token_ids", "logprob_start_len", "top_logprobs_num",
            "token_ids_logprob", "log_metrics", "priority", "stream_options"}
_REQUEST_NEUTRAL: dict[str, Any] = {
    "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None,
    "lora_path": None, "lora_id": None, "session_params": None, "custom_logit_processor": None,
    "return_hidden_states": False, "return_entropy": False, "bootstrap_host": None,
    "bootstrap_port": None, "bootstrap_room": None, "data_parallel_rank": None,
    "routed_dp_rank": None, "modalities": None,
}


class ProtocolError(ValueError):
    """The request does not fit the protocol subset; answered with HTTP 400 and this text."""


@dataclass
class Item:
    """One generation of a (possibly batched) request and how to answer it."""

    request: GenerateRequest
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    routed_start: int | None = None  # routed_experts_start_len when asked for
    return_prompt_token_ids: bool = False
    text_options: dict[str, bool] = field(default_factory=lambda: dict(_TEXT_ONLY))


@dataclass
class Parsed:
    items: list[Item]
    batch: bool
    stream: bool


def _neutral(value: Any, default: Any) -> bool:
    return value is None or value == default or value in ([], {})


def _check_keys(d: dict[str, Any], known: set[str], neutral: dict[str, Any], where: str) -> None:
    for key, value in d.items():
        if key in known:
            continue
        if key not in neutral:
            raise ProtocolError(f"{where}.{key} is not a field miles serve knows")
        if not _neutral(value, neutral[key]):
            raise ProtocolError(f"{where}.{key}={value!r} is not supported by miles serve "
                                f"(only {neutral[key]!r})")


def _int(value: Any, where: str, *, lo: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{where} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ProtocolError(f"{where} must be >= {lo}, got {value}")
    return value


def _float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{where} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"{where} must be true or false, got {value!r}")
    return value


def parse_sampling(d: Any, where: str, *, max_new_default: int) -> tuple[SamplingParams, dict[str, bool], int]:
    """SGLang sampling_params → (SamplingParams, text options, response prefix length)."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ProtocolError(f"{where} must be an object")
    _check_keys(d, _SAMPLING | set(_TEXT_ONLY), _SAMPLING_NEUTRAL, where)
    sp = SamplingParams(max_new_tokens=max_new_default)
    if d.get("max_new_tokens") is not None:
        sp.max_new_tokens = _int(d["max_new_tokens"], f"{where}.max_new_tokens", lo=0)
    if d.get("temperature") is not None:
        sp.temperature = _float(d["temperature"], f"{where}.temperature")
        if sp.temperature < 0:
            raise ProtocolError(f"{where}.temperature must be >= 0, got {sp.temperature}")
    if d.get("top_p") is not None:
        sp.top_p = _float(d["top_p"], f"{where}.top_p")
        if not 0 < sp.top_p <= 1:
            raise ProtocolError(f"{where}.top_p must be in (0, 1], got {sp.top_p}")
    if d.get("top_k") is not None:
        sp.top_k = _int(d["top_k"], f"{where}.top_k")
        if sp.top_k < 1 and sp.top_k != -1:
            raise ProtocolError(f"{where}.top_k must be -1 (whole vocabulary) or >= 1, got {sp.top_k}")
    stop = d.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ProtocolError(f"{where}.stop must be a non-empty string or a list of them")
        sp.stop = stop
    if d.get("stop_token_ids") is not None:
        ids = d["stop_token_ids"]
        if not isinstance(ids, list):
            raise ProtocolError(f"{where}.stop_token_ids must be a list of token ids")
        sp.stop_token_ids = [_int(t, f"{where}.stop_token_ids[]", lo=0) for t in ids]
    if d.get("ignore_eos") is not None:
        sp.ignore_eos = _bool(d["ignore_eos"], f"{where}.ignore_eos")
    if d.get("sampling_seed") is not None:
        sp.seed = _int(d["sampling_seed"], f"{where}.sampling_seed")
    text = dict(_TEXT_ONLY)
    for key in _TEXT_ONLY:
        if d.get(key) is not None:
            text[key] = _bool(d[key], f"{where}.{key}")
    prefix = 0
    custom = d.get("custom_params")
    if custom is not None:
        if not isinstance(custom, dict):
            raise ProtocolError(f"{where}.custom_params must be an object")
        if custom.get(PREFIX_KEY) is not None:
            prefix = _int(custom[PREFIX_KEY], f"{where}.custom_params.{PREFIX_KEY}", lo=0)
    return sp, text, prefix


def _as_list(value: Any, n: int, where: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(f"{where} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def _prompts(body: dict[str, Any], tokenizer: Any) -> tuple[list[list[int]], bool]:
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise ProtocolError("send exactly one of text and input_ids")
    if has_ids:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise ProtocolError("input_ids must be a non-empty list of token ids (or of lists)")
        batch = isinstance(ids[0], list)
        rows = ids if batch else [ids]
        for i, row in enumerate(rows):
            if not isinstance(row, list) or not row or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise ProtocolError(f"input_ids[{i}] must be a non-empty list of integers" if batch
                                    else "input_ids must be a list of integers")
        return rows, batch
    if tokenizer is None:
        raise ProtocolError("text input needs a tokenizer; this checkpoint has no tokenizer.json "
                            "(send input_ids)")
    text = body["text"]
    batch = isinstance(text, list)
    texts = text if batch else [text]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ProtocolError("text must be a string or a non-empty list of strings")
    return [tokenizer.encode(t) for t in texts], batch


def _rids(value: Any, n: int, batch: bool) -> list[str]:
    if value is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if batch:
        if not isinstance(value, list) or not all(isinstance(r, str) and r for r in value):
            raise ProtocolError("rid of a batch must be a list of non-empty strings")
        rids = _as_list(value, n, "rid")
    elif not isinstance(value, str) or not value:
        raise ProtocolError("rid must be a non-empty string")
    else:
        rids = [value]
    if len(set(rids)) != n:
        raise ProtocolError("rid values of a batch must be distinct")
    return rids


def _check_request(body: dict[str, Any]) -> None:
    _check_keys(body, _REQUEST, _REQUEST_NEUTRAL, "request")
    if body.get("logprob_start_len") not in (None, -1):
        raise ProtocolError("logprob_start_len must be -1 (output tokens only): miles serve "
                            "returns no prompt log-probs")
    if body.get("top_logprobs_num") not in (None, 0) or body.get("token_ids_logprob") not in (None, []):
        raise ProtocolError("top_logprobs_num / token_ids_logprob are not supported by miles serve")


def parse_generate(body: Any, *, tokenizer: Any, vocab_size: int, max_seq_len: int,
                   is_moe: bool) -> Parsed:
    """Validate a /generate body and turn it into engine requests (raises ProtocolError)."""
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    _check_request(body)
    rows, batch = _prompts(body, tokenizer)
    n = len(rows)
    stream = _bool(body.get("stream", False), "stream")
    if stream and batch:
        raise ProtocolError("streaming a batch is not supported by miles serve; send one request each")
    rids = _rids(body.get("rid"), n, batch)
    sps = _as_list(body.get("sampling_params"), n, "sampling_params")
    logprob = _as_list(body.get("return_logprob", False), n, "return_logprob")
    routed = _bool(body.get("return_routed_experts", False), "return_routed_experts")
    if routed and not is_moe:
        raise ProtocolError("return_routed_experts needs a mixture-of-experts model")
    start = _int(body.get("routed_experts_start_len") or 0, "routed_experts_start_len", lo=0)
    text_lp = _bool(body.get("return_text_in_logprobs", False), "return_text_in_logprobs")
    prompt_ids = _bool(body.get("return_prompt_token_ids", False), "return_prompt_token_ids")
    items = []
    for i, (ids, rid, sp_json) in enumerate(zip(rows, rids, sps)):
        where = f"sampling_params[{i}]" if batch else "sampling_params"
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ProtocolError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        if len(ids) >= max_seq_len:
            raise ProtocolError(f"prompt of {len(ids)} tokens does not fit the context length "
                                f"{max_seq_len} (one new token at least)")
        sp, text, prefix = parse_sampling(sp_json, where, max_new_default=128)
        if sp.stop and tokenizer is None:
            raise ProtocolError(f"{where}.stop needs a tokenizer; this checkpoint has none")
        sp.max_new_tokens += prefix  # the engine counts max_new_tokens from the original prompt
        req = GenerateRequest(rid=rid, input_ids=ids, sampling=sp, num_prefix_tokens=prefix,
                              return_routed_experts=routed)
        items.append(Item(request=req, return_logprob=_bool(logprob[i], "return_logprob"),
                          return_text_in_logprobs=text_lp, routed_start=start if routed else None,
                          return_prompt_token_ids=prompt_ids, text_options=text))
    return Parsed(items=items, batch=batch, stream=stream)


# ---- responses ------------------------------------------------------------------------


def version_spans(versions: list[int]) -> list[dict[str, int]]:
    """Per-token versions → 0.5.23 ``weight_versions`` spans ``{version, start, end}``."""
    spans: list[dict[str, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return [{"version": str(s["version"]), "start": s["start"], "end": s["end"]} for s in spans]


def encode_routed(rows: list[list[list[int]]]) -> str:
    return base64.b64encode(np.asarray(rows, dtype=np.int32).tobytes()).decode("ascii")


def finish_reason(kind: str | None, *, matched: int | str | None, length: int,
                  error: str | None) -> dict[str, Any] | None:
    if kind is None:
        return None
    if kind == "stop":
        return {"type": "stop", "matched": matched}
    if kind == "length":
        return {"type": "length", "length": length}
    if kind == "error":  # an engine failure mid-request: an abort with a status, as SGLang's
        return {"type": "abort", "message": error or "engine error", "status_code": 500,
                "err_type": "InternalServerError"}
    return {"type": "abort", "message": "Abort by request"}


def _text(item: Item, tokenizer: Any, ids: list[int], matched: Any) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=item.text_options["skip_special_tokens"])
    if isinstance(matched, str) and not item.text_options["no_stop_trim"]:
        cut = text.find(matched)
        text = text if cut < 0 else text[:cut]
    return text


def build_response(item: Item, *, output_ids: list[int], logprobs: list[float], versions: list[int],
                   finish: dict[str, Any] | None, weight_version: int, tokenizer: Any,
                   routed: list[list[list[int]]] | None = None, e2e_latency: float | None = None,
                   spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """One SGLang response object (a whole response, or a cumulative stream chunk); ``spec``:
    the speculative-decoding stats a speculating server adds to the final one."""
    prompt = item.request.input_ids
    meta: dict[str, Any] = {
        "id": item.request.rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "num_retractions": 0,
        "weight_version": str(weight_version),
    }
    if item.return_logprob:
        texts = ([tokenizer.decode([t], skip_special_tokens=False) for t in output_ids]
                 if item.return_text_in_logprobs and tokenizer is not None else [None] * len(output_ids))
        meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(logprobs, output_ids, texts)]
        meta["output_token_logprobs_length"] = len(output_ids)
    if finish is not None:
        meta["e2e_latency"] = e2e_latency
        meta.update(spec or {})
        meta["weight_versions"] = version_spans(versions)
        if item.routed_start is not None and routed is not None:
            # rows index positions of prompt + output; the engine knows the routing of the
            # steps that produced output tokens (positions P-1 ..), so rows start there at
            # the earliest, and the start is reported (slime reads this key)
            first = len(prompt) - 1
            start = max(item.routed_start, first)
            meta["routed_experts"] = encode_routed(routed[start - first:])
            meta["routed_experts_start_len"] = start
    out: dict[str, Any] = {"output_ids": list(output_ids), "meta_info": meta}
    if tokenizer is not None:
        out["text"] = _text(item, tokenizer, output_ids, finish.get("matched") if finish else None)
    if item.return_prompt_token_ids:
        out["prompt_token_ids"] = list(prompt)
    return out


def spec_stats(verify_ct: int, accepted: int, draft_tokens: int) -> dict[str, Any]:
    """SGLang's speculative keys for one request: ``verify_ct`` rounds, each proposing
    ``draft_tokens`` drafts, of which ``accepted`` were kept in all. SGLang divides all
    completion tokens by the rounds for the accept length; the embedded engine may decode
    some tokens by plain steps (its adaptive rule), so here it is the tokens the rounds
    emitted per round (kept drafts + the policy's own token)."""
    proposed = verify_ct * draft_tokens
    return {"spec_verify_ct": verify_ct,
            "spec_accept_length": (accepted + verify_ct) / verify_ct if verify_ct else 0.0,
            "spec_num_correct_drafts": accepted, "spec_num_proposed_drafts": proposed,
            "spec_accept_rate": accepted / proposed if proposed else 0.0}


_encoder = msgspec.json.Encoder()


def dumps(obj: Any) -> bytes:
    """JSON bytes (non-finite floats become null, as they are not valid JSON)."""
    return _encoder.encode(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
