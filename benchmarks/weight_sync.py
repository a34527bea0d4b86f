"""Weight transports at hardware speed: bandwidth against the raw ceiling, and the rollout stall.

    python benchmarks/weight_sync.py [--device cpu|cuda] [--quick] [--sizes 0.5b,7b]
                                     [--transports object_store,nccl,gloo,cuda_ipc] [--no-stall]
                                     [--no-graph-pack]

For each transport (``miles.transports``) and state dict — random bf16 tensors with the
shapes of Qwen3-0.6B ("0.5b", 1.19 GB) and Qwen2.5-7B ("7b", 15.2 GB) — the trainer side
(this process) publishes a version to an engine side (``weight_sync_engine.py``: a spawned
process, or a Ray actor for the object store) that stages it exactly as an engine does
(borrowed buffers where the transport allows) and then commits it into its own parameters.

* effective bandwidth = state-dict bytes / (time from "trainer has new weights" — just
  before the sender packs — to "engine has them staged", on the engine's clock; both are
  CLOCK_MONOTONIC on one machine). The commit copy (``swap``) is reported on its own.
* the raw ceiling, measured in the same run: GPU device-to-device copy of the same bytes
  (CUDA IPC); a raw broadcast of a 1 GiB buffer over the same group (NCCL: the bus
  bandwidth, which for a broadcast equals the algorithm bandwidth; gloo likewise); a raw
  ``ray.put`` + ``get`` of one buffer of the same size landing on the engine's device
  (object store; host memcpy is printed beside it).
* goals: ≥ 80% of the ceiling for NCCL and CUDA IPC.
* CUDA IPC's pack alone, by how it is launched: one multi-tensor copy, plain copies for the
  large tensors (the default), a plain copy each, and the default as a CUDA graph replay (what
  the sender does once a pooled buffer's pack repeats; ``--no-graph-pack`` turns that off in
  the sender, for an A/B of 'to staged'). Its timed runs follow two warm-ups: the second
  update is the one that captures the graph.
* the rollout stall: a real ``EmbeddedEngine`` (Qwen3-0.6B-shaped, random weights, on the
  GPU; the tiny test model on the CPU) decodes a batch while an update arrives through the
  transport; reported: the engine's ``engine/swap_pause_s`` (the commit), the longest gap
  between two decode steps around the commit minus the median step (what a request sees),
  and tokens/s while the buckets were arriving vs before. Goal: ≤ 50 ms for 0.5B.

NCCL needs two GPUs (NCCL does not run two ranks on one GPU): with fewer it is skipped and
the table says so. Exactness: after the runs, the engine's parameters are compared with the
trainer's tensors by fingerprint (bitwise). A section is appended to benchmarks/log/weight_sync.md; extra
outputs (a JSON of every figure) go to ``--out`` (default ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from miles.models import CausalLM, ModelConfig, tiny_config  # noqa: E402
from miles.transports import make_sender  # noqa: E402
from miles.transports.cuda_ipc import capture_graph  # noqa: E402
from miles.transports.changed import fingerprints  # noqa: E402
from miles.transports.weights import MEMCPY_BYTES, layout, pack_into, plan_buckets, slots  # noqa: E402
from weight_sync_engine import EngineSide, serve  # noqa: E402

PHASES = ("prepare_s", "trip_s", "receive_s", "wait_s")  # the parts of 'to staged'
ENGINE_ID = "engine0"  # EngineSide's worker id: the addressee of IPC handles
GOAL_RATIO = 0.80
GOAL_STALL_S = 0.050
QWEN3_0_6B = dict(tie_word_embeddings=True, head_dim=128)  # the rest is ModelConfig's default
QWEN25_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                 attention_bias=True, max_position_embeddings=32768)
SIZES = {"0.5b": QWEN3_0_6B, "7b": QWEN25_7B,
         "small": dict(QWEN3_0_6B, num_hidden_layers=4, vocab_size=32768)}  # --quick


def shapes_of(model: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    cfg = ModelConfig(**model)
    with torch.device("meta"):
        lm = CausalLM(cfg)
    return [(n, tuple(t.shape)) for n, t in lm.state_dict().items()
            if not (cfg.tie_word_embeddings and n == "lm_head.weight")]


def random_weights(shapes: list[tuple[str, tuple[int, ...]]], device: str, seed: int = 0,
                   std: float = 0.02) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [(n, (torch.randn(s, generator=g, device=device) * std).to(torch.bfloat16)) for n, s in shapes]


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---- the engine side, in another process ------------------------------------------------
class Remote:
    """Calls an EngineSide in a spawned process or a Ray actor; ``start`` then ``result``."""

    def __init__(self, device: str, use_ray: bool) -> None:
        self.use_ray = use_ray
        if use_ray:
            import ray

            opts = {"num_gpus": 1} if torch.device(device).type == "cuda" else {}
            self.actor = ray.remote(EngineSide).options(max_concurrency=4, **opts).remote(
                "cuda:0" if opts else device)
        else:
            ctx = mp.get_context("spawn")
            self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
            self.proc = ctx.Process(target=serve, args=(device, self.inbox, self.outbox), daemon=True)
            self.proc.start()

    def start(self, method: str, *args: Any) -> Any:
        if self.use_ray:
            return getattr(self.actor, method).remote(*args)
        self.inbox.put((method, args))
        return None

    def result(self, pending: Any, timeout: float = 600.0) -> Any:
        if self.use_ray:
            import ray

            return ray.get(pending, timeout=timeout)
        status, value = self.outbox.get(timeout=timeout)
        if status != "ok":
            raise RuntimeError(f"engine side: {value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        return self.result(self.start(method, *args))

    def close(self) -> None:
        if self.use_ray:
            import ray

            ray.kill(self.actor)
        else:
            self.inbox.put(None)
            self.proc.join(timeout=60)


def engine_device(kind: str, device: str) -> str:
    if device == "cpu":
        return "cpu"
    return "cuda:1" if kind == "nccl" else "cuda:0"


def open_pair(kind: str, device: str, timeout_s: float, graph_pack: bool = True) -> tuple[Any, Remote]:
    """The trainer's sender and the engine side, joined into a group where needed;
    ``graph_pack``: whether the CUDA IPC sender replays its pack as a CUDA graph."""
    sender = make_sender(kind, device=device, dtype=torch.bfloat16, use_ray=kind == "object_store",
                         timeout_s=timeout_s)
    if kind == "cuda_ipc":
        sender.graph_pack = graph_pack
    remote = Remote(engine_device(kind, device), use_ray=kind == "object_store")
    if kind in ("nccl", "gloo"):
        spec = sender.new_spec(2)
        pending = remote.start("join", spec, 1)
        sender.join(spec)
        remote.result(pending)
    return sender, remote


# ---- bandwidth --------------------------------------------------------------------------
def publish_once(sender: Any, remote: Remote, version: int, plans: list, device: str,
                 method: str = "receive", *extra: Any) -> tuple[float, dict[str, float]]:
    sync(device)
    t0 = time.monotonic()
    update = sender.prepare(version, plans, full=True, base_version=-1, members=[ENGINE_ID])
    t_prepared = time.monotonic()
    pending = remote.start(method, update, *extra)
    sender.transfer(update)
    result = remote.result(pending)
    sender.release(version)
    return t0, {**result, "t_prepared": t_prepared}


def bench_transport(kind: str, size: str, args: argparse.Namespace, ceilings: dict[str, float]) -> dict[str, Any]:
    device = args.device
    shapes = shapes_of(SIZES[size])
    named = random_weights(shapes, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    plans = list(plan_buckets(named, args.bucket_mb << 20))
    buckets = 1 if kind == "cuda_ipc" else len(plans)  # CUDA IPC packs an update into one buffer
    sender, remote = open_pair(kind, device, args.timeout_s, graph_pack=not args.no_graph_pack)
    # the first run warms up allocators and connections; CUDA IPC's second captures its pack
    # as a CUDA graph (a one-off), so the timed runs see the steady state: a replay
    warmups = 2 if kind == "cuda_ipc" else 1
    try:
        remote.call("setup", shapes, "bfloat16")
        runs = []
        for r in range(args.repeats + warmups):
            t0, res = publish_once(sender, remote, r + 1, plans, device)
            if r >= warmups:
                # phases (host clocks of both processes: CLOCK_MONOTONIC is system-wide)
                runs.append({"staged_s": res["t_staged"] - t0, "swap_s": res["swap_s"],
                             "prepare_s": res["t_prepared"] - t0, "trip_s": res["t_in"] - res["t_prepared"],
                             "receive_s": res["t_received"] - res["t_in"],
                             "wait_s": res["t_staged"] - res["t_received"]})
        exact = remote.call("fingerprint") == fingerprints(named)
        graph_replays = getattr(sender, "graph_replays", 0)
        packing = pack_variants(named, device) if kind == "cuda_ipc" else {}
        ceiling_key = {"cuda_ipc": "d2d_copy", "object_store": "object_store_raw"}.get(kind, f"{kind}_bcast")
        ceilings[f"{ceiling_key}/{size}"] = measure_ceiling(kind, nbytes, sender, remote, device)
    finally:
        sender.close()
        remote.close()
        del named, plans
        if device != "cpu":
            torch.cuda.empty_cache()
    staged = statistics.median(r["staged_s"] for r in runs)
    gbps = nbytes / staged / 1e9
    ceiling = ceilings[f"{ceiling_key}/{size}"]
    return {"size": size, "transport": kind, "bytes": nbytes, "buckets": buckets, "staged_s": staged,
            **{k: statistics.median(r[k] for r in runs) for k in ("swap_s", *PHASES)},
            "gbps": gbps, "ceiling_key": ceiling_key,
            "ceiling_gbps": ceiling, "ratio": gbps / ceiling if ceiling else 0.0, "exact": exact,
            "runs": runs, "packing": packing, "graph_replays": graph_replays}


PACKINGS = {"multi-tensor": 1 << 62, "default": MEMCPY_BYTES, "memcpy each": 0}  # pack_into's memcpy_bytes
PACK_COLUMNS = (*PACKINGS, "graph")  # graph: the default pack captured once, then replayed


def pack_variants(named: list[tuple[str, torch.Tensor]], device: str, repeats: int = 5) -> dict[str, dict[str, float]]:
    """The sender's pack alone, by how ``pack_into`` splits the work: every tensor in one
    multi-tensor copy, the default (large same-dtype tensors as plain copies), a plain copy
    each; and the default captured once as a CUDA graph and replayed (what the sender does
    from a pooled buffer's second full update on). Best of ``repeats``: device ms (CUDA
    events) and host ms (the launches)."""
    metas, size = layout(named)
    flat = torch.empty(size, dtype=torch.uint8, device=device)
    dsts = slots(flat, metas)
    out = {}
    for label, memcpy_bytes in PACKINGS.items():
        dev, host = best_cuda_time(lambda: pack_into(flat, named, metas, dsts=dsts, memcpy_bytes=memcpy_bytes),
                                   device, repeats)
        out[label] = {"device_s": dev, "host_s": host}
    replay = capture_graph(lambda: pack_into(flat, named, metas, dsts=dsts), torch.cuda.Stream(device))
    dev, host = best_cuda_time(replay, device, repeats)
    out["graph"] = {"device_s": dev, "host_s": host}
    return out


def best_cuda_time(run: Any, device: str, repeats: int) -> tuple[float, float]:
    """Best of ``repeats`` calls of ``run`` after one warm-up, each from an idle device:
    (device seconds between CUDA events around it, host seconds to launch it)."""
    dev, host = float("inf"), float("inf")
    for _ in range(repeats + 1):
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        run()
        end.record()
        host = min(host, time.perf_counter() - t0)
        end.synchronize()
        dev = min(dev, start.elapsed_time(end) / 1e3)
    return dev, host


def measure_ceiling(kind: str, nbytes: int, sender: Any, remote: Remote, device: str) -> float:
    if kind == "cuda_ipc":
        return d2d_copy_gbps(nbytes, device)
    if kind == "object_store":
        return object_store_raw_gbps(nbytes, remote)
    return raw_broadcast_gbps(sender, remote, device, nbytes=min(nbytes, 1 << 30))


def d2d_copy_gbps(nbytes: int, device: str, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best, _ = best_cuda_time(lambda: dst.copy_(src), device, repeats)
    return nbytes / best / 1e9


def host_memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def object_store_raw_gbps(nbytes: int, remote: Remote, repeats: int = 3) -> float:
    import ray

    arr = np.ones(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.monotonic()
        ref = ray.put(arr)
        times.append(remote.call("raw_get", [ref]) - t0)
        del ref
    return nbytes / min(times) / 1e9


def raw_broadcast_gbps(sender: Any, remote: Remote, device: str, nbytes: int = 1 << 30, iters: int = 5) -> float:
    import torch.distributed as dist

    dev = device if sender.backend == "nccl" else "cpu"
    buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    best = float("inf")
    for _ in range(2):  # the first round warms the communicator up
        pending = remote.start("raw_broadcast", nbytes, iters)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.broadcast(buf, src=0, group=sender.group)
        sync(dev)
        best = min(best, (time.perf_counter() - t0) / iters)
        remote.result(pending)
    return nbytes / best / 1e9


# ---- stall ------------------------------------------------------------------------------
def bench_stall(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    gpu = device != "cpu"
    if gpu:
        model = dict(QWEN3_0_6B, max_position_embeddings=4096)
        engine = dict(max_batch_size=args.stall_batch, max_seq_len=2048, compile=args.compile)
        label = "0.5b"
    else:
        model = {k: v for k, v in msgspec_builtins(tiny_config()).items()}
        engine = dict(max_batch_size=8, max_seq_len=512)
        label = "tiny"
    sender, remote = open_pair(kind, device, args.timeout_s)
    try:
        shapes = remote.call("stall_begin", model, engine, args.stall_batch if gpu else 8,
                             1500 if gpu else 400, 40)
        named = random_weights(shapes, device, seed=5, std=0.02)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        plans = list(plan_buckets(named, args.bucket_mb << 20))
        t0, res = publish_once(sender, remote, 1, plans, device, "stall_update", 20)
    finally:
        sender.close()
        remote.close()
    return {"model": label, "transport": kind, "bytes": nbytes, "update_s": res["t_committed"] - t0,
            "staged_s": res["t_staged"] - t0, **{k: v for k, v in res.items() if not k.startswith("t_")}}


def msgspec_builtins(cfg: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(cfg)


# ---- driver ------------------------------------------------------------------------------
def transports_for(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(transports to run, notes on those skipped)."""
    wanted = args.transports.split(",") if args.transports else (
        ["cuda_ipc", "nccl", "object_store"] if args.device != "cpu" else ["object_store", "gloo"])
    run, notes = [], []
    for kind in wanted:
        if kind in ("nccl", "cuda_ipc") and args.device == "cpu":
            notes.append(f"{kind}: skipped (needs --device cuda)")
        elif kind == "nccl" and torch.cuda.device_count() < 2:
            notes.append(f"nccl: SKIPPED — {torch.cuda.device_count()} GPU(s) visible; NCCL does not run two "
                         "ranks on one GPU (its code path is the gloo one, tested on the CPU)")
        else:
            run.append(kind)
    return run, notes


