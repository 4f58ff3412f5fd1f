"""A run on vLLM servers, on the project's side: what it would refuse, found before anything starts
(the vLLM registry entry's `run_checks`, read by `inflight.train.main.run_refusals`: `inflight
train` and `--print-config`), and the logprobs mode
its servers start in (`inflight.orchestration.servers`). The rules themselves are the backend's own
(`venv.python_problem`, `shapes.py`, `logprob_modes.py`), read here, not restated.
"""

from __future__ import annotations

from inflight.backends.registry import starts_servers
from inflight.backends.vllm.logprob_modes import GREEDY_BELOW, run_mode
from inflight.backends.vllm.shapes import cpu_attention_problem
from inflight.backends.vllm.venv import python_problem
from inflight.config import Config
from inflight.config.errors import Violation

BACKEND = "generator.inference_engine.backend"
SAMPLINGS = ("generator.sampling_params", "generator.eval_sampling_params")


def _samplings(cfg: Config) -> dict[str, tuple[float, float, int]]:
    """{key: (temperature, top_p, top_k)} of what the run samples with (and asks logprobs of)."""
    g = cfg.generator
    return {key: (s.temperature, s.top_p, s.top_k)
            for key, s in zip(SAMPLINGS, (g.sampling_params, g.eval_sampling_params), strict=True)}


def logprobs_mode(cfg: Config) -> str | None:
    """vLLM's `--logprobs-mode` that gives the run's logprobs as ours for all of its sampling (None: none
    does)."""
    return run_mode(_samplings(cfg).values())


def run_problems(cfg: Config) -> list[Violation]:
    """Why a run of `cfg` on vLLM cannot use its servers, one violation each (the vLLM entry's
    `run_checks`, asked for a run on vLLM only)."""
    out = []
    if starts_servers(cfg):  # vLLM's python: vllm_python, else $INFLIGHT_VLLM_PYTHON or .venv-vllm
        out += filter(None, [python_problem(cfg.generator.inference_engine.vllm_python)])
        model = cfg.trainer.policy.model.path
        if (
            model
            and cfg.generator.inference_engine.device == "cpu"
            and (problem := cpu_attention_problem(model))
        ):
            out.append(
                Violation(BACKEND, "vllm", problem, f"set {BACKEND}=native (our engine serves any head size)")
            )
    if logprobs_mode(cfg) is None:
        out.append(_mode_violation(cfg))
    return out


def _mode_violation(cfg: Config) -> Violation:
    samplings = _samplings(cfg)
    filtering = [k for k, (_, top_p, top_k) in samplings.items() if top_p < 1.0 or top_k > 0]
    key, (temperature, _, _) = next((k, s) for k, s in samplings.items()
                                    if not (s[0] < GREEDY_BELOW or s[0] == 1.0))
    return Violation(
        f"{key}.temperature",
        temperature,
        f"with top_p < 1 or top_k > 0 in {' and '.join(filtering)}, vLLM gives the logprobs a policy "
        "gradient needs (log_softmax(logits / temperature) before the top-k/top-p filter) only at "
        "temperature 1 or 0 (its raw_logprobs; its processed_logprobs are renormalized after the filter), "
        "and no vLLM mode gives them for both",
        f"set {key}.temperature=1.0, or top_p=1.0 and top_k=-1 in {' and '.join(filtering)}, or "
        f"{BACKEND}=native",
    )


__all__ = ["logprobs_mode", "run_problems"]
