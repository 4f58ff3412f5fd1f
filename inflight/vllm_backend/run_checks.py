"""A run on vLLM servers, on the project's side: what it would refuse, found before anything starts
(`inflight.train.main.run_refusals`: `inflight train` and `--print-config`). The rules themselves are
the backend's own (`venv.python_problem`, `shapes.py`), read here, not restated.
"""

from __future__ import annotations

from inflight.config import Config
from inflight.config.errors import Violation
from inflight.config.implemented import starts_vllm
from inflight.vllm_backend.shapes import cpu_attention_problem
from inflight.vllm_backend.venv import python_problem

BACKEND = "generator.inference_engine.backend"


def run_problems(cfg: Config) -> list[Violation]:
    """Why a run of `cfg` cannot use its vLLM servers, one violation each (none without vLLM)."""
    out = []
    if starts_vllm(cfg):  # vLLM's python: vllm_python, else $INFLIGHT_VLLM_PYTHON or .venv-vllm
        out += filter(None, [python_problem(cfg.generator.inference_engine.vllm_python)])
        model = cfg.trainer.policy.model.path
        if model and cfg.generator.inference_engine.device == "cpu" and (problem := cpu_attention_problem(model)):
            out.append(Violation(BACKEND, "vllm", problem, f"set {BACKEND}=native (our engine serves any head size)"))
    return out


__all__ = ["run_problems"]
