"""The weight-transport kinds as spec objects (`inflight.weight_sync.kinds`): no registered
transport name is compared as a string outside weight_sync/, the registry's one lookup, and each
fact of a spec deciding the behaviour that asks it: a probe transport registered with the fact
flipped shows that the behaviour follows the fact, not the kind's name."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

import inflight
from inflight.client.process import ReceiverSpec
from inflight.config import ConfigError, load_config
from inflight.config.implemented import require_implemented
from inflight.config.keys import schema_choices
from inflight.config.validate import ENGINE_RESTARTS, collect_violations
from inflight.import_path import import_object
from inflight.orchestration.sender import ServerGroupSender, make_sender
from inflight.orchestration.servers import server_spec
from inflight.testing import LOCAL_CPU
from inflight.weight_sync import kinds
from inflight.weight_sync.inprocess import InProcessTransport
from inflight.weight_sync.kinds import (
    BROADCAST,
    INPROCESS,
    SHM,
    TransportSpec,
    register_transport,
    transport_aliases,
    transport_names,
    transport_spec,
)

ROOT = Path(inflight.__file__).parent
IE = "generator.inference_engine."
ELSEWHERE = [f"{IE}run_engines_locally=false", f"{IE}external_server_urls=[http://10.0.0.5:8000]",
             "trainer.placement.colocate_all=false"]
"""Servers started on another host (what `same_node` and `forms_group` are asked about)."""


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def compared_names(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string literal in `names` that `source` compares: either side of
    ==, !=, in, not in, is (a literal or one in a tuple, list or set), or a match-case value."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            sides = [node.value]
        else:
            continue
        found += [(node.lineno, s) for side in sides for s in _literals(side) if s in names]
    return sorted(found)


def test_the_checker_finds_every_form_of_comparison_and_nothing_else():
    source = (
        'a == "shm"\n'
        '"broadcast" != b\n'
        'c in ("x", "inprocess")\n'
        'd not in {"shm"}\n'
        "match e:\n"
        '    case "broadcast":\n'
        "        pass\n"
        'f = {"shm": 1, "x": "inprocess"}\n'  # a key and a value: not compared
        'for g in ("broadcast",):\n'  # iterated: not compared
        "    pass\n"
    )
    assert compared_names(source, {"shm", "broadcast", "inprocess"}) == [
        (1, "shm"), (2, "broadcast"), (3, "inprocess"), (4, "shm"), (6, "broadcast")]


def test_no_transport_name_is_compared_as_a_string_outside_weight_sync():
    """Issue 41's goal: the rest of the tree asks the spec (`configured_transport(cfg).same_node`...)."""
    names = set(transport_names())
    assert names == {"inprocess", "shm", "broadcast"}
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {name!r}"
             for path in sorted(ROOT.rglob("*.py")) if path.relative_to(ROOT).parts[0] != "weight_sync"
             for line, name in compared_names(path.read_text(), names)]
    assert not found, "transport kinds compared as strings (ask the TransportSpec):\n" + "\n".join(found)


def test_one_lookup_takes_names_and_skyrls_aliases_and_lists_the_known_ones():
    assert transport_names() == ("inprocess", "shm", "broadcast")
    assert [transport_spec(n) for n in ("inprocess", "shm", "cuda_ipc", "broadcast", "nccl", "gloo")] == [
        INPROCESS, SHM, SHM, BROADCAST, BROADCAST, BROADCAST]
    with pytest.raises(ValueError) as err:
        transport_spec("delta")
    assert str(err.value) == (
        "weight transport 'delta' is not registered; known: inprocess, shm (or cuda_ipc), "
        "broadcast (or nccl, gloo)"
    )


def test_a_name_or_alias_already_taken_is_refused(monkeypatch):
    monkeypatch.setattr(kinds, "_REGISTRY", dict(kinds._REGISTRY))  # the registry as it was, afterwards
    with pytest.raises(ValueError, match=r"\['shm'\] already name a registered transport"):
        register_transport(dataclasses.replace(SHM, aliases=()))
    with pytest.raises(ValueError, match=r"'probe': \['nccl', 'gloo'\] already name"):
        register_transport(dataclasses.replace(BROADCAST, name="probe"))
    probe = register_transport(dataclasses.replace(SHM, name="probe", aliases=("probe2",)))
    assert transport_spec("probe2") is probe


def test_the_config_choices_and_aliases_are_the_registrys():
    from inflight.config.schema import WEIGHT_SYNC_BACKEND_ALIASES

    allowed, aliases = schema_choices()[IE + "weight_sync_backend"]
    assert allowed == (*transport_names(), "delta")  # SkyRL's delta: accepted by the schema, refused by a run
    assert aliases == WEIGHT_SYNC_BACKEND_ALIASES == transport_aliases() == {
        "cuda_ipc": "shm", "nccl": "broadcast", "gloo": "broadcast"}


