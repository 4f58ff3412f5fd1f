"""Generators: an async function from a prompt to a group of trajectories, through an InferenceClient.

`TaskGenerator(client, task, ...)` is the built-in one: for a `Problem` it plays `n` episodes of
the task's environment concurrently (single-turn by default; multi-turn when the environment
answers with observations), and returns a `TrajectoryGroup`. For every response token it keeps the
token id, the engine's log-probability, the weight version that sampled it and a loss mask that is
0 on environment tokens (observations are context, not actions). The turns of one episode share a
`session_id`, so a client over several engines keeps the episode on one engine. Any `async (problem) ->
TrajectoryGroup` callable can take its place in the trainers.

Multi-turn is token-in/token-out: the model's sampled ids are kept verbatim (never decoded and
re-encoded) and the next turn's prompt is the previous prompt plus those ids plus the observation.
A text observation is appended as its tokens; chat messages (`{"role": "tool" | "user", ...}`)
are appended as the tokens the tokenizer's chat template writes between the assistant turn and the
next one (`inflight.chat.turns.between_turns`: the end of the turn, the messages, the generation
prompt). When the model ended its turn with the template's end-of-turn token (`<|im_end|>`) it
sampled that token (loss mask 1) and the template's copy is dropped; after a turn ended by a stop
string the whole end of turn is the template's (mask 0). All of these get version `ENV_VERSION`.

Turns: an environment's own `max_turns` wins; one that leaves it None gets `max_turns` (the
config's `generator.max_turns`, default 1). A turn cut by the token budget (`finish_reason
"length"`) is scored and ends the episode, as does reaching `max_context`.

Stop strings (`stop`, `generator.sampling_params.stop`): the engine works on token ids, so the
response is decoded and cut at the first stop string to complete (`inflight.chat.stop`): the
tokens up to and including the one that completed it are kept and trained on; the text given to
the environment drops the stop string unless `include_stop_str_in_output` (vLLM's default: drop).
A stop string that one token spells is also an engine stop token, so generation ends right there;
any other runs on to EOS or the budget and the rest is discarded (the clients return whole
responses).

Environment failures (`skip_failed_rollouts`, default true): building the environment, `reset()` or
turning an observation into tokens that raises ends that episode only: it scores 0 with what it
generated so far (`Trajectory.rollout_failed`, `info["rollout_error"]`); one that failed before its
first turn has no prompt to train on (`Trajectory.usable` is false), and the trainers drop its group.
False lets the error end the run, naming the problem. Client and engine errors always propagate.

Reward failures: a `step()` (the reward) that raises, returns no finite number, or takes longer
than `reward_timeout_s` (`environment.reward_timeout_s`) scores its sample 0, sets
`Trajectory.reward_failed` (counted as `reward/failures` in the step's metrics) and ends the
episode; the run goes on. With a timeout, a synchronous `step()` runs in its own daemon thread (a
hung one is abandoned there, and cannot block the engine's event loop or the process's exit),
unless it is marked `@bounded` (`inflight.tasks.base`: the built-in synthetic tasks' rewards, pure
functions of microseconds), which is called on the loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.chat.stop import single_token_stops, truncate_at_stop
from inflight.chat.turns import as_messages, between_turns
from inflight.engine.request import SamplingParams
from inflight.tasks.base import Environment, Problem, StepResult, Task, in_thread, step_is_bounded

log = logging.getLogger(__name__)

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
    reward_failed: bool = False
    """The reward / environment step raised or timed out: the sample scores 0 (`info["reward_error"]`
    says why)."""
    rollout_failed: bool = False
    """The environment failed outside its reward (built, reset, observation): the episode ended there
    and scores 0 (`info["rollout_error"]` says why)."""

    @property
    def usable(self) -> bool:
        """Whether there is a sequence to train on (an episode that failed before its first turn has
        no prompt)."""
        return bool(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def model_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]


@dataclass
class TrajectoryGroup:
    """The `n` trajectories of one prompt (a GRPO group), plus where the prompt came from.

    `epoch` / `index`: the prompt's place in the data order (checkpoints record consumed prompts).
    """

    problem: Problem
    trajectories: list[Trajectory]
    epoch: int = 0
    index: int = 0
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
    def usable(self) -> bool:
        """Every trajectory has a sequence to train on (see `Trajectory.usable`)."""
        return all(t.usable for t in self.trajectories)

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


@dataclass
class Turn:
    """One model turn after stop strings: what is kept, the text the environment sees, why it ended."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finish_reason: str


