"""The environments SkyRL's example entry points register into skyrl-gym, written here with the same
behaviour, so their launch scripts run with `inflight train` (`environment.env_class=<id>`).

SkyRL's examples register an environment of their own before training (`skyrl_gym.register(id=...,
entry_point=...)` in their `main_*.py`); this project registers these under the same ids the first
time a run builds one (`inflight.rewards.registry.SKYRL_EXAMPLE_ENVIRONMENTS`,
`inflight.tasks.skyrl_gym_env`), and runs them as any skyrl-gym environment.

- `multiply` (examples/train/multiply): the row's `reward_spec.ground_truth` is the product; each
  turn the first `\\boxed{...}` of the answer is read: 1 when it equals the ground truth (the episode
  ends), 0.5 for a boxed answer that does not, 0 without one; until the last turn (`max_turns` of the
  extras, which the generator sets to `generator.max_turns`; 5 without it) a wrong or missing answer
  gets a user message saying which, and the episode goes on.
- `llm_as_a_judge` (examples/train/llm_as_a_judge): one turn, scored by an OpenAI-compatible judge
  (`environment.skyrl_gym.llm_as_a_judge.model` / `base_url`; the key in `OPENAI_API_KEY`, which SkyRL
  requires too) that compares the answer with the row's `reward_spec.ground_truth` (a GSM8K solution
  ending in `#### <number>`) and ends its reply with `### Final Score: 1` or `0` (a bare `1` or `0`
  reply counts too; any other reply scores 0, as SkyRL's). A judge that cannot be reached raises: the
  sample scores 0 and counts as a reward failure.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

log = logging.getLogger(__name__)
BOXED = "\\boxed{"


def first_boxed(text: str) -> str | None:
    """The content of the first `\\boxed{...}` in `text` (up to the first closing brace; no nesting),
    or None when there is none or it is empty."""
    start = text.find(BOXED)
    if start < 0:
        return None
    end = text.find("}", start + len(BOXED))
    content = text[start + len(BOXED):end] if end >= 0 else ""
    return content or None


class MultiplyEnv(BaseTextEnv):
    """SkyRL's multiplication example environment (`multiply`)."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        truth = (extras.get("reward_spec") or {}).get("ground_truth")
        if truth is None:
            raise ValueError(
                "the multiply environment needs the row's reward_spec.ground_truth (the product), "
                "as SkyRL's multiply_dataset.py writes it"
            )
        self.ground_truth = str(truth).strip()
        self.max_turns = extras.get("max_turns", 5)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = first_boxed(action)
        correct = answer is not None and answer.strip() == self.ground_truth
        reward = 1.0 if correct else 0.5 if answer is not None else 0.0
        metadata = {"parsed_answer": answer}
        if correct or self.turns >= self.max_turns:
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata=metadata)
        hint = (f"{answer!r} is not the product; try again." if answer is not None
                else "Give the product as \\boxed{your_answer}.")
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": hint}], reward=0.0, done=False,
                                     metadata=metadata)


JUDGE_INSTRUCTIONS = """You grade a math answer against a reference solution.

The answer is correct only when its last line has the form `#### <number>` and that number equals the
final number of the reference solution. Reason briefly if you need to, then end your reply with one
line, nothing after it:

### Final Score: 1

when the answer is correct, or

### Final Score: 0

when it is not."""
_SCORE = re.compile(r"### Final Score:\s*([01](?:\.0)?)")


def judge_score(reply: str) -> float:
    """The score a judge's reply gives: its `### Final Score: x` line, or a bare `1` / `0`; else 0."""
    match = _SCORE.search(reply)
    if match:
        return float(match.group(1))
    if reply.strip() in ("0", "1"):
        return float(reply.strip())
    log.warning("the judge's reply has no '### Final Score: 0|1' line; scored 0: %.200s", reply)
    return 0.0


class LLMJudgeEnv(BaseTextEnv):
    """SkyRL's LLM-as-a-judge example environment (`llm_as_a_judge`): GSM8K answers graded by a model."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        from openai import OpenAI

        truth = ((extras or {}).get("reward_spec") or {}).get("ground_truth")
        if truth is None:
            raise ValueError("the llm_as_a_judge environment needs the row's reward_spec.ground_truth (the "
                             "reference solution)")
        key = os.environ.get("OPENAI_API_KEY")
        if not key:
            raise ValueError("the llm_as_a_judge environment needs OPENAI_API_KEY set (as SkyRL's does; any "
                             "value for a judge server that checks none)")
        self.ground_truth = str(truth)
        self.model = getattr(env_config, "model", None) or "gpt-4o-mini"
        self.client = OpenAI(base_url=getattr(env_config, "base_url", None), api_key=key)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        message = (f"{JUDGE_INSTRUCTIONS}\n\nREFERENCE SOLUTION:\n{self.ground_truth}\n\n"
                   f"ANSWER TO GRADE:\n{action}")
        reply = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": message}]
        )
        content = reply.choices[0].message.content or ""
        return BaseTextEnvStepOutput(observations=[], reward=judge_score(content), done=True,
                                     metadata={"judge_reply": content})
