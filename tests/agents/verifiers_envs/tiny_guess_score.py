"""The rubric of the `tiny-guess` verifiers environment (tiny_guess.py), on text: plain Python, so
the tests (in the project's venv, without verifiers) compute the reward the environment gave."""

from __future__ import annotations


def score(reply: str, answer: str) -> float:
    """1 for a reply naming the answer; else a partial score from the reply's length (so that
    a random model's replies are scored differently from each other)."""
    return 1.0 if answer in reply else (len(reply) % 4) / 4