class Conversation:
    """An episode's chat so far (the context the template renders observation messages in)."""

    def __init__(self, task: Task, opening: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        self.task, self.tools = task, tools or None
        self.messages = [{"role": "user", "content": opening}] if isinstance(opening, str) else list(opening)
        if self.tools:  # the template lists the tools (a system turn, for Qwen's)
            self.prompt_ids = task.encode_chat(self.messages, self.tools)
        else:
            self.prompt_ids = task.encode_prompt(opening)

    def observation_ids(self, turn: Turn, observation: Any, stop_ids: set[int]) -> list[int]:
        """The tokens that follow the model's `turn`: a text observation's own, or what the chat
        template writes after the turn for observation messages (less the end-of-turn token the
        model sampled itself)."""
        said = {"role": "assistant", "content": turn.text}
        if isinstance(observation, str):
            self.messages.append(said)
            return self.task.encode(observation)
        messages = as_messages(observation)
        ids = between_turns(self.task.tokenizer, self.messages, messages, self.tools)
        if ids and turn.tokens and turn.tokens[-1] == ids[0] and ids[0] in stop_ids:
            ids = ids[1:]
        self.messages += [said, *messages]
        return ids


class TaskGenerator:
    """`n` episodes of `task`'s environment per prompt, sampled through `client`.

    `max_tokens` caps each model turn (default: the task's `max_new_tokens`); `max_context`
    caps prompt + response over all turns (multi-turn episodes end there). With `seed` set, each
    sample gets its own seed from (seed, epoch, prompt id, sample index), so a run is reproducible
    whatever else is in the engine's batch. `stop`, `include_stop_str_in_output`, `max_turns` and
    `reward_timeout_s`: see the module docstring (`episode_options(cfg)` reads them from a config).
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
        *,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        max_turns: int = 1,
        reward_timeout_s: float | None = None,
        skip_failed_rollouts: bool = True,
    ) -> None:
        self.client, self.task, self.n = client, task, n
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_tokens = max_tokens or task.max_new_tokens
        self.max_context = max_context
        self.seed = seed
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_turns = max_turns
        self.reward_timeout_s = reward_timeout_s
        self.skip_failed_rollouts = skip_failed_rollouts
        self._sessions, self._session_ids = uuid.uuid4().hex, itertools.count()  # uuid4 a sample cost ~12 us
        raw = lambda ids: task.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        extra = single_token_stops(self.stop, task.encode, raw) if self.stop else []
        self.stop_token_ids = list(dict.fromkeys([*task.stop_token_ids, *extra]))

    def params(self, max_tokens: int, seed: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=seed,
            logprobs=True,
            stop_token_ids=list(self.stop_token_ids),
        )

    def turn_limit(self, env: Environment) -> int:
        """The environment's own `max_turns`, else the run's."""
        own = getattr(env, "max_turns", None)
        return max(1, own if own is not None else self.max_turns)

    async def __call__(self, problem: Problem, epoch: int = 0, index: int = 0) -> TrajectoryGroup:
        started = time.perf_counter()
        trajectories = await asyncio.gather(*(self.episode(problem, epoch, i) for i in range(self.n)))
        return TrajectoryGroup(problem, list(trajectories), epoch, index, time.perf_counter() - started)

    async def episode(self, problem: Problem, epoch: int = 0, sample: int = 0) -> Trajectory:
        """Play one episode: generate, let the environment score it, append its observation, repeat."""
        traj = Trajectory([], [], [], [], [], 0.0, "stop", num_turns=0)
        try:
            env = self.task.make_env(problem)
            chat = Conversation(self.task, env.reset(), getattr(env, "tools", None))
        except Exception as err:
            return self._rollout_failed(problem, traj, "setting up the environment", err)
        prompt = traj.prompt_ids = chat.prompt_ids
        session = f"{self._sessions}-{next(self._session_ids)}"  # every turn on one engine: its prefix cache
        limit = self.turn_limit(env)
        for index in range(limit):
            budget = self.max_tokens
            if self.max_context is not None:
                budget = min(budget, self.max_context - len(prompt) - len(traj.response_ids))
                if budget < 1:
                    traj.finish_reason = "length"
                    break
            seed = None if self.seed is None else request_seed(self.seed, epoch, problem.id, sample, index)
            out = await self.client.generate(prompt + traj.response_ids, self.params(budget, seed),
                                             session_id=session)
            turn = self.cut(out)
            self._append(traj, turn.tokens, turn.logprobs, turn.versions, 1)
            traj.finish_reason = turn.finish_reason
            traj.num_turns = index + 1
            traj.num_recomputed_tokens += out.num_recomputed_tokens
            traj.num_cached_tokens += out.num_cached_tokens
            if turn.finish_reason == "abort":
                break
            result = await self.step(env, turn.text, traj)
            if result is None or result.done or result.observation is None or turn.finish_reason == "length":
                break
            if index + 1 >= limit:
                traj.info["max_turns_reached"] = True
                break
            try:
                observation = chat.observation_ids(turn, result.observation, set(self.stop_token_ids))
            except Exception as err:
                return self._rollout_failed(problem, traj, "turning the observation into tokens", err)
            used = len(prompt) + len(traj.response_ids) + len(observation)
            if self.max_context is not None and used >= self.max_context:
                traj.finish_reason = "length"
                break
            self._append(traj, observation, [0.0] * len(observation), [ENV_VERSION] * len(observation), 0)
        return traj

    @staticmethod
    def _append(traj: Trajectory, ids: list[int], logprobs: list[float], versions: list[int],
                mask: int) -> None:
        traj.response_ids += ids
        traj.logprobs += logprobs
        traj.versions += versions
        traj.loss_mask += [mask] * len(ids)

    def cut(self, out: Any) -> Turn:
        """The engine's output as a turn: cut at the first stop string, decoded for the environment."""
        tokens = list(out.output_token_ids)
        logprobs = list(out.logprobs or [0.0] * len(tokens))
        versions = list(out.token_weight_versions)
        finish = out.finish_reason or "stop"
        match = None
        if self.stop and finish != "abort":
            match = truncate_at_stop(tokens, self.stop, self.task.decode, self.include_stop_str_in_output)
        if match is None:
            return Turn(tokens, logprobs, versions, self.task.decode(tokens), finish)
        n = match.num_tokens
        return Turn(tokens[:n], logprobs[:n], versions[:n], match.text, "stop")

    async def step(self, env: Environment, text: str, traj: Trajectory) -> StepResult | None:
        """`env.step(text)` added to `traj`; None (and the sample scored 0) when it failed."""
        try:
            result = await self._run_step(env, text)
            reward = float(result.reward)
            if not math.isfinite(reward):
                raise ValueError(f"the reward is {reward}, not a finite number")
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._failed(env, traj, err)
            return None
        traj.reward += reward
        traj.info.update(result.info)
        return result

    async def _run_step(self, env: Environment, text: str) -> StepResult:
        timeout = self.reward_timeout_s
        if timeout is None or step_is_bounded(env):
            return await _settled(env.step(text))
        run = env.step(text) if inspect.iscoroutinefunction(env.step) else in_thread(env.step, text)
        try:
            async with asyncio.timeout(timeout):  # not wait_for: it can drop a cancel on Python 3.11
                return await _settled(run)
        except TimeoutError:
            raise TimeoutError(f"took longer than environment.reward_timeout_s={timeout:g} s") from None

    def _rollout_failed(self, problem: Problem, traj: Trajectory, doing: str, err: Exception) -> Trajectory:
        """End the episode on an environment failure: scored 0, or the error ends the run."""
        message = f"{type(err).__name__}: {err}"
        if not self.skip_failed_rollouts:
            raise RuntimeError(f"problem {problem.id!r}: the environment failed {doing} ({message}); "
                               "generator.skip_failed_rollouts=true scores such samples 0 instead") from err
        traj.reward, traj.rollout_failed, traj.finish_reason = 0.0, True, "rollout_error"
        traj.info["rollout_error"] = f"{doing}: {message}"
        _warn_once((doing, type(err).__name__), "problem %r: the environment failed %s (%s); the sample "
                   "scores 0%s (rollout/failed)", problem.id, doing, message,
                   "" if traj.usable else " and its group is dropped")
        return traj

    def _failed(self, env: Environment, traj: Trajectory, err: Exception) -> None:
        message = f"{type(err).__name__}: {err}"
        traj.reward, traj.reward_failed = 0.0, True
        traj.info["reward_error"] = message
        _warn_once((type(env).__name__, type(err).__name__), "%s.step failed (%s); the sample scores 0 and is "
                   "counted in reward/failures", type(env).__name__, message)


_REPORTED: set[tuple[str, str]] = set()
"""(environment class or failing phase, error class) pairs already warned about: later ones are
logged at debug."""


def _warn_once(key: tuple[str, str], message: str, *args: Any) -> None:
    """A warning the first time `key` fails, debug after that (one broken environment, many samples)."""
    level = logging.DEBUG if key in _REPORTED else logging.WARNING
    _REPORTED.add(key)
    log.log(level, message, *args)


async def _settled(value: Any) -> Any:
    """`value`, awaited while it is awaitable (a sync `step` may return a coroutine)."""
    while inspect.isawaitable(value):
        value = await value
    return value


def episode_options(cfg: Any, sampling: Any = None) -> dict[str, Any]:
    """`TaskGenerator` keyword arguments from a config, besides the sampling basics: stop strings
    (`sampling` or `generator.sampling_params`), `generator.max_turns`, `environment.reward_timeout_s`."""
    sampling = sampling if sampling is not None else cfg.generator.sampling_params
    return {"stop": sampling.stop, "include_stop_str_in_output": sampling.include_stop_str_in_output,
            "max_turns": cfg.generator.max_turns, "reward_timeout_s": cfg.environment.reward_timeout_s,
            "skip_failed_rollouts": cfg.generator.skip_failed_rollouts}


async def generate_groups(generate: GenerateFn, problems: Sequence[Problem]) -> list[TrajectoryGroup]:
    """Run a generator over several prompts concurrently (the synchronous trainer's rollout)."""
    return list(await asyncio.gather(*(generate(p) for p in problems)))
