"""The backend registry's entries as the plan, validation and `inflight serve` read them, for every
registered backend."""

from __future__ import annotations

import pytest

from inflight.backends.registry import backend_entry, backend_names
from inflight.config import ConfigError, load_config
from inflight.config.keys import schema_choices
from inflight.server.main import main as serve
from inflight.testing import LOCAL_CPU
from inflight.weight_sync.plan import plan_weight_sync

IE = "generator.inference_engine."
EXTERNAL = [f"{IE}run_engines_locally=false", f"{IE}external_server_urls=[http://127.0.0.1:9]",
            f"{IE}weight_sync_backend=inprocess"]


def test_the_config_offers_exactly_the_registered_backends():
    assert schema_choices()[IE + "backend"][0] == backend_names()
    assert backend_names()[:3] == ("native", "vllm", "hf_generate")  # native first: the in-process engine


def test_an_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="no inference backend named 'sglang'.*" + ", ".join(backend_names())):
        backend_entry("sglang")


@pytest.mark.parametrize("name", backend_names())
def test_a_lora_policy_sends_adapters_only_to_a_backend_that_serves_them(name):
    plan = plan_weight_sync(load_config(None, [*LOCAL_CPU, *EXTERNAL, "trainer.policy.model.lora.rank=8",
                                               f"{IE}backend={name}"]))
    assert plan.takes_adapters is backend_entry(name).serves_adapters
    assert plan.full_weights is not backend_entry(name).serves_adapters
    assert plan.steps() == plan_weight_sync(load_config(None, [*LOCAL_CPU, *EXTERNAL])).steps()


@pytest.mark.parametrize("name", backend_names())
def test_vllm_python_is_read_only_by_the_backends_that_take_it(name):
    overrides = [*LOCAL_CPU, f"{IE}backend={name}", f"{IE}vllm_python=/x/bin/python"]
    if "vllm_python" in backend_entry(name).settings:
        load_config(None, overrides)
    else:
        with pytest.raises(ConfigError, match="vllm_python.*is read only with generator.inference_engine.backend=vllm"):
            load_config(None, overrides)


def test_serve_hands_an_external_backend_its_command_line_which_refuses_what_it_cannot_honour(capsys):
    with pytest.raises(SystemExit) as exit_:  # hf_generate's own parser: no batching to size
        serve(["--backend", "hf_generate", "--model", "/m", "--max-num-seqs", "4"])
    assert exit_.value.code == 2 and "unrecognized arguments: --max-num-seqs 4" in capsys.readouterr().err
