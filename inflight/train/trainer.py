"""The synchronous and the fully-async GRPO trainers: the loops, sharing one training step and one
weight sync.

Both run on a runtime (`inflight.train.runtime`) that a starter gives them at `RLTrainer.setup`:
`start_local` (engines in this process or in child processes, the policy in this process) or
`inflight.cluster.start_ray` (both as Ray actors). The runtime holds the engines' client and the
policy, which trains and pushes new weights to the engines after every step following
`plan_weight_sync` (pause, [sleep], send, [reset], resume). The trainer adds the generator, the
data loader that records consumed prompts, metrics, evaluation and checkpoints.

- `SyncTrainer`: generate a batch, train on it, sync (nothing is in flight during the sync).
- `FullyAsyncTrainer`: `num_parallel_generation_workers` asyncio tasks generate groups
  continuously under the `StalenessManager`'s capacity law; the trainer takes
  `policy_mini_batch_size` groups from the output buffer per step and syncs the weights in flight
  (the requests frozen by the pause keep, offload or recompute their KV as the plan says).

The training step runs in a worker thread so the event loop keeps feeding the engine meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from inflight.agents.run import AgentRun, uses_agent
from inflight.client.base import InferenceClient
from inflight.config import Config, SamplingConfig
from inflight.config.job import JobConfig
from inflight.engine.heap import frozen_heap
from inflight.eval.run import eval_sets
from inflight.eval.run import evaluate as run_eval
from inflight.orchestration.engine_restarts import EngineRestarts
from inflight.rollout.task_generator import TaskGenerator, TrajectoryGroup, episode_options, request_seed
from inflight.tasks.base import Problem, Task
from inflight.tracking.metrics import MetricsLogger
from inflight.tracking.run_logs import open_run_logs
from inflight.train.checkpoint import resume_checkpoint
from inflight.train.data_setup import check_generated, model_context
from inflight.train.dynamic_sampling import DynamicSampler
from inflight.train.lora import lora_enabled
from inflight.train.policy import run_training_steps
from inflight.train.runtime import Policy, Runtime, Starter, start_local
from inflight.train.staleness import AsyncDataLoader, OutputBuffer, PromptRef, StalenessManager
from inflight.train.step_records import dump_batch, example_interval, format_example, memory_metrics

__all__ = ["FullyAsyncTrainer", "RLTrainer", "SyncTrainer", "make_trainer"]

KV_COUNTERS = (
    "resets",
    "kv_invalidated_resets",
    "recomputed_tokens",
    "preemptions",
    "prefix_cache_hit_tokens",
    "weight_updates",
    "pauses",
)


class RLTrainer:
    """What both trainers share. `await trainer.setup()` (starts the runtime with `start`), then
    `await trainer.train()`, `await trainer.evaluate()`, and finally `await trainer.close()`."""

    mode = "base"
    overlaps_evaluation = False
    """Whether the periodic evaluation runs beside the next training step (it ends before the
    next sync, so it sees only the weights it evaluates) instead of between the two steps."""

    def __init__(self, cfg: Config, job: JobConfig, task: Task, start: Starter = start_local) -> None:
        self.cfg, self.job, self.task = cfg, job, task
        self.logger: MetricsLogger | None = None
        self._start = start
        self.global_step = 0
        self.runtime: Runtime | None = None
        self.client: InferenceClient | None = None
        self.policy: Policy | None = None
        self.resumed_from: Path | None = None
        self.history: list[dict[str, Any]] = []
        self._engine_counters: dict[str, int] | None = None
        self._started = 0.0
        self._consumed_file = None
        self._error: BaseException | None = None
        self.failed_groups = 0  # groups dropped because an episode failed before its first turn
        self.restarts = EngineRestarts([], None, 0)  # the runtime's, from setup()
        self._last_eval: tuple[tuple[int, int], dict[str, Any]] | None = None
        # a periodic evaluation running beside the next training step: (step, its time, the task)
        self._evaluation: tuple[int, float, asyncio.Task[dict[str, Any]]] | None = None
        self.logged_evaluation: int | None = None  # the step of the last evaluation the loop logged
        self.time_capped = False  # training ended at job.max_train_seconds, before its steps were done
        self.agents: AgentRun | None = None  # generator.agent.path: the agent endpoint and agent

    # ---- set-up -------------------------------------------------------------------------------
    async def setup(self) -> RLTrainer:
        cfg, job = self.cfg, self.job
        torch.set_num_threads(job.threads)
        if cfg.trainer.policy.model.path is None:
            raise ValueError("no model: set trainer.policy.model.path")
        ckpt = resume_checkpoint(cfg.trainer)
        # a resumed LoRA run starts from the base model (the engines merge adapters onto an untouched
        # base) and sends the checkpoint's adapter before anything is generated
        lora_resume = ckpt is not None and lora_enabled(cfg)
        model_dir = ckpt.model_dir if ckpt and not lora_resume else cfg.trainer.policy.model.path
        self.training_steps = run_training_steps(cfg, len(self.task.train_problems()))
        self.runtime = await self._start(cfg, job, pad_id=self._pad_id(), model_dir=model_dir,
                                         version=ckpt.weight_version if ckpt else 0, ckpt=ckpt,
                                         training_steps=self.training_steps)
        self.client, self.policy = self.runtime.client, self.runtime.policy
        fully_async = cfg.trainer.fully_async
        self.restarts = EngineRestarts.of(
            self.runtime, fully_async.engine_restarts if fully_async.enabled else 0
        )
        if lora_resume:
            await self.policy.sync_weights()
        self.loader: AsyncDataLoader[Problem] = AsyncDataLoader(self.task.train_problems(),
                                                                cfg.trainer.epochs, cfg.trainer.seed)
        if ckpt is not None:
            self.loader.load_state(ckpt.data)
            self.global_step = ckpt.step
            self.resumed_from = ckpt.path
        if uses_agent(cfg):
            self.agents = await AgentRun(cfg, self.client, self.task.tokenizer, model_context(cfg)).start()
        self.generator = self._task_generator(
            cfg.generator.sampling_params, cfg.generator.n_samples_per_prompt, cfg.trainer.seed
        )
        # makes output_dir
        self.logger = open_run_logs(self.cfg, job, ckpt.step if ckpt is not None else None,
                                    total_steps=self.training_steps)
        self._consumed_file = (Path(job.output_dir) / "consumed.jsonl").open("a" if ckpt is not None else "w")
        return self

    @property
    def policy_version(self) -> int:
        """The weight version the policy (and, after each sync, the engines) hold."""
        return self.policy.weight_version

    def _pad_id(self) -> int:
        tok = self.task.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return int(pad or 0)

    async def close(self) -> None:
        """Stop the runtime (engines, policy) and release files (idempotent)."""
        if self.agents is not None:
            await self.agents.close()
        if self.runtime is not None:
            await self.runtime.close()
        if self.logger is not None:
            self.logger.close()
        if self._consumed_file is not None and not self._consumed_file.closed:
            self._consumed_file.close()

    # ---- evaluation ---------------------------------------------------------------------------
    def eval_generator(self) -> TaskGenerator:
        """The training generator's episodes with `generator.eval_sampling_params` and
        `generator.eval_n_samples_per_prompt`, seeded from `trainer.seed` (every evaluation draws
        the same per-sample seeds, so evaluations at different steps differ only by the weights)."""
        generator = self.cfg.generator
        return self._task_generator(generator.eval_sampling_params, generator.eval_n_samples_per_prompt,
                                    request_seed(self.cfg.trainer.seed, "eval"))

    def _task_generator(self, sampling: SamplingConfig, n: int, seed: int) -> TaskGenerator:
        if self.agents is not None:  # the agent plays the episodes, through the agent endpoint
            return self.agents.generator(sampling, n, seed)
        return TaskGenerator(self.client, self.task, n=n, temperature=sampling.temperature,
                             top_p=sampling.top_p, top_k=sampling.top_k,
                             max_tokens=min(sampling.max_generate_length, self.task.max_new_tokens),
                             max_context=self.cfg.generator.inference_engine.max_model_len, seed=seed,
                             **episode_options(self.cfg, sampling))

    async def evaluate(self) -> dict[str, Any]:
        """Evaluate the current weights on every problem of the held-out sets, through the engine:
        `{"accuracy": pass@1 over all sets, "reward": mean reward, "seconds", "datasets": {name:
        {num_problems, mean_reward, pass@k, ...}}, "metrics": the flat `eval/...` keys}`. With
        `trainer.dump_eval_results` the samples and metrics go to `<output_dir>/eval/step_<k>/`. Asked again
        at the same step and weights, it returns the evaluation it already made."""
        key = (self.global_step, self.policy_version)
        if self._last_eval is not None and self._last_eval[0] == key:
            return self._last_eval[1]
        result = await run_eval(self.eval_generator(), eval_sets(self.task), self.task.decode,
                                self.cfg.generator.eval_n_samples_per_prompt,
                                concurrency=self.cfg.trainer.eval_batch_size)
        if self.cfg.trainer.dump_eval_results:
            result.write(Path(self.job.output_dir) / "eval" / f"step_{self.global_step}")
        summary = {"accuracy": result.accuracy, "reward": result.mean_reward, "seconds": result.seconds,
                   "datasets": result.metrics, "metrics": result.log_metrics(), "step": self.global_step}
        self._last_eval = (key, summary)
        return summary

    # ---- pieces the loops share ---------------------------------------------------------------
    async def _generate(self, ref: PromptRef[Problem]) -> TrajectoryGroup:
        group = await self.generator(ref.item, epoch=ref.epoch, index=ref.index)
        group.ref = ref
        return group

    def _should_stop(self) -> bool:
        job = self.job
        if self.global_step >= self.training_steps:
            return True
        if job.max_train_seconds is not None and time.perf_counter() - self._started >= job.max_train_seconds:
            self.time_capped = True
            return True
        return False

    def _record_consumed(self, step: int, prompt_ids: list[str], kind: str = "trained") -> None:
        self._consumed_file.write(json.dumps({"step": step, kind: prompt_ids}) + "\n")
        self._consumed_file.flush()

    def reject(self, group: TrajectoryGroup, kind: str = "rejected") -> None:
        """A group filtered out at generation (`rejected`: no reward signal; `failed`: none of its
        episodes finished, `TrajectoryGroup.usable`): consumed, never trained, recorded as `kind`."""
        self.loader.mark_consumed(group.ref)
        self._record_consumed(self.global_step + 1, [group.prompt_id], kind)
        if kind == "failed":
            self.failed_groups += 1

    @property
    def drops_uninformative(self) -> bool:
        """Whether groups whose rewards are all equal are dropped at generation (and others generated
        in their place): `trainer.fully_async.sample_full_batch`, or dynamic sampling `filter` in the
        fully-async trainer (the same thing there)."""
        trainer = self.cfg.trainer
        return trainer.fully_async.sample_full_batch or (
            self.mode == "fully_async" and trainer.algorithm.dynamic_sampling.type == "filter")

    def _dropped(self, group: TrajectoryGroup) -> str | None:
        """Why `group` is not trained on (`failed`, `rejected`), or None to train on it."""
        if not group.usable:
            return "failed"
        if self.drops_uninformative and group.spread <= self.cfg.trainer.algorithm.zero_variance_filter_tol:
            return "rejected"
        return None

    async def _finish_evaluation(self) -> None:
        """Wait for the evaluation started in the background (`overlaps_evaluation`), if any, and
        log its metrics as a record of the step it evaluated, at that step's time."""
        if self._evaluation is None:
            return
        step, at, running = self._evaluation
        self._evaluation = None
        result = await running
        self.logger.log(step, {"time": at, **result["metrics"]})
        self.logged_evaluation = step

    def _drop_evaluation(self) -> None:
        """Cancel a background evaluation (the loop is ending on an error)."""
        if self._evaluation is not None:
            self._evaluation[2].cancel()
            self._evaluation = None

    async def _kv_counters(self) -> dict[str, float]:
        stats = await self.client.stats()
        if not stats:  # the engines report no counters (an HTTP server)
            return {}
        previous, self._engine_counters = self._engine_counters or stats, stats
        # max(0, ...): a restarted engine counts from zero again
        return {f"kv/{k}": float(max(0, stats[k] - previous.get(k, 0))) for k in KV_COUNTERS if k in stats}

    async def _train_on(
        self, groups: list[TrajectoryGroup], waited_s: float, step_started: float
    ) -> dict[str, Any]:
        """The shared tail of every step: train, sync the weights, record, checkpoint."""
        check_generated(groups, self.cfg)  # zero tokens would train on nothing, silently
        async with self.restarts.lock:  # no engine restart while the weights change and sync
            t0 = time.perf_counter()
            metrics: dict[str, Any] = await self.policy.train(groups, self.policy_version)
            t1 = time.perf_counter()
            await self._finish_evaluation()  # it evaluates the weights this sync replaces
            report = await self.restarts.sync(self.policy)
            train_s, sync_s = t1 - t0, time.perf_counter() - t1
        self.global_step += 1
        originals = [g for g in groups if g.ref is not None]  # not dynamic sampling's copies
        for group in originals:
            self.loader.mark_consumed(group.ref)
        data_state = self.loader.state()  # captured right after the step: no await in between
        self._record_consumed(self.global_step, [g.prompt_id for g in originals])
        step_s = time.perf_counter() - step_started
        metrics.update(await self._kv_counters())
        if self.agents is not None:
            metrics.update(self.generator.metrics(groups))
        metrics.update({
            "time": time.perf_counter() - self._started,
            "epoch": float(max(g.epoch for g in groups)),
            "weight_version": float(report.version),
            "timing/wait_s": waited_s,
            "timing/train_s": train_s,
            "timing/sync_s": sync_s,
            "timing/pause_s": report.timings.get("pause_s", 0.0),
            "timing/stage_s": report.timings.get("stage_s", 0.0),
            "timing/send_s": report.timings.get("send_s", 0.0),
            "timing/step_s": step_s,
            "throughput/tokens_per_s": metrics["generated_tokens"] / max(step_s, 1e-9),
            "throughput/samples_per_s": metrics["samples"] / max(step_s, 1e-9),
            "rollout/failed_groups": float(self.failed_groups),
            **self.restarts.metrics(),
            **self._lending_metrics(),
        })
        interval = self.cfg.trainer.eval_interval
        if interval > 0 and self.global_step % interval == 0:
            if self.overlaps_evaluation:
                self._evaluation = (self.global_step, metrics["time"], asyncio.create_task(self.evaluate()))
            else:
                metrics.update((await self.evaluate())["metrics"])
                self.logged_evaluation = self.global_step
        self._step_records(groups, metrics)
        self.history.append(self.logger.log(self.global_step, metrics))
        await self._save_on_interval(data_state)
        return metrics

    def _lending_metrics(self) -> dict[str, float]:
        """The engines' steps since the last step and the fraction run with the trainer's threads
        (`ThreadLending.metrics`; none where the engines take none)."""
        lending = getattr(self.policy, "lending", None)
        return lending.metrics() if lending is not None else {}

    def _step_records(self, groups: list[TrajectoryGroup], metrics: dict[str, Any]) -> None:
        """The example printed, the batch dumped and the memory measured, as `trainer.*` asks."""
        trainer, step = self.cfg.trainer, self.global_step
        interval = example_interval(trainer)
        if interval > 0 and step % interval == 0:
            print(format_example(groups, self.task.decode, step), flush=True)
        if trainer.dump_data_batch:
            dump_batch(groups, self.job.output_dir, step)
        if trainer.enable_ray_gpu_monitor:
            metrics.update(memory_metrics())

    async def _save_on_interval(self, data_state: dict[str, Any] | None = None, final: bool = False) -> None:
        """The checkpoint (`trainer.ckpt_interval`) and the HF export (`trainer.hf_save_interval`)
        due at this step; with `final` (the end of training), those whose interval this step is not."""
        trainer, step = self.cfg.trainer, self.global_step
        if trainer.ckpt_interval > 0 and (step % trainer.ckpt_interval == 0) != final:
            await self.policy.save(
                trainer.ckpt_path,
                step,
                data_state or self.loader.state(),
                {"mode": self.mode},
                trainer.max_ckpts_to_keep,
            )
        if trainer.hf_save_interval > 0 and (step % trainer.hf_save_interval == 0) != final:
            await self.policy.export(trainer.export_path, step)

    async def train(self) -> list[dict[str, Any]]:
        """Run `trainer.epochs` over the data (or `trainer.max_training_steps`, or until
        `job.max_train_seconds`); returns the
        per-step records. Saves a final checkpoint when checkpointing is on."""
        self._started = time.perf_counter()
        if self._engine_counters is None:
            await self._kv_counters()
        start_step = self.global_step
        with frozen_heap():
            try:
                await self._run()
                await self._finish_evaluation()
            finally:
                self._drop_evaluation()
        if self.global_step > start_step:
            await self._save_on_interval(final=True)
        return self.history

    async def _run(self) -> None:
        raise NotImplementedError