def machine(device: str) -> str:
    gpu = ""
    if device != "cpu" and torch.cuda.is_available():
        gpu = f", {torch.cuda.device_count()}× {torch.cuda.get_device_name(0)}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs{gpu}, load average {load:.1f} "
            f"at the end), Python {platform.python_version()}, torch {torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="a 4-layer, 32k-vocab Qwen3 shape; one repeat")
    ap.add_argument("--sizes", default=None, help="comma list of 0.5b, 7b, small")
    ap.add_argument("--transports", default=None, help="comma list of object_store, nccl, gloo, cuda_ipc")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=512, help="--update-weight-buffer-size, in MiB")
    ap.add_argument("--no-stall", action="store_true", help="bandwidth only")
    ap.add_argument("--no-graph-pack", action="store_true",
                    help="the CUDA IPC sender launches its pack's copies every update instead of replaying a CUDA graph")
    ap.add_argument("--no-bandwidth", action="store_true", help="the stall only")
    ap.add_argument("--stall-batch", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="torch.compile the stall engine (slower start)")
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "weight_sync.md"))
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but CUDA is not available")
    sizes = (args.sizes or ("small" if args.quick else "0.5b,7b" if args.device == "cuda" else "0.5b")).split(",")
    if args.quick:
        args.repeats = 1
    kinds, notes = transports_for(args)
    if "object_store" in kinds:
        import ray

        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(__file__).parent),
                                                    os.environ.get("PYTHONPATH", "")])
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, num_cpus=2, num_gpus=min(torch.cuda.device_count(), 1),
                 log_to_driver=False, _node_ip_address="127.0.0.1")
    ceilings: dict[str, float] = {}
    if "object_store" in kinds and not args.no_bandwidth:
        ceilings["host_memcpy"] = host_memcpy_gbps(1 << 28 if args.quick else 1 << 30)
    rows, stalls = [], []
    for size in [] if args.no_bandwidth else sizes:
        for kind in kinds:
            print(f"[weight_sync] {size} over {kind} ...", flush=True)
            rows.append(bench_transport(kind, size, args, ceilings))
    if not args.no_stall:
        for kind in kinds:
            print(f"[weight_sync] stall over {kind} ...", flush=True)
            stalls.append(bench_stall(kind, args))
    if "object_store" in kinds:
        import ray

        ray.shutdown()
    report(rows, stalls, ceilings, notes, args)


