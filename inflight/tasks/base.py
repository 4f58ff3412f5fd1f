"""The task / environment interface: problems, a verifiable reward, and episodes (`reset` / `step`).

A `Task` owns a tokenizer, its problems (training and held-out), how a prompt becomes token ids and
how a response is scored. Each trajectory is played against an `Environment` made by the task:
`reset()` gives the opening prompt (text or chat messages), `step(response)` scores the model's
turn and either ends the episode or answers with an observation that is appended to the
conversation (its tokens are not trained on). An observation is text (appended as its tokens) or
chat messages (`{"role": "tool" | "user", "content": ...}`, rendered by the tokenizer's chat
template between the model's turns; see `inflight.chat.turns`). `step` may be `async def` (or
return an awaitable), e.g. to await an async reward. Single-turn is the default (`SingleTurnEnv`:
one response, scored, done).

Turns: an environment that sets `max_turns` plays at most that many; one that leaves it None plays
at most the run's `generator.max_turns`. `tools` (JSON schemas, OpenAI's `{"type": "function",
"function": {...}}`) go to the chat template with the opening prompt, so the model is told about
them (see `inflight.tasks.tool_env.ToolEnv`).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.chat.turns import DECODING, PLAIN, ChatFormat, backend_for, render
from inflight.chat.turns import encode as encode_text


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer; `id` is unique within a task's training set."""

    id: str
    prompt: str | list[dict[str, str]]
    """Text, or chat messages (`[{"role": "user", "content": ...}]`) for tasks with a chat template."""
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass
class StepResult:
    """What an environment returns for one model turn.

    `observation`: what is appended after the model's turn when the episode goes on (None when
    done): text, or chat messages (one dict or a list) that the chat template renders;
    `reward`: added to the trajectory's return; `done`: the episode is over.
    """

    observation: str | dict[str, Any] | list[dict[str, Any]] | None
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


def bounded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a reward or an environment's `step` as a fast pure function that cannot hang: the
    generator then calls it on its event loop instead of in a thread bounded by
    `environment.reward_timeout_s` (handing a microsecond's work to a thread and back costs more
    than the work, on the core the train step needs). A subclass that overrides the method drops
    the mark with it."""
    fn.bounded = True
    return fn


def is_bounded(fn: Callable[..., Any]) -> bool:
    """Whether `fn` (a function or a bound method) was marked `@bounded`."""
    return getattr(getattr(fn, "__func__", fn), "bounded", False)


class Environment(ABC):
    """One episode. `reset()` returns the prompt (text or chat messages); `step(response_text)`
    scores a turn (it may be a coroutine function)."""

    max_turns: int | None = None
    """Most model turns of the episode; None: the run's `generator.max_turns`."""
    tools: list[dict[str, Any]] | None = None
    """JSON schemas of the tools the model may call, passed to the chat template; None: no tools."""
    keeps_stop_str: bool = False
    """Whether `step` gets a turn's text with the stop string that ended it whatever
    `include_stop_str_in_output` says (skyrl-gym's environments parse it: SkyRL always keeps it)."""

    @abstractmethod
    def reset(self) -> str | list[dict[str, Any]] | Awaitable[str | list[dict[str, Any]]]:
        """The opening prompt of the episode: text, or chat messages that the chat template renders;
        may be `async def` (e.g. to start a sandbox)."""

    @abstractmethod
    def step(self, response: str) -> StepResult | Awaitable[StepResult]:
        """Score the model's turn (`response`: its text, special tokens skipped) and say whether the
        episode goes on; may be `async def`. An exception or a timeout scores the sample 0."""

    def close(self) -> None | Awaitable[None]:
        """Release what the episode holds; called once when it ends (default: nothing). May be async."""
        return None


class SingleTurnEnv(Environment):
    """The default: the prompt, one response, the task's reward (awaited when async), done."""

    max_turns = 1

    def __init__(self, task: Task, problem: Problem) -> None:
        self.task, self.problem = task, problem

    def reset(self) -> str | list[dict[str, Any]]:
        return self.problem.prompt

    def step(self, response: str) -> StepResult | Awaitable[StepResult]:
        reward = self.task.reward(self.problem, response)
        return _scored(reward) if inspect.isawaitable(reward) else _result(reward)


def step_is_bounded(env: Environment) -> bool:
    """Whether `env.step` is marked `@bounded`: its own, or a `SingleTurnEnv`'s task reward."""
    return is_bounded(env.task.reward if isinstance(env, SingleTurnEnv) else env.step)


def _result(reward: float) -> StepResult:
    return StepResult(None, reward, True, {"correct": reward >= 1.0})


async def _scored(reward: Awaitable[float]) -> StepResult:
    return _result(await reward)


