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
are appended as the tokens the tokenizer's chat template (or `task.chat_format`'s, with its
arguments) writes between the assistant turn and the next one (`inflight.chat.turns.between_turns`:
the end of the turn, the messages, the generation prompt), or, with `use_conversation_multi_turn`
off, as their contents' tokens straight after the model's response (`inflight.rollout.conversation`).
When the model ended its turn with the template's end-of-turn token (`<|im_end|>`) it sampled that
token (loss mask 1) and the template's copy is dropped. All of these get version `ENV_VERSION`.

Turns: an environment's own `max_turns` wins; one that leaves it None gets `max_turns` (the
config's `generator.max_turns`, default 1); skyrl-gym environments end their episodes themselves.
Each turn's reward is kept where it belongs (`Trajectory.turn_rewards`). A turn cut by the token
budget (`finish_reason "length"`) is scored and ends the episode, as does reaching `max_context`;
an episode whose next turn's input (prompt, every turn and the observation) would be longer than
`max_input_length` ends before that observation with finish reason "length" (SkyRL's
`generator.max_input_length`; the config's null is trainer.max_prompt_length).

Stop strings (`stop`, `generator.sampling_params.stop`): the engine works on token ids, so the
response is decoded and cut at the first stop string to complete (`inflight.chat.stop`): the
tokens up to and including the one that completed it are kept and trained on; the text given to
the environment drops the stop string unless `include_stop_str_in_output` (vLLM's default: drop) or
the environment `keeps_stop_str` (skyrl-gym's). A stop string that one token spells is also an
engine stop token, so generation ends right there; any other runs on to EOS or the budget and the
rest is discarded (the clients return whole responses). With `append_eos_token_after_stop_str_in_
multi_turn` (SkyRL's, default on; chat-message observations only) a turn ended by a stop string
gets the tokenizer's EOS after it, as SkyRL appends it: loss mask 0 (the model did not sample it).
Off, the turn stays open: the template's end-of-turn EOS is left out before the next observation.
With observations appended to the response, an episode that ends by itself gets an EOS (mask 0)
when its last turn did not end with one (SkyRL appends it too, and trains on it with a
log-probability of 0; a token the model did not sample is never trained on here).

The end of an episode (SkyRL's generator keys): `zero_reward_on_non_stop` scores 0 every episode
that did not end with finish reason "stop" (its turn rewards too); `apply_overlong_filtering`
(DAPO) gives such an episode loss mask 0 everywhere. `rate_limiter` bounds the episodes started per
second and in flight (`generator.rate_limit`, `inflight.rollout.rate_limit`).

Mixture-of-experts models: with `return_routed_experts` (`generator.inference_engine.
enable_return_routed_experts`) every turn asks the engine for the routing of every position, prompt
included, and the trajectory keeps the last turn's record (`Trajectory.routed_experts`): its prompt
is the whole trajectory so far, so it covers every earlier turn's positions too (routed as the KV
that turn attended to was), which the trainer's routing replay uses.

Images (a vision-language model's task: `task.vision`): an episode's images (its opening's, then
those of observation messages holding image parts; `inflight.rollout.conversation`) go with every
turn's request (`multimodal`) and stay with the trajectory (`Trajectory.images`), which the trainer's
forward takes. The model's image placeholder token is a stop token: a turn that samples it ends
there, without it (the trainer would take a sampled placeholder for an image).

Environment failures (`skip_failed_rollouts`, default true): building the environment, `reset()` or
turning an observation into tokens that raises ends that episode only
(`Trajectory.mark_rollout_failed`, `info["rollout_error"]`): what it generated so far is kept with
loss mask 0 and left out of its group's advantages; one that failed before its first turn has no
prompt of its own (its group gives it a finished sibling's, `TrajectoryGroup`), and a group none of
whose episodes finished is dropped by the trainers. False lets the error end the run, naming the
problem. Client and engine errors always propagate.
An environment's `close()` runs when its episode ends (a failure there is logged).

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
from typing import Any

from inflight.chat.stop import single_token_stops, truncate_at_stop
from inflight.engine.request import SamplingParams
from inflight.rollout.conversation import Conversation, Turn
from inflight.rollout.rate_limit import NO_LIMIT, shared_limiter
from inflight.rollout.trajectory import ENV_VERSION, Trajectory, TrajectoryGroup
from inflight.tasks.base import Environment, Problem, StepResult, Task, in_thread, step_is_bounded

log = logging.getLogger(__name__)

__all__ = ["ENV_VERSION", "Conversation", "TaskGenerator", "Trajectory", "TrajectoryGroup", "Turn",
           "episode_options", "generate_groups", "request_seed"]

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
    whatever else is in the engine's batch. The keyword options: see the module docstring
    (`episode_options(cfg)` reads them from a config).
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
        max_input_length: int | None = None,
        use_conversation_multi_turn: bool = True,
        append_eos_token_after_stop_str_in_multi_turn: bool = True,
        zero_reward_on_non_stop: bool = False,
        apply_overlong_filtering: bool = False,
        rate_limiter: Any = NO_LIMIT,
        return_routed_experts: bool = False,
    ) -> None:
        self.client, self.task, self.n = client, task, n
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_tokens = max_tokens or task.max_new_tokens
        self.max_context, self.max_input_length = max_context, max_input_length
        self.seed = seed
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_turns = max_turns
        self.reward_timeout_s = reward_timeout_s
        self.skip_failed_rollouts = skip_failed_rollouts
        self.conversation = use_conversation_multi_turn
        self.append_eos = append_eos_token_after_stop_str_in_multi_turn
        self.zero_reward_on_non_stop = zero_reward_on_non_stop
        self.apply_overlong_filtering = apply_overlong_filtering
        self.rate_limiter = rate_limiter
        self.return_routed_experts = return_routed_experts
        self._sessions, self._session_ids = uuid.uuid4().hex, itertools.count()  # uuid4 a sample cost ~12 us
        raw = lambda ids: task.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        extra = single_token_stops(self.stop, task.encode, raw) if self.stop else []
        # a vision-language model's image placeholder is no token to sample (the trainer's forward would
        # take it for an image): a turn ends at it, and `cut` leaves it out
        vision = getattr(task, "vision", None)
        self.image_token: int | None = getattr(vision.processor, "image_token_id", None) if vision else None
        placeholder = [] if self.image_token is None else [int(self.image_token)]
        self.stop_token_ids = list(dict.fromkeys([*task.stop_token_ids, *extra, *placeholder]))
        eos = task.tokenizer.eos_token_id
        self.eos: int | None = None if eos is None else int(eos)

    def params(self, max_tokens: int, seed: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=seed,
            logprobs=True,
            stop_token_ids=list(self.stop_token_ids),
            return_routed_experts=self.return_routed_experts,
        )

    def turn_limit(self, env: Environment) -> float:
        """The environment's own `max_turns` (skyrl-gym's: unbounded), else the run's."""
        own = getattr(env, "max_turns", None)
        return max(1, own if own is not None else self.max_turns)

    async def __call__(self, problem: Problem, epoch: int = 0, index: int = 0) -> TrajectoryGroup:
        started = time.perf_counter()
        trajectories = await asyncio.gather(*(self.episode(problem, epoch, i) for i in range(self.n)))
        return TrajectoryGroup(problem, list(trajectories), epoch, index, time.perf_counter() - started)

    async def episode(self, problem: Problem, epoch: int = 0, sample: int = 0) -> Trajectory:
        """Play one episode (within the rate limits): generate, let the environment score it, append
        its observation, repeat; then close the environment and apply the episode-end rules."""
        async with self.rate_limiter:
            traj = Trajectory([], [], [], [], [], 0.0, "stop", num_turns=0)
            try:
                env = self.task.make_env(problem)
            except Exception as err:
                return self._rollout_failed(problem, traj, "setting up the environment", err)
            try:
                await self._play(env, problem, traj, epoch, sample)
            finally:
                await self._close(env)
        return self._finish(traj)

    async def _play(
        self, env: Environment, problem: Problem, traj: Trajectory, epoch: int, sample: int
    ) -> None:
        try:
            opening = await _settled(env.reset())
            chat = Conversation(self.task, opening, getattr(env, "tools", None), self.conversation)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._rollout_failed(problem, traj, "setting up the environment", err)
            return
        traj.prompt_ids, traj.images = chat.prompt_ids, chat.images
        session = f"{self._sessions}-{next(self._session_ids)}"  # every turn on one engine: its prefix cache
        limit = self.turn_limit(env)
        if self.max_input_length is not None and len(traj.prompt_ids) > self.max_input_length:
            traj.finish_reason = "length"
            return
        for index in itertools.count():
            budget = self.max_tokens
            if self.max_context is not None:
                budget = min(budget, self.max_context - len(traj.prompt_ids) - len(traj.response_ids))
                if budget < 1:
                    traj.finish_reason = "length"
                    return
            seed = None if self.seed is None else request_seed(self.seed, epoch, problem.id, sample, index)
            out = await self.client.generate(traj.prompt_ids + traj.response_ids, self.params(budget, seed),
                                             session_id=session, **_images(traj))
            turn = self.cut(out)
            appended = self._add_turn(traj, turn)
            traj.finish_reason, traj.num_turns = turn.finish_reason, index + 1
            traj.num_recomputed_tokens += out.num_recomputed_tokens
            traj.num_cached_tokens += out.num_cached_tokens
            if self.return_routed_experts:  # the last turn's: its prompt is the whole trajectory so far
                traj.routed_experts, traj.routed_experts_start = out.routed_experts, out.routed_experts_start
            if turn.finish_reason == "abort":
                return
            text = turn.full_text if getattr(env, "keeps_stop_str", False) else turn.text
            result = await self.step(env, text, traj, len(traj.response_ids) - 1 - appended)
            if result is None or result.done or result.observation is None or turn.finish_reason == "length":
                return
            if index + 1 >= limit:
                traj.info["max_turns_reached"] = True
                return
            if not self._observe(chat, traj, problem, turn, text, result.observation):
                return

    def _observe(self, chat: Conversation, traj: Trajectory, problem: Problem, turn: Turn, text: str,
                 observation: Any) -> bool:
        """Append the observation after the model's turn (mask 0); False when the episode ends instead
        (the input would pass `max_input_length` or `max_context`, or the observation failed)."""
        if not self.conversation:
            self._drop_eos(traj)
        try:
            ids = chat.observation_ids(
                text,
                observation,
                traj.response_ids[-1] if traj.response_ids else None,
                set(self.stop_token_ids),
                drop_eos=turn.stopped_by_string and not self.append_eos,
            )
        except Exception as err:
            self._rollout_failed(problem, traj, "turning the observation into tokens", err)
            return False
        used = len(traj.prompt_ids) + len(traj.response_ids) + len(ids)
        if (self.max_input_length is not None and used > self.max_input_length) or (
                self.max_context is not None and used >= self.max_context):
            traj.finish_reason = "length"
            return False
        self._append(traj, ids, [0.0] * len(ids), [ENV_VERSION] * len(ids), 0)
        traj.images = chat.images  # the observation's images with its placeholders
        return True

    def _add_turn(self, traj: Trajectory, turn: Turn) -> int:
        """Append the model's turn (mask 1) and, after a stop string with chat-message observations and
        `append_eos_token_after_stop_str_in_multi_turn`, the EOS (mask 0). Returns the tokens appended
        after the sampled ones."""
        self._append(traj, turn.tokens, turn.logprobs, turn.versions, 1)
        if (self.conversation and self.append_eos and turn.stopped_by_string and self.eos is not None
                and turn.tokens and turn.tokens[-1] != self.eos):
            self._append(traj, [self.eos], [0.0], [ENV_VERSION], 0)
            return 1
        return 0

    def _drop_eos(self, traj: Trajectory) -> None:
        """Observations appended to the response: the model's EOS before them goes (one message)."""
        if traj.response_ids and traj.response_ids[-1] == self.eos and traj.loss_mask[-1] == 1:
            for seq in (traj.response_ids, traj.logprobs, traj.versions, traj.loss_mask):
                seq.pop()
            end = len(traj.response_ids) - 1
            traj.turn_rewards = [(min(i, end), r) for i, r in traj.turn_rewards]

    def _finish(self, traj: Trajectory) -> Trajectory:
        """The end-of-episode rules: a closing EOS for appended observations, zero reward and overlong
        filtering for episodes that did not stop by themselves."""
        stopped = traj.finish_reason == "stop"
        if not self.conversation and stopped and traj.response_ids and traj.response_ids[-1] != self.eos \
                and self.eos is not None:
            self._append(traj, [self.eos], [0.0], [ENV_VERSION], 0)
        if self.zero_reward_on_non_stop and not stopped:
            traj.reward = 0.0
            traj.turn_rewards = [(i, 0.0) for i, _ in traj.turn_rewards]
        if self.apply_overlong_filtering and not stopped:
            traj.loss_mask = [0] * len(traj.loss_mask)
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
        if self.image_token is not None and self.image_token in tokens:  # see __init__
            n = tokens.index(self.image_token)
            tokens, logprobs, versions, finish = tokens[:n], logprobs[:n], versions[:n], "stop"
        match = None
        if self.stop and finish != "abort":
            match = truncate_at_stop(tokens, self.stop, self.task.decode, True)
        if match is None:
            text = self.task.decode(tokens)
            return Turn(tokens, logprobs, versions, text, finish, text)
        n, full = match.num_tokens, match.text
        text = full if self.include_stop_str_in_output else full[: len(full) - len(match.stop)]
        return Turn(tokens[:n], logprobs[:n], versions[:n], text, "stop", full, True)

    async def step(self, env: Environment, text: str, traj: Trajectory, position: int | None = None
                   ) -> StepResult | None:
        """`env.step(text)` added to `traj` (its reward at `position`, default the response's last
        token); None (and the sample scored 0) when it failed."""
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
        traj.turn_rewards.append((len(traj.response_ids) - 1 if position is None else position, reward))
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

    async def _close(self, env: Environment) -> None:
        close = getattr(env, "close", None)
        if not callable(close):
            return
        try:
            await _settled(close())
        except asyncio.CancelledError:
            raise
        except Exception as err:
            _warn_once((type(env).__name__, "close"), "%s.close failed (%s: %s); the sample is kept",
                       type(env).__name__, type(err).__name__, err)

    def _rollout_failed(self, problem: Problem, traj: Trajectory, doing: str, err: Exception) -> Trajectory:
        """End the episode on an environment failure: scored 0, or the error ends the run."""
        message = f"{type(err).__name__}: {err}"
        if not self.skip_failed_rollouts:
            raise RuntimeError(
                f"problem {problem.id!r}: the environment failed {doing} ({message}); generator."
                "skip_failed_rollouts=true skips such episodes instead (not trained on)"
            ) from err
        traj.mark_rollout_failed(f"{doing}: {message}")
        _warn_once((doing, type(err).__name__), "problem %r: the environment failed %s (%s); the episode is "
                   "not trained on, its siblings are (rollout/failed)", problem.id, doing, message)
        return traj

    def _failed(self, env: Environment, traj: Trajectory, err: Exception) -> None:
        message = f"{type(err).__name__}: {err}"
        traj.reward, traj.reward_failed = 0.0, True
        traj.turn_rewards = [(i, 0.0) for i, _ in traj.turn_rewards]
        traj.info["reward_error"] = message
        _warn_once(
            (type(env).__name__, type(err).__name__),
            "%s.step failed (%s); the sample scores 0 and is counted in reward/failures",
            type(env).__name__,
            message,
        )


_REPORTED: set[tuple[str, str]] = set()
"""(environment class or failing phase, error class) pairs already warned about: later ones are
logged at debug."""


def _warn_once(key: tuple[str, str], message: str, *args: Any) -> None:
    """A warning the first time `key` fails, debug after that (one broken environment, many samples)."""
    level = logging.DEBUG if key in _REPORTED else logging.WARNING
    _REPORTED.add(key)
    log.log(level, message, *args)


def _images(traj: Trajectory) -> dict[str, Any]:
    """The `multimodal` argument of a turn's request: the episode's images, when it has any (a client
    of a text-only engine need not take the argument)."""
    return {} if traj.images is None else {"multimodal": traj.images}


async def _settled(value: Any) -> Any:
    """`value`, awaited while it is awaitable (a sync `step` may return a coroutine)."""
    while inspect.isawaitable(value):
        value = await value
    return value


def episode_options(cfg: Any, sampling: Any = None) -> dict[str, Any]:
    """`TaskGenerator` keyword arguments from a config, besides the sampling basics: stop strings
    (`sampling` or `generator.sampling_params`), `generator.max_turns`, `max_input_length` (null:
    trainer.max_prompt_length), `use_conversation_multi_turn`, `append_eos_token_after_stop_str_in_
    multi_turn`, `zero_reward_on_non_stop`, `apply_overlong_filtering`, `skip_failed_rollouts`, the
    rate limits (one limiter per config), `environment.reward_timeout_s`, the routing record
    (`generator.inference_engine.enable_return_routed_experts`)."""
    g = cfg.generator
    sampling = sampling if sampling is not None else g.sampling_params
    max_input = g.max_input_length if g.max_input_length is not None else cfg.trainer.max_prompt_length
    return {"stop": sampling.stop, "include_stop_str_in_output": sampling.include_stop_str_in_output,
            "max_turns": g.max_turns, "reward_timeout_s": cfg.environment.reward_timeout_s,
            "skip_failed_rollouts": g.skip_failed_rollouts, "max_input_length": max_input,
            "use_conversation_multi_turn": g.use_conversation_multi_turn,
            "append_eos_token_after_stop_str_in_multi_turn": g.append_eos_token_after_stop_str_in_multi_turn,
            "zero_reward_on_non_stop": g.zero_reward_on_non_stop,
            "apply_overlong_filtering": g.apply_overlong_filtering,
            "rate_limiter": shared_limiter(g.rate_limit),
            "return_routed_experts": g.inference_engine.enable_return_routed_experts}


async def generate_groups(generate: GenerateFn, problems: Sequence[Problem]) -> list[TrajectoryGroup]:
    """Run a generator over several prompts concurrently (the synchronous trainer's rollout)."""
    return list(await asyncio.gather(*(generate(p) for p in problems)))
