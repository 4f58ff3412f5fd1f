"""`tiny-guess`: a small verifiers environment for the tests (loaded by verifiers' own loader in
verifiers' venv, with this folder on PYTHONPATH). Its dataset is made here (no download): guess a
city in two turns; the environment answers the first reply with "Try again."; the rubric scores the
last reply (`tiny_guess_score.score`)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset
from tiny_guess_score import score

CITIES = ["Paris", "Rome", "Oslo", "Lima"]


class GuessEnv(vf.MultiTurnEnv):
    """The model guesses; the environment asks once more."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Try again."}]


def last_reply(completion, answer, **kwargs) -> float:
    """The rubric's reward function: `score` of the last assistant message."""
    replies = [m["content"] for m in completion if m["role"] == "assistant"]
    return score(replies[-1] if replies else "", answer)


def load_environment(num_examples: int = 8, max_turns: int = 2, **kwargs) -> vf.Environment:
    rows = [
        {"question": f"Which city? ({i})", "answer": CITIES[i % len(CITIES)]} for i in range(num_examples + 2)
    ]
    return GuessEnv(
        dataset=Dataset.from_list(rows[:num_examples]),
        eval_dataset=Dataset.from_list(rows[num_examples:]),
        system_prompt="Name a city.",
        rubric=vf.Rubric(funcs=[last_reply]),
        max_turns=max_turns,
        **kwargs,
    )