def report(rows: list[dict], stalls: list[dict], ceilings: dict[str, float], notes: list[str],
           args: argparse.Namespace) -> None:
    cmd = "python benchmarks/weight_sync.py " + " ".join(sys.argv[1:])
    lines = [f"## weight_sync ({args.device}) — {datetime.datetime.now().isoformat(timespec='seconds')}", "",
             f"`{cmd}`", "", f"Machine: {machine(args.device)}. "
             + ("The CPU machine is shared with other engineers' jobs; figures are indicative."
                if args.device == "cpu" else "Random bf16 weights (shapes of real models; no checkpoint)."), "",
             "| state dict | transport | GB | buckets | to staged s | GB/s | ceiling (GB/s) | % of ceiling | "
             "swap s | exact | goal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        goal = r["transport"] in ("nccl", "cuda_ipc")
        verdict = ("met" if r["ratio"] >= GOAL_RATIO else "NOT met") if goal else "—"
        lines.append(f"| {r['size']} | {r['transport']} | {r['bytes'] / 1e9:.2f} | {r['buckets']} | "
                     f"{r['staged_s']:.3f} | {r['gbps']:.1f} | {r['ceiling_key']} {r['ceiling_gbps']:.1f} | "
                     f"{100 * r['ratio']:.0f}% | {r['swap_s']:.4f} | {'yes' if r['exact'] else 'NO'} | {verdict} |")
    lines += ["", "Where 'to staged' goes (medians, ms): prepare = the sender's `prepare` on the host (the "
              "pack is launched, asynchronous on CUDA); trip = to the engine process; receive = the "
              "receiver's map, views and stage (staging waits on the device for the sender's pack, so this "
              "ends when the pack does); wait = from there until the device is done.", "",
              "| state dict | transport | to staged | prepare | trip | receive | wait |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['transport']} | {1e3 * r['staged_s']:.1f} | "
                     + " | ".join(f"{1e3 * r[k]:.1f}" for k in PHASES) + " |")
    packed = [r for r in rows if r.get("packing")]
    if packed:
        lines += ["", "The CUDA IPC sender's pack alone (best of 5; device ms by CUDA events, host ms the launches; "
                  "% = the copy ceiling's time for the same bytes over the pack's device time; graph = the default "
                  "pack captured once as a CUDA graph and replayed, as the sender does from a pooled buffer's "
                  "second full update on):", "",
                  "| state dict | " + " | ".join(f"{k} device ms | {k} host ms | {k} % of ceiling"
                                               for k in PACK_COLUMNS) + " |",
                  "|---|" + "---|---|---|" * len(PACK_COLUMNS)]
        for r in packed:
            floor = r["bytes"] / (r["ceiling_gbps"] * 1e9) if r["ceiling_gbps"] else float("nan")
            lines.append(f"| {r['size']} | " + " | ".join(
                f"{1e3 * v['device_s']:.2f} | {1e3 * v['host_s']:.2f} | {100 * floor / v['device_s']:.0f}%"
                for v in (r["packing"][k] for k in PACK_COLUMNS)) + " |")
    if "host_memcpy" in ceilings:
        lines.append(f"\nHost memcpy (one thread): {ceilings['host_memcpy']:.1f} GB/s.")
    if stalls:
        lines += ["", "| engine model | transport | update GB | to staged s | to committed s | swap pause ms | "
                  "decode gap ms | median step ms | stall ms | tok/s before | tok/s while staging | goal ≤ 50 ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in stalls:
            verdict = ("met" if s["stall_s"] <= GOAL_STALL_S and s["swap_pause_s"] <= GOAL_STALL_S else "NOT met") \
                if s["model"] == "0.5b" else "—"
            lines.append(f"| {s['model']} | {s['transport']} | {s['bytes'] / 1e9:.3f} | {s['staged_s']:.3f} | "
                         f"{s['update_s']:.3f} | {1e3 * s['swap_pause_s']:.2f} | {1e3 * s['gap_s']:.1f} | "
                         f"{1e3 * s['step_s']:.1f} | {1e3 * s['stall_s']:.1f} | {s['tps_before']:.0f} | "
                         f"{s['tps_staging']:.0f} | {verdict} |")
    lines += [""] + [f"- {n}" for n in notes] + ["- ceilings measured: " + ", ".join(
        f"{k} {v:.1f} GB/s" for k, v in sorted(ceilings.items()))] + [
        "- to staged: trainer starts packing → every bucket staged in the engine (borrowed receive buffers; "
        "the commit copy is `swap`). % of ceiling = GB/s ÷ the ceiling measured in this run.",
        "- stall = longest gap between two decode steps around the commit − the median step before the update.", ""]
    text = "\n".join(lines)
    print(text)
    with open(args.results, "a", encoding="utf-8") as fh:
        fh.write("\n" + text + "\n")
    if args.out:  # the GPU machine's benchmark log does not come back; these files do
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tag = f"{args.device}{'_stall' if args.no_bandwidth else ''}{'_bandwidth' if args.no_stall else ''}"
        (Path(args.out) / f"weight_sync_{tag}.md").write_text(text + "\n", encoding="utf-8")
        (Path(args.out) / f"weight_sync_{tag}.json").write_text(json.dumps(
            {"rows": rows, "stalls": stalls, "ceilings": ceilings, "notes": notes, "machine": machine(args.device)},
            indent=2, default=str))


if __name__ == "__main__":
    main()
