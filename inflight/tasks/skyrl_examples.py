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
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

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
            raise ValueError("the multiply environment needs the row's reward_spec.ground_truth (the product), "
                             "as SkyRL's multiply_dataset.py writes it")
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
