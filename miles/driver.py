"""The driver: the whole asynchronous loop in one file.

Four things run at once, all meeting in the replay buffer:

1. ``admit``: feeds prompts into the buffer as fast as the staleness budget allows
   (``miles.scheduler``: at most ``(η + v + 1)·B`` groups ever started by version v);
2. rollout workers (``RolloutWorker.run``): lease work — partial trajectories first — and
   stream finished and partial trajectories back;
3. the train loop below: take a batch as soon as one satisfies the bound, train, publish
   version v+1 through the broadcaster, log, evaluate, checkpoint;
4. ``watch``: pings every actor; a dead rollout worker's leased work goes back to the queue
   (exactly once) and a fresh worker replaces it (``miles.supervisor``); a dead trainer stops
   the run.

With ``--enable-draft-training`` a DraftTrainer runs beside them (its own ``run`` loop): the
train loop hands it each trained batch without waiting, and it publishes draft versions
to the workers on its own channel (``miles.actors.draft_trainer``).

Modes differ only in η and in one wait: ``sync`` (η = 0) waits until every worker runs the
new weights before admitting the next batch, so no token is ever off-policy; ``one-step-off``
(η = 1) and ``async`` (η = --max-staleness) never wait. With ``--offload-rollout`` (colocated)
every engine releases its KV cache and weights before a train step and takes them back when
the new weights land, so rollout and training take turns on the GPU. Ctrl-C parks in-flight generations in
the buffer as partial trajectories, saves a checkpoint when ``--save`` is set, and writes the
ledger to summary.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

import msgspec
import ray

from miles.actors import ray_actors
from miles.checkpoint import CheckpointManager
from miles.config import MilesConfig
from miles.data import PromptDataset
from miles.outputs import RunOutputs, batch_metrics, load_debug_batches
from miles.scheduler import Scheduler
from miles.supervisor import WorkerSupervisor
from miles.utils.proc import process_start_monotonic, rss_mb


# An engine's switch to its compiled step functions (miles.engines.warmup): the switch's pause,
# the eager serving before it, the compile child's wall time, the policy version it switched at.
ENGINE_SWITCH_KEYS = ("engine/compile_switch_s", "engine/eager_serve_s", "engine/compile_child_s",
                      "engine/compiled_from_version")


class RunFailed(RuntimeError):
    """The run cannot continue (e.g. the trainer died); the message says why and what was kept."""


class Driver:
    def __init__(self, cfg: MilesConfig, dataset: PromptDataset, eval_data: PromptDataset | None) -> None:
        self._born = time.monotonic()
        self.cfg = cfg
        self.dataset = dataset
        self.eval_data = eval_data
        self.out = RunOutputs(cfg)
        ray_actors.init_ray(cfg)  # launch() joins it; timed apart: the share of start-up Ray takes
        self._ray_init_s = time.monotonic() - self._born
        self.actors = ray_actors.launch(cfg)
        self._launch_s = time.monotonic() - self._born - self._ray_init_s
        self.scheduler = Scheduler(cfg.scheduler)
        self.ckpt = CheckpointManager(cfg.run.save, keep=cfg.run.keep_checkpoints) if cfg.run.save else None
        self.stop = asyncio.Event()
        self.failure: str | None = None
        self.workers = WorkerSupervisor(cfg, self.actors, self.stop, self._fail, self._checkpoint_note)
        self.eval_tasks: list[asyncio.Task[None]] = []
        self.draft_run: Any = None
        self.step = 0
        self.trained_version = 0  # the trainer's version after the last train call (ahead of the
        # scheduler's until that step's record runs)
        self._recording: asyncio.Future[None] | None = None  # an overlapped step's record
        self.publish_sent: int | None = None  # the version the last publish sent from a step carries
        self.saved_step = -1  # the step of the last checkpoint this run wrote
        self.admit_s = 0.0
        self.trainer_rss_mb = 0.0
        self.trainer_weights: dict[str, float] = {}  # the trainer's weight-transport counters
        # Admission (data cursor + buffer) and checkpoint snapshots must not interleave, or a
        # checkpoint could hold a cursor past prompts its buffer never received.
        self.admission_lock = asyncio.Lock()
        self.startup: dict[str, float] = {}  # where the time before step 1 went (summary.json)

    # ---- the loop ---------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self._interrupt)
        status = "completed"
        try:
            await self._start()
            background = [asyncio.create_task(self._admit(), name="admission"),
                          asyncio.create_task(self._watch(), name="health check")]
            for task in background:
                task.add_done_callback(self._background_done)
            while self.step < self.cfg.run.num_rollout and not self.stop.is_set():
                try:
                    await self._train_step()
                    if self._recording is not None and self._recording.done():
                        await self._drain_record()  # a failed record stops the run here
                except ray.exceptions.RayActorError as exc:  # trainer or buffer: fatal
                    self._fail(f"{_actor_name(exc)} died ({_root_cause(exc)}){self._checkpoint_note()}")
            try:
                await self._drain_record()
            except ray.exceptions.RayActorError as exc:
                self._fail(f"{_actor_name(exc)} died ({_root_cause(exc)}){self._checkpoint_note()}")
            if self.stop.is_set():
                status = "failed" if self.failure else "interrupted"
            for task in background:
                task.cancel()
        except Exception as exc:
            status, self.failure = "failed", self.failure or f"{type(exc).__name__}: {exc}"
            raise
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            summary = await self._shutdown(status)
        if self.failure:
            raise RunFailed(self.failure)
        return summary

    async def _train_step(self) -> None:
        cfg, a = self.cfg, self.actors
        version = max(self.scheduler.version, self.trained_version)
        t0 = time.monotonic()
        self.out.metrics.start_train_clock()  # train_time: from the first step's request for data
        batch_ref = a.buffer.get_batch_async.remote(cfg.scheduler.rollout_batch_size, version)
        groups = await self._until_stopped(batch_ref)
        if groups is None:
            return
        wait_s = time.monotonic() - t0
        if cfg.scheduler.mode == "sync" and cfg.rollout.partial_rollout:
            # Over-sampled generations still running would be off-policy after this step:
            # park them now; they resume on the new weights.
            await asyncio.gather(*(w.abort_inflight.remote(version + 1) for w in a.workers.values()))
        if cfg.engine.offload_rollout:  # colocated turns: the engines' memory goes to the trainer until v+1 lands
            await asyncio.gather(*(w.offload_rollout.remote(version + 1) for w in a.workers.values()))
        self.out.dump_batch(self.step + 1, version, groups)
        if a.draft_trainer is not None:  # fresh trajectories for the draft; fire and forget
            a.draft_trainer.add_batch.remote(batch_ref)
        t1 = time.monotonic()
        # ``after``: the trainer moves no weight before the last publish has read them (an
        # actor's async calls need not start in submission order).
        metrics = await a.trainer.train.remote(batch_ref, self.publish_sent)
        train_s = time.monotonic() - t1
        trained = metrics.get("train/version")  # RLStep reports it; another backend is asked
        self.trained_version = int(trained) if trained is not None else await a.trainer.get_version.remote()
        # The buffer learns the new version before any worker can hold its weights (a put with
        # tokens of a version the buffer does not know yet is refused as invalid): the publish
        # reads the weights at once and waits for this before it hands them on.
        known = a.buffer.set_version.remote(self.trained_version)
        publish = a.trainer.publish.remote(a.broadcaster, [known])
        self.publish_sent = self.trained_version
        # Sent before the next step's get_batch, so that the record reads the buffer as this
        # step left it (the metrics row only: nothing is decided from it).
        buffer_stats = a.buffer.stats.remote()
        self.step += 1
        record = self._record(self.step, version, groups, metrics, publish, buffer_stats,
                              t0, wait_s, train_s, time.monotonic(), self._recording)
        if self._overlaps(self.step):
            self._recording = asyncio.ensure_future(record)
        else:
            self._recording = None
            await record

    def _overlaps(self, step: int) -> bool:
        """Whether this step's record (the stats, the log line) runs beside the next step's
        train call. Async runs only: there the next step does not wait for the workers to hold
        the new weights. The trainer would otherwise idle through these round trips. Inline:
        sync runs (the next batch needs the weights applied), colocated offloading, the first
        step (start-up figures), and a step with a checkpoint or an evaluation due (both need
        the step's version in place)."""
        cfg = self.cfg
        due = lambda every: bool(every) and step % every == 0  # noqa: E731
        return (cfg.scheduler.mode != "sync" and not cfg.engine.offload_rollout and step > 1
                and step < cfg.run.num_rollout and not (self.ckpt is not None and due(cfg.run.save_interval))
                and not (self.eval_data is not None and due(cfg.run.eval_interval)))

    async def _record(self, step: int, version: int, groups: list[list[Any]], metrics: dict[str, Any],
                      publish: Any, buffer_stats: Any, t0: float, wait_s: float, train_s: float,
                      end: float, previous: asyncio.Future[None] | None) -> None:
        """The rest of a step after its train call: the publish's answer, in sync runs the
        workers' acknowledgement, the version for admission, the step's metrics row, and an
        evaluation or checkpoint when due. Rows are logged in step order. ``end``: when the
        publish was sent (an overlapped step's end: the next step starts then)."""
        cfg, a = self.cfg, self.actors
        new_version = await publish
        if cfg.scheduler.mode == "sync":
            await a.broadcaster.wait_applied.remote(new_version)
        self.scheduler.on_version(new_version)
        step_s = (end if self._overlaps(step) else time.monotonic()) - t0
        metrics.update(batch_metrics(groups, version, cfg.rollout.reward_key))
        metrics.update(await self._rollout_and_buffer_stats(buffer_stats))
        # OOMs turned into a slowdown, the trainer's (smaller micro-batches) and the engines' (parked rows)
        metrics["mem/train_oom_recovered"] = metrics.get("mem/oom_recovered", 0.0)
        metrics["mem/oom_recovered"] = metrics["mem/train_oom_recovered"] + metrics.get("mem/engine_oom_recovered", 0.0)
        n = metrics["perf/trained_samples"]
        metrics.update({
            "train/version": float(new_version), "perf/step_s": step_s, "perf/wait_for_data_s": wait_s,
            "perf/train_s": train_s, "perf/trained_samples_per_s": n / step_s,
            "perf/trained_tokens_per_s": metrics["perf/trained_tokens"] / step_s,
            "perf/admission_s": self.admit_s,
        })
        self.admit_s = 0.0
        if previous is not None:
            await previous
        self._note_startup(metrics, step, t0, wait_s, train_s)
        self.out.log_step(step, metrics, at=t0 + step_s)
        if self.eval_data is not None and cfg.run.eval_interval and step % cfg.run.eval_interval == 0:
            self.eval_tasks.append(asyncio.create_task(self._evaluate(step)))
        if self.ckpt is not None and cfg.run.save_interval and step % cfg.run.save_interval == 0:
            await self._save()

    async def _drain_record(self) -> None:
        """Wait for an overlapped step's record (before a checkpoint, the summary, or shutdown)."""
        recording, self._recording = self._recording, None
        if recording is not None:
            await recording

    def _note_startup(self, metrics: dict[str, float], step: int, t0: float, wait_s: float, train_s: float) -> None:
        """summary.json's ``startup``, past the actors: the first step's parts (launch to its
        batch, its train call, launch to its end), and the compiled trainer's warm-up (its
        seconds in-process and in the background child, the step that first ran compiled)."""
        if step == 1:
            self.startup.update({"first_batch_s": t0 + wait_s - self._born, "first_train_s": train_s,
                                 "first_step_s": time.monotonic() - self._born})
            if "engine/graph_capture_s" in metrics:  # the engines' CUDA graph captures (and compiles within)
                self.startup["first_graph_capture_s"] = metrics["engine/graph_capture_s"]
        for key in ("compile_warmup_s", "compile_background_s", "compile_child_warmup_s", "compiled_from_step"):
            if f"perf/{key}" in metrics:
                self.startup[key] = metrics[f"perf/{key}"]
        # the engines' switch to compiled step functions (miles.engines.warmup), once it shows
        if "engine/compile_switch_s" in metrics and "engine_compiled_from_step" not in self.startup:
            self.startup.update({"engine_compiled_from_step": float(step),
                                 **{f"engine_{k.removeprefix('engine/')}": metrics[k] for k in ENGINE_SWITCH_KEYS}})

    async def _admit(self) -> None:
        """Keep the buffer supplied with prompts, within the staleness budget."""
        buffer, sched = self.actors.buffer, self.scheduler
        seen, version = -1, sched.version
        while not self.stop.is_set():
            # Long-poll: the buffer answers when its state changed (or after 50 ms, so that
            # a new policy version — which opens budget — is seen promptly).
            seen, ledger, room = await buffer.admission_state.remote(seen if version == sched.version else -1, 0.05)
            version = sched.version
            async with self.admission_lock:
                t0 = time.perf_counter()
                n = sched.admit(ledger, room)
                prompts = self.dataset.next(n) if n > 0 else []
                self.admit_s += time.perf_counter() - t0
                if prompts:
                    await buffer.add_prompts.remote(prompts)

    async def _watch(self) -> None:
        """Notice dead actors within ``--health-check-interval-s`` and recover (the rollout
        workers: ``miles.supervisor``); a trainer that stops answering ends the run."""
        timeout = max(5.0, 5 * self.cfg.run.health_check_interval_s)
        while not self.stop.is_set():
            await asyncio.sleep(self.cfg.run.health_check_interval_s)
            await self.workers.check(timeout)
            await self.actors.buffer.expire_leases.remote()  # hung workers' work goes back
            await self._check_failures()
            try:
                self._note_trainer(await asyncio.wait_for(self.actors.trainer.ping.remote(), timeout * 6))
            except Exception as exc:
                self._fail(f"PolicyTrainer died or stopped answering ({type(exc).__name__}){self._checkpoint_note()}")

    def _note_trainer(self, pong: dict[str, float]) -> None:
        """Keep what a trainer ping reports for the step records: its RSS and weight-transport counters."""
        self.trainer_rss_mb = pong.get("mem/trainer_rss_mb", 0.0)
        self.trainer_weights = {k: v for k, v in pong.items() if k.startswith("weights/")}

    async def _check_failures(self) -> None:
        """Stop a run in which nothing can succeed: every group of the last
        ``--max-failed-groups-in-a-row`` had a FAILED member (the reason is the user's to fix)."""
        limit = self.cfg.run.max_failed_groups_in_a_row
        if limit <= 0:
            return
        streak, reason = await self.actors.buffer.failures.remote()
        if streak >= limit:
            self._fail(f"the last {streak} groups were all dropped because a sample FAILED (last reason: "
                       f"{reason}); check --custom-rm-path, the generate function or the environment"
                       f"{self._checkpoint_note()}")

    async def _start(self) -> None:
        a = self.actors
        if self.cfg.run.load:
            await self._load(self.cfg.run.load)
        version = await a.trainer.get_version.remote()
        self.scheduler.on_version(version)
        await a.buffer.set_version.remote(version)
        if version > 0:  # resumed: workers loaded the base checkpoint, send them the weights
            await a.trainer.publish.remote(a.broadcaster)
        if a.draft_trainer is not None:
            if await a.draft_trainer.get_version.remote() > 0:  # resumed: the trained draft too
                await a.draft_trainer.publish.remote()
            self.draft_run = a.draft_trainer.run.remote()
        for worker_id, handle in list(a.workers.items()):
            await self.workers.start(worker_id, handle)
        # Construction errors (a bad checkpoint, an engine flag) are not crashes to restart
        # from: surface them once, clearly.
        pongs: dict[str, dict[str, float]] = {}
        for name, handle in [("PolicyTrainer", a.trainer), *a.workers.items()]:
            try:
                pongs[name] = await handle.ping.remote()
            except Exception as exc:
                raise RunFailed(f"{name} failed to start: {_root_cause(exc)}") from None
        workers = [p.get("rollout/init_s", 0.0) for name, p in pongs.items() if name != "PolicyTrainer"]
        self.startup = {"startup_s": time.monotonic() - self._born,  # launch to every actor built
                        "process_to_driver_s": self._born - process_start_monotonic(),  # imports, data
                        "ray_init_s": self._ray_init_s, "actor_submit_s": self._launch_s,
                        "trainer_init_s": pongs["PolicyTrainer"].get("perf/trainer_init_s", 0.0),
                        "worker_init_s_max": max(workers, default=0.0)}
        slowest = max((p for name, p in pongs.items() if name != "PolicyTrainer"),
                      key=lambda p: p.get("rollout/init_s", 0.0), default={})
        self.startup.update({f"worker_{k.removeprefix('engine/')}": v for k, v in slowest.items()
                             if k.startswith("engine/init_")})  # where its engine's construction went
        if self.eval_data is not None and self.cfg.run.eval_interval and self.step == 0:
            self.eval_tasks.append(asyncio.create_task(self._evaluate(0)))  # the starting point

    async def _until_stopped(self, ref: Any) -> Any:
        """Await ``ref`` unless the run is stopped first (then return None)."""
        task = asyncio.ensure_future(ref)
        stopper = asyncio.ensure_future(self.stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if task in done:
            return task.result()
        task.cancel()
        return None

    async def _rollout_and_buffer_stats(self, buffer_stats: Any) -> dict[str, float]:
        stats, delivery = await asyncio.gather(buffer_stats, self.actors.broadcaster.stats.remote())
        stats.update(delivery)  # weights/...: delivery times, resyncs, update size
        totals: dict[str, float] = {}
        for ws in self.workers.stats.values():
            for key in ("rollout/tokens", "rollout/busy_s", "rollout/partial", "rollout/drain_s", "rollout/swap_s",
                        "rollout/stage_s", "engine/graph_captures", "engine/graph_capture_s", "engine/idle_s",
                        "engine/busy_s", "engine/prefill_s", "engine/decode_steps", "engine/decode_rows",
                        "rollout/starved_s", "rollout/loop_lag_s", "rollout/put_calls", "rollout/lease_calls",
                        "engine/prefill_tokens", "engine/prefill_tokens_fresh", "engine/prefill_tokens_resumed",
                        "engine/prefill_tokens_recompute", "engine/prefill_tokens_shared", "engine/prefill_forwards", "engine/compile_s", "engine/warm_compile_s",
                        "engine/capture_s", "mem/engine_oom_recovered", "mem/offload_rollout_s",
                        "mem/offload_rollout_bytes"):
                totals[key] = totals.get(key, 0.0) + ws.get(key, 0.0)
            # the worst worker's: the longest decode pause a weight swap caused, the latest its
            # event loop woke up
            for key in ("engine/swap_pause_s_max", "rollout/loop_lag_max_s"):
                if key in ws:
                    totals[key] = max(totals.get(key, 0.0), ws[key])
        up = max((ws.get("rollout/uptime_s", 0.0) for ws in self.workers.stats.values()), default=0.0)
        if up:
            totals["rollout/tokens_per_s"] = totals.get("rollout/tokens", 0.0) / up
        for key in ENGINE_SWITCH_KEYS:  # the slowest engine's switch to compiled step functions
            vals = [ws[key] for ws in self.workers.stats.values() if key in ws]
            if vals and len(vals) == len(self.workers.stats):  # every engine has switched
                totals[key] = max(vals)
        for key in ("engine/fused_draw_classes", "engine/cpu_decode_kernel", "engine/lora_shared_base",
                    "engine/compiled"):
            vals = [ws[key] for ws in self.workers.stats.values() if key in ws]
            if vals:  # the worker that runs least of its step fused (seeded draws; the CPU kernel; one base copy; compiled steps)
                totals[key] = min(vals)
        limits = [ws["engine/batch_limit"] for ws in self.workers.stats.values() if "engine/batch_limit" in ws]
        if limits:  # the smallest admission cap an engine's OOMs left it with
            totals["engine/batch_limit"] = min(limits)
        stats.update(totals)
        stats.update(self.scheduler.stats())
        mean_keys = {k for ws in self.workers.stats.values() for k in ws
                     if k.startswith("spec/") or k == "engine/kv_read_useful_frac"}
        for key in mean_keys:  # speculative decoding, KV read efficiency: the workers' mean
            vals = [ws[key] for ws in self.workers.stats.values() if key in ws]
            stats[key] = sum(vals) / len(vals)
        if self.actors.draft_trainer is not None:
            try:
                stats.update(await asyncio.wait_for(self.actors.draft_trainer.ping.remote(), 30))
            except Exception as exc:  # the draft is an optimisation: note it, keep training
                stats["draft/alive"] = 0.0
                print(f"[miles] DraftTrainer not answering ({type(exc).__name__})", flush=True)
        stats["mem/worker_rss_mb"] = max((ws.get("mem/worker_rss_mb", 0.0) for ws in self.workers.stats.values()), default=0.0)
        if not self.trainer_weights:
            # a step before the health loop's first trainer ping (a short run on a fast machine):
            # ask now, so every step's record has the counters; a trainer that does not answer
            # is the health loop's to report
            with contextlib.suppress(Exception):
                self._note_trainer(await asyncio.wait_for(self.actors.trainer.ping.remote(), 30))
        stats["mem/trainer_rss_mb"] = self.trainer_rss_mb
        stats.update(self.trainer_weights)
        stats["mem/driver_rss_mb"] = rss_mb()
        return stats

    async def _evaluate(self, step: int) -> None:
        from miles.evaluation import run_evaluation

        metrics = await run_evaluation(self.cfg, self.eval_data, list(self.actors.workers.values()), step)
        self.out.log_eval(step, metrics)

    # ---- checkpoints and shutdown ------------------------------------------------------
    async def _save(self) -> None:
        from miles.checkpoint import save_run_state

        async with self.admission_lock:
            await save_run_state(self.ckpt, self.step, self.actors, self.dataset, self.scheduler)
        self.saved_step = self.step

    async def _load(self, path: str) -> None:
        from miles.checkpoint import load_run_state

        self.step = await load_run_state(path, self.actors, self.dataset, self.scheduler)
        self.saved_step = self.step  # that checkpoint holds this state already
        self.out.resumed_at(self.step)

    def _checkpoint_note(self) -> str:
        if self.ckpt is None:
            return "; no checkpoint was configured (--save)"
        return f"; last checkpoint: {self.ckpt.latest()} (resume with --load {self.ckpt.root})"

    def _interrupt(self) -> None:
        print("\n[miles] interrupted: parking in-flight work and shutting down", flush=True)
        self.stop.set()

    def _background_done(self, task: asyncio.Task[None]) -> None:
        """A loop beside the steps (admission, health checks) that ends with an error ends the
        run with it: the steps would otherwise wait for data that never comes."""
        if task.cancelled() or (exc := task.exception()) is None:
            return
        self._fail(f"the driver's {task.get_name()} loop failed: {type(exc).__name__}: {exc}{self._checkpoint_note()}")

    def _fail(self, message: str) -> None:
        self.failure = message
        self.stop.set()

    async def _shutdown(self, status: str) -> dict[str, Any]:
        a = self.actors
        with contextlib.suppress(Exception):  # a run that failed elsewhere: its last record, if it can
            await self._drain_record()
        if status == "completed" and self.eval_tasks:
            # The evaluation due at the last step is part of the run's result: let it finish.
            await asyncio.wait(self.eval_tasks, timeout=600)
        self.stop.set()
        for task in self.eval_tasks:
            task.cancel()
        self.workers.cancel_pending()
        if status == "completed" and self.cfg.run.save_hf:
            await a.trainer.export_hf.remote(self.cfg.run.save_hf, self.cfg.rollout.hf_checkpoint)
        stopped = await self.workers.wind_down()
        if a.draft_trainer is not None:
            await asyncio.gather(a.draft_trainer.stop.remote(), return_exceptions=True)
            if self.draft_run is not None:
                await asyncio.gather(self.draft_run, return_exceptions=True)
        if self.ckpt is not None and status in ("interrupted", "completed") and self.saved_step != self.step:
            await self._save()  # --save keeps the end of a run too, whatever --save-interval says
        ledger = await a.buffer.ledger.remote()
        summary = {
            "status": status,
            "failure": self.failure,
            "steps": self.step,
            "policy_version": self.scheduler.version,
            "ledger": msgspec.to_builtins(ledger),
            "ledger_ok": _ledger_ok(ledger),
            "data": self.dataset.stats(),
            "worker_restarts": self.workers.restarts,
            "worker_slow_starts": self.workers.slow_starts,
            "workers": [s for s in stopped if isinstance(s, dict)],
            "checkpoint": self.ckpt.latest() if self.ckpt else None,
            "startup": self.startup,
        }
        self.out.write_summary(summary)
        self.out.close()
        extra = [h for h in (a.draft_trainer, a.draft_broadcaster) if h is not None]
        for handle in [*a.workers.values(), *a.rewards, a.trainer, a.broadcaster, a.buffer, *extra]:
            ray_actors.kill(handle)
        ray_actors.release_placement(a)  # the GPUs go back to the cluster for the next run
        return summary


def _actor_name(exc: BaseException) -> str:
    text = str(exc)
    for cls, name in (("_PolicyTrainerActor", "PolicyTrainer"), ("_BufferActor", "ReplayBuffer"),
                      ("WeightBroadcaster", "WeightBroadcaster")):
        if cls in text:
            return name
    return "an actor"


def _root_cause(exc: BaseException) -> str:
    """The last line of a remote traceback: the error the user can act on."""
    cause = getattr(exc, "cause", None) or exc
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _ledger_ok(ledger: Any) -> bool:
    try:
        ledger.check()
    except Exception:
        return False
    return True


async def train(cfg: MilesConfig) -> dict[str, Any]:
    """Run training to ``--num-rollout`` steps; returns the summary (also in summary.json)."""
    from miles.actors.factory import load_datasets
    from miles.validation import check_functions, correction_line

    if cfg.run.load_debug_rollout_data:
        return await replay_debug_rollouts(cfg)
    check_functions(cfg)
    print(f"[miles] {correction_line(cfg)}", flush=True)  # a bad --custom-*-path fails here, before Ray starts
    dataset, eval_data = load_datasets(cfg)  # bad data fails here, before any output exists
    if cfg.env.env_path and cfg.env.env_turn_template == "auto":  # decided once, before any worker starts
        from miles.actors.factory import load_tokenizer
        from miles.envs.config import resolve_turn_template

        cfg.env.env_turn_template = resolve_turn_template("auto", load_tokenizer(cfg))
    for data in (dataset, eval_data):
        if data is not None and data.skipped:  # the run goes on without them: say so once
            print(f"[miles] {data.path}: skipped {sum(data.skipped.values())} line(s): {data.skip_summary()}",
                  flush=True)
    driver = Driver(cfg, dataset, eval_data)
    return await driver.run()


async def replay_debug_rollouts(cfg: MilesConfig) -> dict[str, Any]:
    """Train on recorded batches only: no rollout workers, no buffer (slime's debug mode)."""
    from miles.actors.factory import build_policy_trainer

    batches = load_debug_batches(cfg.run.load_debug_rollout_data)
    out = RunOutputs(cfg)
    trainer = build_policy_trainer(cfg)
    for step, groups in enumerate(batches[: cfg.run.num_rollout], start=1):
        version = trainer.version
        metrics = dict(trainer.train_step(groups))
        metrics.update(batch_metrics(groups, version, cfg.rollout.reward_key))
        out.log_step(step, metrics)
    summary = {"status": "completed", "steps": len(batches[: cfg.run.num_rollout]), "mode": "debug-replay"}
    out.write_summary(summary)
    out.close()
    return summary