class SyncTrainer(RLTrainer):
    """Generate `train_batch_size` groups with the current weights, train, sync, repeat; with
    `trainer.algorithm.dynamic_sampling`, more batches until a full batch has a learning signal
    (`inflight.train.dynamic_sampling`)."""

    mode = "sync"

    async def _run(self) -> None:
        colocated = self.cfg.trainer.placement.colocate_all
        sampler = DynamicSampler.from_config(self.cfg)
        while not self._should_stop():
            started = time.perf_counter()
            groups = await self._generate_batch()
            if groups is None:  # the data ran out: what dynamic sampling collected is a last batch
                groups = sampler.rest() if sampler is not None else []
                if not groups:
                    break
            elif sampler is not None:
                groups, dropped = sampler.offer(groups, self.global_step + 1)
                for group, why in dropped:
                    self.reject(group, why)
                if groups is None:
                    continue
            if not groups:
                continue
            waited = time.perf_counter() - started
            if colocated:  # the trainer needs the memory; the sync wakes the engine up again
                await self.client.sleep(offload_kv=False)
            await self._train_on(groups, waited, started)

    async def _generate_batch(self) -> list[TrajectoryGroup] | None:
        """The groups of the next `train_batch_size` prompts, failed ones (and, with
        sample_full_batch, uninformative ones) recorded and left out; None when no prompt is left."""
        refs = [
            r for r in (self.loader.next() for _ in range(self.cfg.trainer.train_batch_size)) if r is not None
        ]
        if not refs:
            return None
        groups = list(await asyncio.gather(*(self._generate(r) for r in refs)))
        kept = []
        for group in groups:
            if (why := self._dropped(group)) is not None:
                self.reject(group, why)
            else:
                kept.append(group)
        return kept


