"""The backend registry's entries as the plan, validation and `inflight serve` read them, for every
registered backend."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from inflight.backends.registry import backend_entry, backend_names
from inflight.config import Config, ConfigError, load_config
from inflight.config.keys import schema_choices
from inflight.engine.config import EngineConfig
from inflight.server.main import main as serve
from inflight.testing import LOCAL_CPU, LOCAL_CPU_TRAINER
from inflight.weight_sync import kinds
from inflight.weight_sync.kinds import TransportSpec, transport_names
from inflight.weight_sync.plan import plan_weight_sync

IE = "generator.inference_engine."
EXTERNAL = [f"{IE}run_engines_locally=false", f"{IE}external_server_urls=[http://127.0.0.1:9]",
            f"{IE}weight_sync_backend=inprocess"]


def test_the_config_offers_exactly_the_registered_backends():
    assert schema_choices()[IE + "backend"][0] == backend_names()
    assert backend_names()[:3] == ("native", "vllm", "hf_generate")  # native first: the in-process engine


def test_an_unknown_backend_names_the_known_ones():
    with pytest.raises(
        ValueError, match="no inference backend named 'sglang'.*" + ", ".join(backend_names())
    ):
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
        with pytest.raises(
            ConfigError, match="vllm_python.*is read only with generator.inference_engine.backend=vllm"
        ):
            load_config(None, overrides)


def test_serve_hands_an_external_backend_its_command_line_which_refuses_what_it_cannot_honour(capsys):
    with pytest.raises(SystemExit) as exit_:  # hf_generate's own parser: no batching to size
        serve(["--backend", "hf_generate", "--model", "/m", "--max-num-seqs", "4"])
    assert exit_.value.code == 2 and "unrecognized arguments: --max-num-seqs 4" in capsys.readouterr().err


@pytest.mark.parametrize("name", backend_names())
def test_the_fixed_engine_keys_are_at_the_schemas_defaults(name):
    """What a backend's run-started server does not take runs at the default only: the entry's value must
    be the schema's default, else a run with every default would be refused."""
    defaults = Config().generator.inference_engine
    assert {k: getattr(defaults, k) for k in backend_entry(name).fixed} == dict(backend_entry(name).fixed)


def test_a_backend_takes_the_transports_its_facts_allow_new_kinds_included(monkeypatch):
    """The entries ask a kind's facts, so a kind registered later is taken (or not) without editing them."""
    assert backend_entry("native").transports == backend_entry("vllm").transports == transport_names()
    assert backend_entry("hf_generate").transports == ("inprocess", "shm")  # no weight group
    monkeypatch.setitem(kinds._REGISTRY, "chunked", TransportSpec("chunked", sender="m:s", receiver="m:r"))
    monkeypatch.setitem(kinds._REGISTRY, "grouped", TransportSpec("grouped", sender="m:s", receiver="m:r",
                                                                  forms_group=True))
    assert backend_entry("vllm").transports[-2:] == ("chunked", "grouped")
    assert backend_entry("hf_generate").transports == ("inprocess", "shm", "chunked")


@pytest.mark.parametrize("name", [n for n in backend_names() if backend_entry(n).run_starts_servers])
def test_every_server_command_a_run_builds_is_one_its_server_parses(name, tmp_path):
    """The argv of a run-started server (`Backend.server_command`) is accepted by the parser of the server
    `inflight serve --backend NAME` runs (vLLM's own parser lives in vLLM's venv: its flags are `inflight
    serve`'s, tests/config/test_servers_config.py)."""
    from inflight.backends.hf_generate.server import build_parser as hf_parser
    from inflight.server.main import build_parser

    cfg = load_config(None, [*LOCAL_CPU_TRAINER, f"{IE}backend={name}", f"{IE}served_model_name=policy"])
    engine = EngineConfig(model=str(tmp_path), seed=4, weight_version=2)
    argv = backend_entry(name).server_argv(cfg, engine, 8123, threads=3, host="0.0.0.0")
    assert argv[:4] == [sys.executable, "-m", "inflight.cli", "serve"]
    serve_args = argv[4:argv.index("--")] if "--" in argv else argv[4:]
    args = (hf_parser() if name == "hf_generate" else build_parser()).parse_known_args(serve_args)[0]
    assert (args.model, args.seed, args.weight_version, args.threads, args.host, args.port) == (
        str(tmp_path), 4, 2, 3, "0.0.0.0", 8123)
    assert args.backend == name
    if name == "hf_generate":
        hf_parser().parse_args(serve_args)  # every flag is one it honours (it refuses the others)
        assert args.served_model_name == "policy"


def test_a_backend_without_a_server_command_is_not_started_by_a_run(monkeypatch):
    entry = dataclasses.replace(backend_entry("hf_generate"), server_command=None)
    assert not entry.run_starts_servers
    with pytest.raises(ValueError, match="a run does not start hf_generate servers.*external_server_urls"):
        entry.server_argv(Config(), EngineConfig(model="/m"), 1, threads=1)