@pytest.mark.parametrize("spec", [INPROCESS, SHM, BROADCAST], ids=lambda s: s.name)
def test_builders_are_weight_sync_functions_and_a_spec_crosses_processes(spec):
    for path in filter(None, (spec.sender, spec.receiver)):
        fn = import_object(path, "builder")
        assert callable(fn) and fn.__module__.startswith("inflight.weight_sync."), path
    assert pickle.loads(pickle.dumps(spec)) == spec  # what an engine process receives (ReceiverSpec)


def test_an_engine_process_gets_a_spec_not_a_string():
    assert ReceiverSpec(SHM, "127.0.0.1", 1).transport is SHM
    with pytest.raises(TypeError, match="ReceiverSpec.transport must be a TransportSpec"):
        ReceiverSpec("shm", "127.0.0.1", 1)


@pytest.fixture
def probe(monkeypatch):
    """Register `probe`: a copy of a registered spec with some facts changed, under a new name."""
    monkeypatch.setattr(kinds, "_REGISTRY", dict(kinds._REGISTRY))

    def register(base: TransportSpec, **facts) -> TransportSpec:
        kinds._REGISTRY.pop("probe", None)
        return register_transport(dataclasses.replace(base, name="probe", aliases=(), **facts))

    return register


def _cfg(*overrides: str, backend: str):
    """A valid config with `overrides` (shm meanwhile), then its weight_sync_backend set to `backend`
    in code (the config's choices list the built-in kinds)."""
    cfg = load_config(None, [*LOCAL_CPU, f"{IE}weight_sync_backend=shm", *overrides])
    cfg.generator.inference_engine.weight_sync_backend = backend
    return cfg


SAME_NODE = (IE + "weight_sync_backend", "shm needs the servers on this host")
LOOPBACK = (IE + "weight_sync_host", "is a loopback address")


def _refuses(cfg, refusal: tuple[str, str]) -> bool:
    """Whether a run refuses `cfg` for `refusal` (its key and how its rule starts)."""
    try:
        require_implemented(cfg)
    except ConfigError as err:
        return any(v.key == refusal[0] and v.rule.startswith(refusal[1]) for v in err.violations)
    return False


@pytest.mark.parametrize("in_trainer", [True, False])
def test_in_trainer_process_refuses_engine_restarts(probe, in_trainer):
    probe(INPROCESS if in_trainer else SHM)
    cfg = _cfg("trainer.fully_async.enabled=true", "trainer.fully_async.engine_restarts=2", backend="probe")
    restarts = [v for v in collect_violations(cfg) if v.key == ENGINE_RESTARTS]
    assert [v.rule for v in restarts] == (
        ["restarts engine processes; with weight_sync_backend=probe the engines run in the trainer's process"]
        if in_trainer else [])


@pytest.mark.parametrize("same_node", [True, False])
def test_same_node_refuses_servers_on_other_hosts(probe, same_node):
    probe(INPROCESS, same_node=same_node)
    cfg = _cfg(*ELSEWHERE, backend="probe")
    assert _refuses(cfg, SAME_NODE) is same_node
    local = _cfg(
        *ELSEWHERE[:1], f"{IE}external_server_urls=[http://127.0.0.1:8000]", *ELSEWHERE[2:], backend="probe"
    )
    assert not _refuses(local, SAME_NODE)  # servers on this host


@pytest.mark.parametrize("same_node", [True, False])
def test_same_node_packs_the_ray_placement_onto_one_node(probe, same_node):
    pytest.importorskip("ray", reason="ray is not installed: pip install torch==2.13.0 -e '.[ray]'")
    from inflight.cluster.placement import placement_strategy

    probe(BROADCAST, same_node=same_node)
    assert placement_strategy(_cfg(backend="probe")) == ("STRICT_PACK" if same_node else "PACK")
    assert [placement_strategy(_cfg(backend=n)) for n in ("inprocess", "shm", "broadcast")] == [
        "PACK", "STRICT_PACK", "PACK"]


@pytest.mark.parametrize("chunk_files", [True, False])
def test_chunk_files_hands_servers_chunks_as_files(probe, chunk_files):
    probe(INPROCESS, chunk_files=chunk_files)
    assert server_spec(_cfg(backend="probe"), ["http://127.0.0.1:1"], None).shm_chunks is chunk_files


@pytest.mark.parametrize("forms_group", [True, False])
def test_forms_group_into_servers_is_a_group_the_client_hosts(probe, forms_group):
    probe(SHM, forms_group=forms_group)
    cfg = _cfg(*ELSEWHERE, f"{IE}weight_sync_host=10.0.0.1", backend="probe")
    sender = make_sender(cfg, "/nonexistent")
    assert type(sender) is (ServerGroupSender if forms_group else InProcessTransport)
    loopback = _cfg(*ELSEWHERE, f"{IE}weight_sync_host=127.0.0.1", backend="probe")
    assert _refuses(loopback, LOOPBACK) is forms_group  # the servers must reach it