class FullyAsyncTrainer(RLTrainer):
    """K generation workers under the staleness manager; one training step per mini-batch. The
    periodic evaluation overlaps the next training step (the trainer's core trains while the
    engines evaluate)."""

    mode = "fully_async"
    overlaps_evaluation = True

    async def _run(self) -> None:
        trainer = self.cfg.trainer
        mini = trainer.policy_mini_batch_size
        if trainer.train_batch_size != mini:
            raise ValueError("the fully-async trainer takes one optimizer step per training step: set "
                             "trainer.train_batch_size equal to trainer.policy_mini_batch_size")
        workers_n = trainer.fully_async.num_parallel_generation_workers
        self.staleness = StalenessManager(trainer.fully_async.max_staleness_steps, mini, workers_n,
                                          global_step=self.global_step + 1, accepted=self.global_step * mini)
        self._lend_engine_threads()
        self.buffer: OutputBuffer[TrajectoryGroup] = OutputBuffer()
        workers = [
            asyncio.create_task(self._worker(), name=f"generation-worker-{i}") for i in range(workers_n)
        ]
        finished = False
        try:
            while not self._should_stop():
                started = time.perf_counter()
                with self._waiting():  # nothing to train: the engines take the trainer's threads
                    groups = await self.buffer.get(mini)
                if self._error is not None:
                    raise self._error
                if not groups:
                    break
                await self._train_on(groups, time.perf_counter() - started, started)
                self.staleness.step_done()
            finished = True
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            if finished:  # the last step's evaluation runs on: the abort below would cut its requests short
                await self._finish_evaluation()
            with contextlib.suppress(Exception):  # the engine may be gone already (shutdown after an error)
                try:  # abort what still generates: the engine is idle for evaluation
                    await self.client.pause("abort")
                finally:
                    await self.client.resume()

    def _lend_engine_threads(self) -> None:
        """Lend the training step the engines' threads whenever generation is ahead (bounded
        staleness reached, nothing generating) and no evaluation runs on the engines; take them
        back as soon as that ends, within the step (`inflight.orchestration.thread_lending`)."""
        follow = getattr(self.policy, "follow_lending", None)  # a Ray policy's threads stay its own
        if follow is None:
            return
        lending, staleness = follow(), self.staleness
        staleness.on_change = lambda: lending.lend(staleness.generation_ahead and self._evaluation is None)

    def _waiting(self) -> contextlib.AbstractContextManager[None]:
        """While the trainer waits for groups, its engines compute with its threads added
        (`ThreadLending.waiting`; a Ray policy's threads stay its own)."""
        lending = getattr(self.policy, "lending", None)
        return lending.waiting() if lending is not None else contextlib.nullcontext()

    async def _worker(self) -> None:
        manager, buffer = self.staleness, self.buffer
        while True:
            await manager.start()
            seq = buffer.ticket()  # groups reach the trainer in the order they start
            ref = self.loader.next()
            if ref is None:
                manager.cancel()
                buffer.skip(seq)
                self._maybe_close_buffer()
                return
            try:
                group = await self._generate_until_done(ref)
            except BaseException as err:
                manager.cancel()
                if not isinstance(err, asyncio.CancelledError):  # the trainer's loop raises it
                    self._error = err
                    buffer.close()
                raise
            if (why := self._dropped(group)) is not None:
                manager.reject()
                buffer.skip(seq)
                self.reject(group, why)
            else:
                manager.accept()
                buffer.put(group, seq)
            self._maybe_close_buffer()

    async def _generate_until_done(self, ref: PromptRef[Problem]) -> TrajectoryGroup:
        """The group of `ref`; generated again when an engine died under it and was restarted
        (the worker keeps its staleness slot and buffer ticket: the prompt is neither lost nor
        trained twice)."""
        while True:
            since = self.restarts.restarts
            try:
                return await self._generate(ref)
            except Exception as err:  # not CancelledError (a BaseException): a cancelled worker stops
                if not await self.restarts.recover(err, self.policy, since):
                    raise

    def _maybe_close_buffer(self) -> None:
        if self.loader.exhausted and self.staleness.running == 0:
            self.buffer.close()


def make_trainer(cfg: Config, job: JobConfig, task: Task, **kwargs: Any) -> RLTrainer:
    """`FullyAsyncTrainer` when `trainer.fully_async.enabled`, else `SyncTrainer` (`kwargs`: those
    of `RLTrainer`, e.g. `start=inflight.cluster.start_ray`)."""
    cls = FullyAsyncTrainer if cfg.trainer.fully_async.enabled else SyncTrainer
    return cls(cfg, job, task, **kwargs)
