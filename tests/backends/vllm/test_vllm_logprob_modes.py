"""vLLM's logprobs modes against our promise (log_softmax(logits / T) before top-k/top-p), per request
(the shim's refusal names the mode that would answer) and per run (a run whose sampling filters, as
DAPO's recipe, starts its servers in raw_logprobs; one no mode serves is refused before it starts).
The live check of raw_logprobs against the native engine: test_vllm_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.backends.registry import backend_entry, backend_of
from inflight.backends.vllm.commands import vllm_args
from inflight.backends.vllm.errors import APIError
from inflight.backends.vllm.generate import SamplingFields, check_sampling
from inflight.backends.vllm.run_checks import logprobs_mode, run_problems
from inflight.config import load_config
from inflight.testing import LOCAL_CPU

RECIPES = json.loads((Path(__file__).parents[2] / "config" / "data" / "skyrl_recipes.json").read_text())[
    "recipes"
]
IE = "generator.inference_engine."
VLLM = [f"{IE}backend=vllm", f"{IE}weight_sync_backend=inprocess"]


@pytest.mark.parametrize(("mode", "sampling", "other"), [
    ("processed_logprobs", dict(temperature=1.0, top_p=0.7), "raw_logprobs"),
    ("processed_logprobs", dict(temperature=0.7, top_k=20), None),
    ("raw_logprobs", dict(temperature=0.7), "processed_logprobs"),
    ("raw_logprobs", dict(temperature=0.6, top_p=0.95), None),
    ("raw_logits", dict(temperature=1.0), "raw_logprobs"),
])
def test_a_request_the_mode_cannot_answer_is_refused_naming_the_mode_that_would(mode, sampling, other):
    with pytest.raises(APIError) as err:
        check_sampling(SamplingFields(**sampling), mode)
    assert (
        err.value.status == 400
        and err.value.param == "logprobs"
        and f"--logprobs-mode {mode}" in err.value.message
    )
    assert (
        (f"`--logprobs-mode {other}`" in err.value.message)
        if other
        else "start the server" not in err.value.message
    )
    check_sampling(SamplingFields(**sampling, logprobs=False), mode)  # no logprobs asked: served


@pytest.mark.parametrize(
    ("mode", "sampling"),
    [
        ("processed_logprobs", dict(temperature=0.7)),
        ("processed_logprobs", dict(temperature=0.0)),
        ("raw_logprobs", dict(temperature=1.0, top_p=0.7, top_k=20)),
        ("raw_logprobs", dict(temperature=0.0, top_p=0.5)),
    ],
)
def test_a_request_the_mode_answers_as_ours_is_served(mode, sampling):
    check_sampling(SamplingFields(**sampling, top_logprobs=2), mode)


def _recipe_sampling(script: str) -> list[str]:
    """The sampling overrides of one of SkyRL's own launch scripts."""
    return [o for o in RECIPES[script] if "sampling_params." in o and o.split("=")[0].rsplit(".", 1)[-1] in
            ("temperature", "top_p", "top_k")]


def test_dapo_s_recipe_starts_its_servers_in_raw_logprobs():
    dapo = _recipe_sampling("examples/train/algorithms/dapo/run_dapo_gsm8k.sh")
    assert "generator.eval_sampling_params.top_p=0.7" in dapo
    cfg = load_config(None, [*LOCAL_CPU, *VLLM, *dapo])
    assert logprobs_mode(cfg) == "raw_logprobs" and run_problems(cfg) == []
    assert vllm_args(cfg.generator.inference_engine, logprobs_mode="raw_logprobs") == [
        "--logprobs-mode",
        "raw_logprobs",
    ]
    theirs = load_config(
        None, [*LOCAL_CPU, *VLLM, *dapo, f"{IE}engine_init_kwargs.logprobs_mode=processed_logprobs"]
    )
    assert vllm_args(theirs.generator.inference_engine, logprobs_mode="raw_logprobs") == [
        "--logprobs-mode", "processed_logprobs"]  # vLLM's own argument decides (and the shim refuses by it)
    assert logprobs_mode(load_config(None, [*LOCAL_CPU, *VLLM])) == "processed_logprobs"  # SkyRL's defaults
    warm = load_config(None, [*LOCAL_CPU, *VLLM, "generator.sampling_params.temperature=0.7"])
    assert logprobs_mode(warm) == "processed_logprobs"


def test_a_run_no_mode_serves_is_refused_before_it_starts():
    sql = _recipe_sampling("examples/train/text_to_sql/run_skyrl_sql.sh")
    assert set(sql) >= {"generator.sampling_params.temperature=0.6", "generator.sampling_params.top_p=0.95"}
    (problem,) = run_problems(load_config(None, [*LOCAL_CPU, *VLLM, *sql]))
    assert problem.key == "generator.sampling_params.temperature" and problem.value == 0.6
    assert "generator.sampling_params" in problem.rule and "backend=native" in problem.fix
    mixed = ["generator.sampling_params.temperature=0.7", "generator.eval_sampling_params.top_p=0.7"]
    (problem,) = run_problems(load_config(None, [*LOCAL_CPU, *VLLM, *mixed]))
    assert problem.key == "generator.sampling_params.temperature" and "eval_sampling_params" in problem.rule
    native = load_config(None, [*LOCAL_CPU, *sql])
    # the native engine serves it (and vLLM's checks are vLLM's)
    assert backend_of(native).problems(native) == []
    assert backend_of(native).run_checks is None and backend_entry("vllm").problems(native) != []