class Task(ABC):
    """A training task: tokenizer, problems, reward, environments.

    Subclasses implement `train_problems`, `eval_problems` and `reward`; they may override
    `make_env` (multi-turn) and `encode_prompt` (e.g. to apply a chat template).
    """

    name: str = "task"
    max_new_tokens: int = 16
    """Most tokens generated per model turn."""
    chat_format: ChatFormat = PLAIN
    """The chat template and its extra arguments for every rendering of this task's messages
    (prompts and the tokens between turns); default: the tokenizer's own, no arguments."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._encoded: dict[str, tuple[int, ...]] = {}  # `encode`'s memo, oldest first

    @abstractmethod
    def train_problems(self) -> Sequence[Problem]:
        """The problems a run trains on."""

    @abstractmethod
    def eval_problems(self) -> Sequence[Problem]:
        """The held-out problems a run evaluates on (never trained on)."""

    @abstractmethod
    def reward(self, problem: Problem, response: str) -> float | Awaitable[float]:
        """Score of `response` (decoded, without special tokens) for `problem`; 1.0 means correct.
        May return an awaitable (an async reward)."""

    def make_env(self, problem: Problem) -> Environment:
        """A new environment for one trajectory of `problem` (default: `SingleTurnEnv`)."""
        return SingleTurnEnv(self, problem)

    def sample_problems(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` training problems for the supervised warm-up (default: drawn from `train_problems`;
        generated tasks override it with fresh problems)."""
        return rng.choices(list(self.train_problems()), k=n)

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end a model turn (default: the tokenizer's EOS)."""
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]

    def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of an opening prompt (what `Environment.reset()` returned)."""
        if not isinstance(prompt, str):
            raise TypeError(f"{type(self).__name__} takes text prompts, not chat messages")
        return self.encode(prompt)

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of chat `messages` through the tokenizer's chat template, with `tools` (JSON
        schemas) and the assistant generation prompt: an opening prompt that offers tools."""
        text = render(self.tokenizer, messages, tools, add_generation_prompt=True, fmt=self.chat_format)
        return encode_text(self.tokenizer, text)

    def encode(self, text: str) -> list[int]:
        """Token ids of text (no special tokens added): prompts and environment observations.
        Memoised per task (a group's samples share their prompt), from `inflight.chat.turns.encode`
        (a fast tokenizer's backend directly)."""
        cache = self._encoded
        ids = cache.get(text)
        if ids is None:
            ids = tuple(encode_text(self.tokenizer, text))
            if len(cache) >= ENCODE_CACHE_SIZE:
                cache.pop(next(iter(cache)))  # the oldest entry
            cache[text] = ids
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped. For a fast tokenizer whose decode adds nothing
        to its backend's (no clean-up of spaces, no override), the backend decodes directly:
        transformers' decode first walks every id through `to_py_obj`, the largest single cost of
        the rollout loop's Python per sample."""
        ids = list(token_ids)
        clean_up = getattr(self.tokenizer, "clean_up_tokenization_spaces", True)
        backend = None if clean_up else backend_for(self.tokenizer, DECODING)
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
    """`fn(*args, **kwargs)` in a daemon thread, as a future of the running loop: a call that
    hangs (a reward, a tool) is abandoned there when its awaiter gives up, and blocks neither the
    event loop, nor the default executor's threads, nor the process's exit. Threads are reused
    (`_DaemonThreads`): an idle one takes the call, else a new one starts, so a hung call holds only
    its own thread while starting a thread per call (a cost in a fully-async run) is avoided."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, err: BaseException | None) -> None:
        if not future.done():
            future.set_exception(err) if err is not None else future.set_result(value)

    def run() -> None:
        try:
            value, err = fn(*args, **kwargs), None
        except BaseException as caught:  # handed to the awaiting coroutine
            value, err = None, caught
        try:
            loop.call_soon_threadsafe(settle, value, err)
        except RuntimeError:  # the loop is gone (the call outlived its episode)
            pass

    _THREADS.submit(run)
    return future


class _DaemonThreads:
    """Daemon worker threads that wait for calls; one more starts whenever none is idle."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0

    def submit(self, call: Callable[[], None]) -> None:
        with self.lock:
            start = self.idle == 0
            if not start:
                self.idle -= 1  # that idle thread is this call's
        self.calls.put(call)
        if start:
            threading.Thread(target=self._work, name="inflight-env-call", daemon=True).start()

    def _work(self) -> None:
        while True:
            self.calls.get()()
            with self.lock:
                self.idle += 1


_THREADS = _DaemonThreads()
ENCODE_CACHE_SIZE = 4096  # texts memoised per task by `Task.encode`
