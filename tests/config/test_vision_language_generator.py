"""generator.vision_language_generator (issue 42): accepted, with SkyRL 0.3.0's default and the rules
of SkyRL's own vision-language generator (`SkyRLVLMGymGenerator._validate_cfg`, the oracle) on
batched, step_wise_trajectories and use_conversation_multi_turn."""

from __future__ import annotations

import itertools

import pytest
from oracle_import import import_oracle

from inflight.config import ConfigError, load_config
from inflight.testing import LOCAL_CPU

KEY = "generator.vision_language_generator"
RULED = ("generator.batched", "generator.step_wise_trajectories", "generator.use_conversation_multi_turn")


def _skyrl_accepts(batched: bool, step_wise: bool, conversation: bool) -> bool:
    generator = import_oracle("skyrl.train.generators.skyrl_vlm_generator").SkyRLVLMGymGenerator
    cfg = import_oracle("skyrl.train.config").GeneratorConfig(
        vision_language_generator=True, batched=batched, step_wise_trajectories=step_wise,
        use_conversation_multi_turn=conversation)
    try:
        generator._validate_cfg(None, cfg)
    except ValueError:
        return False
    return True


def test_the_default_is_skyrls():
    skyrl = import_oracle("skyrl.train.config").GeneratorConfig()
    assert (
        load_config(None, []).generator.vision_language_generator is skyrl.vision_language_generator is False
    )


@pytest.mark.parametrize(
    ("batched", "step_wise", "conversation"), list(itertools.product((False, True), repeat=3))
)
def test_its_rules_are_skyrls(batched, step_wise, conversation):
    values = (batched, step_wise, conversation)
    overrides = [
        *LOCAL_CPU,
        f"{KEY}=true",
        *(f"{k}={str(v).lower()}" for k, v in zip(RULED, values, strict=True)),
    ]
    try:
        cfg = load_config(None, overrides)
        ours = True
    except ConfigError as err:
        ours = False
        broken = [k for k, v, ok in zip(RULED, values, (False, False, True), strict=True) if v != ok]
        assert set(broken) <= set(err.keys) and any(KEY in str(v) for v in err.violations)
    assert ours == _skyrl_accepts(*values)
    if ours:
        assert cfg.generator.vision_language_generator is True
    try:  # off: the three keys are its rules' business only
        load_config(None, [*overrides[:len(LOCAL_CPU)], f"{KEY}=false", *overrides[len(LOCAL_CPU) + 1:]])
    except ConfigError as err:
        assert not any(KEY in str(v) for v in err.violations)


@pytest.mark.parametrize("backend", ["native", "vllm", "hf_generate"])
def test_only_the_native_backend_takes_image_rollouts(backend):
    """vLLM's shim and hf_generate pass no images: a run on them is refused when the config is
    validated (`unimplemented`, what --print-config lists), naming the backend that serves them."""
    from inflight.config.implemented import unimplemented

    cfg = load_config(None, [*LOCAL_CPU, f"{KEY}=true", f"generator.inference_engine.backend={backend}"])
    refused = [v for v in unimplemented(cfg) if v.key == KEY]
    if backend == "native":
        assert not refused
    else:
        assert len(refused) == 1 and backend in refused[0].rule and "backend=native" in refused[0].fix
