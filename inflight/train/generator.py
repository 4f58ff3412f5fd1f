"""Generators: an async function from a prompt to a group of trajectories, through an InferenceClient.

`TaskGenerator(client, task, ...)` is the built-in one: for a `Problem` it plays `n` episodes of
the task's environment concurrently (single-turn by default; multi-turn when the environment
answers with observations), and returns a `TrajectoryGroup`. For every response token it keeps the
token id, the engine's log-probability, the weight version that sampled it and a loss mask that is
0 on environment tokens (observations are context, not actions). The turns of one episode share a
`session_id`, so a client over several engines keeps the episode on one engine. Any `async (problem) ->
TrajectoryGroup` callable can take its place in the trainers.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.engine.request import SamplingParams
from inflight.tasks.base import Problem, Task

ENV_VERSION = -1
"""`versions` entry of tokens the model did not sample (environment observations)."""


@dataclass
class Trajectory:
    """One episode: the prompt and everything after it, aligned per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    reward: float
    finish_reason: str
    num_turns: int = 1
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def model_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]


@dataclass
class TrajectoryGroup:
    """The `n` trajectories of one prompt (a GRPO group), plus where the prompt came from.

    `epoch` / `index`: the prompt's place in the data order (checkpoints record consumed prompts);
    `scheduled_version`: the trainer's weight version when the group was started.
    """

    problem: Problem
    trajectories: list[Trajectory]
    epoch: int = 0
    index: int = 0
    scheduled_version: int = 0
    generate_s: float = 0.0
    ref: Any = None
    """The data loader's handle of the prompt (set by the trainers)."""

    @property
    def prompt_id(self) -> str:
        return self.problem.id

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def informative(self) -> bool:
        """Rewards differ within the group (otherwise every advantage is zero)."""
        r = self.rewards
        return bool(r) and max(r) > min(r)


GenerateFn = Callable[[Problem], Awaitable[TrajectoryGroup]]


def request_seed(*parts: object) -> int:
    """A stable 31-bit sampling seed from the given parts (run seed, epoch, prompt id, sample)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class TaskGenerator:
    """`n` episodes of `task`'s environment per prompt, sampled through `client`.

    `max_tokens` caps each model turn (default: the task's `max_new_tokens`); `max_context`
    caps prompt + response over all turns (multi-turn episodes end there). With `seed` set, each
    sample gets its own seed from (seed, epoch, prompt id, sample index), so a run is reproducible
    whatever else is in the engine's batch.
    """

    def __init__(
        self,
        client: Any,
        task: Task,
        n: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int | None = None,
        max_context: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.client, self.task, self.n = client, task, n
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_tokens = max_tokens or task.max_new_tokens
        self.max_context = max_context
        self.seed = seed

    def params(self, max_tokens: int, seed: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=seed,
            logprobs=True,
            stop_token_ids=self.task.stop_token_ids,
        )

    async def __call__(self, problem: Problem, epoch: int = 0, index: int = 0, version: int = 0) -> TrajectoryGroup:
        started = time.perf_counter()
        trajectories = await asyncio.gather(*(self.episode(problem, epoch, i) for i in range(self.n)))
        return TrajectoryGroup(problem, list(trajectories), epoch, index, version, time.perf_counter() - started)

    async def episode(self, problem: Problem, epoch: int = 0, sample: int = 0) -> Trajectory:
        """Play one episode: generate, let the environment score it, append its observation, repeat."""
        env = self.task.make_env(problem)
        prompt = self.task.encode_prompt(env.reset())
        traj = Trajectory(prompt, [], [], [], [], 0.0, "stop", num_turns=0)
        session = uuid.uuid4().hex  # every turn on one engine: its prefix cache holds the episode
        for turn in range(max(1, env.max_turns)):
            budget = self.max_tokens
            if self.max_context is not None:
                budget = min(budget, self.max_context - len(prompt) - len(traj.response_ids))
                if budget < 1:
                    traj.finish_reason = "length"
                    break
            seed = None if self.seed is None else request_seed(self.seed, epoch, problem.id, sample, turn)
            out = await self.client.generate(prompt + traj.response_ids, self.params(budget, seed),
                                             session_id=session)
            tokens = list(out.output_token_ids)
            traj.response_ids += tokens
            traj.logprobs += list(out.logprobs or [0.0] * len(tokens))
            traj.versions += list(out.token_weight_versions)
            traj.loss_mask += [1] * len(tokens)
            traj.finish_reason = out.finish_reason or "stop"
            traj.num_turns = turn + 1
            traj.num_recomputed_tokens += out.num_recomputed_tokens
            traj.num_cached_tokens += out.num_cached_tokens
            if out.finish_reason == "abort":
                break
            result = env.step(self.task.decode(tokens))
            traj.reward += float(result.reward)
            traj.info.update(result.info)
            if result.done or result.observation is None:
                break
            observation = self.task.encode(result.observation)
            traj.response_ids += observation
            traj.logprobs += [0.0] * len(observation)
            traj.versions += [ENV_VERSION] * len(observation)
            traj.loss_mask += [0] * len(observation)
        return traj


async def generate_groups(generate: GenerateFn, problems: Sequence[Problem]) -> list[TrajectoryGroup]:
    """Run a generator over several prompts concurrently (the synchronous trainer's rollout)."""
    return list(await asyncio.gather(*(generate(p) for p in problems)))
