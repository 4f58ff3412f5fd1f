"""Keys of the (SkyRL-compatible) schema set to what this project does not implement: refused, never ignored.

`validate` accepts them, because the schema and the weight-sync plan cover SkyRL's whole space (a
SkyRL config always loads, and `inflight train --print-config` lists what a run would refuse); a
run refuses them: `require_implemented` is called before anything starts (`inflight train`) and
where the config becomes engines (`inflight.orchestration.engine_settings.engine_config`) and training
steps (`inflight.train.step.StepOptions.from_config`). What is refused comes from two places: each
key's declared status (`inflight.config.status`, next to its field: the values a run takes), and
`NOT_IMPLEMENTED_WHEN`, the combinations (a key's value on some backend or placement).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from inflight.backends.registry import LOOPBACK, backend_of, external, servers_on_this_host, starts_servers
from inflight.config.errors import ConfigError, Violation
from inflight.config.keys import default_config, get_key, schema_fields
from inflight.config.schema import Config
from inflight.config.schema.generator import weight_transport
from inflight.config.status import REFUSED, field_status


def refused_keys() -> dict[str, str]:
    """{key: why} of every key whose status is refused (some of its values do not run)."""
    return {
        key: field_status(f).note for key, f in schema_fields().items() if field_status(f).state == REFUSED
    }


def _refusal(key: str, value: Any) -> Violation | None:
    status = field_status(schema_fields()[key])
    default = get_key(default_config(), key)
    if status.takes(value, default):
        return None
    fix = status.fix or f"set {key}={_yaml(default)} (the default)"
    return Violation(key, value, status.note, fix)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


_IE = "generator.inference_engine."
BACKEND, RUN_LOCALLY = _IE + "backend", _IE + "run_engines_locally"


_SET_ON_THE_SERVERS = {  # engine keys a run cannot apply to servers started elsewhere, and their defaults
    name: getattr(Config().generator.inference_engine, name)
    for name in (
        "device", "model_dtype", "block_size", "num_kv_blocks", "kv_cache_memory_gib", "max_num_seqs",
        "max_num_batched_tokens", "enable_chunked_prefill", "weight_update_rollback",
        "weight_update_timeout_s", "attention_backend", "linear_backend", "elementwise_backend",
    )
}

def on_megatron(cfg: Config) -> bool:
    """The policy trains with the Megatron worker."""
    return cfg.trainer.strategy == "megatron"


def several_policy_ranks(cfg: Config) -> bool:
    """The policy has more than one rank."""
    placement = cfg.trainer.placement
    return placement.policy_num_nodes * placement.policy_num_gpus_per_node > 1


_LORA = "trainer.policy.model.lora.rank"


def _transport_fact(value: str, fact: str) -> bool:
    """A fact (a `TransportSpec` field) of the weight transport `value` names; False where it names none."""
    spec = weight_transport(value)
    return spec is not None and bool(getattr(spec, fact))


REGISTRY_KEYS: dict[str, str] = {
    "trainer.algorithm.advantage_estimator": "advantage estimator",
    "trainer.algorithm.policy_loss_type": "policy loss",
}
"""{key: what}: the keys whose names `inflight.algorithms.registry` holds (it loads without torch, so
`inflight train --print-config` reads it without torch)."""


def registered_names(key: str) -> list[str]:
    """The names a run takes for `key` (besides `package.module:name`): the registry's, the built-ins
    and what a user's `register_*` added before the run."""
    from inflight.algorithms.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    return (ADVANTAGE_ESTIMATORS if key.endswith("advantage_estimator") else POLICY_LOSSES).names()


def _unregistered(cfg: Config) -> list[Violation]:
    out = []
    for key, what in REGISTRY_KEYS.items():
        name, known = get_key(cfg, key), registered_names(key)
        if ":" not in str(name) and name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            out.append(
                Violation(
                    key,
                    name,
                    f"is not a registered {what} (built in: {', '.join(known)}; also names given to "
                    f"inflight.algorithms.register_{what.replace(' ', '_')} before the run starts)",
                    f"{hint}use one of those, or package.module:name for your own function",
                )
            )
    return out


NOT_IMPLEMENTED_WHEN: list[tuple[str, Callable[[Config], bool], Callable[[Any], bool], str, str]] = [
    *((f"trainer.{role}.model.lora.rank", lambda c: True, lambda v: v == 0,
       f"LoRA on the {role} model is not implemented yet (only the policy takes adapters)",
       f"set trainer.{role}.model.lora.rank=0") for role in ("ref", "critic")),
    (_LORA, lambda c: several_policy_ranks(c) and not on_megatron(c), lambda v: v == 0,
     "LoRA on more than one FSDP policy rank is not implemented yet (megatron's ranks take it)",
     f"set trainer.placement.policy_num_nodes=1 and trainer.placement.policy_num_gpus_per_node=1, "
     f"trainer.strategy=megatron, or {_LORA}=0"),
    ("trainer.critic.model.path", on_megatron, lambda v: not v, "a critic (advantage_estimator=gae) with "
     "trainer.strategy=megatron is not implemented yet: the megatron worker builds a GPTModel without a "
     "value head",
     "use trainer.strategy=fsdp for gae, or an estimator without a critic (grpo, rloo, reinforce++, maxrl)"),
    (_IE + "enable_return_routed_experts", lambda c: c.generator.agent.path is not None, lambda v: v is False,
     "is not implemented for your agent's episodes (generator.agent.path): their calls do not keep the "
     "routing record", f"set {_IE}enable_return_routed_experts=false and "
     "trainer.policy.megatron_config.moe_enable_routing_replay=false"),
    (
        _IE + "weight_sync_host",
        lambda c: (external(c) and not servers_on_this_host(c)
                   and _transport_fact(c.generator.inference_engine.weight_sync_backend, "forms_group")),
        lambda v: v not in LOOPBACK,
        "is a loopback address, which servers on other hosts cannot reach: they join the weight group the "
        "trainer hosts there",
        f"set {_IE}weight_sync_host to an address of this machine that the servers reach",
    ),
    (
        _IE + "weight_sync_backend", lambda c: external(c) and not servers_on_this_host(c),
        lambda v: not _transport_fact(v, "same_node"),
        "shm needs the servers on this host (it hands them chunk files in /dev/shm); some of "
        f"{_IE}external_server_urls are elsewhere",
        f"set {_IE}weight_sync_backend=inprocess (chunks in request bodies)",
    ),
    *(
        (_IE + name, external, (lambda v, d=default: v == d),
         f"cannot reach servers started elsewhere (their own flags decide it, e.g. inflight serve "
         f"--{name.replace('_', '-')})",
         f"set it on the servers and leave {_IE}{name} at its default {default!r}, or {RUN_LOCALLY}=true")
        for name, default in _SET_ON_THE_SERVERS.items()
    ),
]  # fmt: skip
"""(key, applies(cfg), implemented(value), rule, fix): combinations not implemented yet, refused
like `NOT_IMPLEMENTED` where `applies`. What one inference backend refuses is on its registry entry
(`backend_refusals`)."""


def backend_refusals(cfg: Config) -> list[Violation]:
    """What `cfg`'s inference backend refuses (its registry entry): its own refusals, the engine keys a
    server the run starts does not take (`fixed`), and a weight transport it does not take."""
    entry, out = backend_of(cfg), []
    for r in entry.refusals:
        if r.applies(cfg) and not r.ok(value := get_key(cfg, r.key)):
            out.append(Violation(r.key, value, r.rule, r.fix))
    if starts_servers(cfg) and not entry.run_starts_servers:
        out.append(Violation(RUN_LOCALLY, True, f"a run does not start {entry.name} servers",
                             f"start them with `inflight serve --backend {entry.name}` and list them in "
                             f"{_IE}external_server_urls with {RUN_LOCALLY}=false"))
    for name, default in entry.fixed.items() if starts_servers(cfg) else ():
        if (value := get_key(cfg, _IE + name)) != default:
            out.append(
                Violation(
                    _IE + name,
                    value,
                    f"is a native-engine setting the {entry.name} server command "
                    f"does not carry; only the default {default!r} runs there",
                    f"set {_IE}{name}={_yaml(default)}, or {BACKEND}=native",
                )
            )
    kind = weight_transport(cfg.generator.inference_engine.weight_sync_backend)
    if kind is not None and not entry.takes_transport(kind):
        out.append(Violation(_IE + "weight_sync_backend", cfg.generator.inference_engine.weight_sync_backend,
                             f"is not a weight transport the {entry.name} backend takes",
                             f"use one of {', '.join(entry.transports)}"))
    return out


def unimplemented(cfg: Config) -> list[Violation]:
    """The keys of `cfg` set to something this project does not implement yet (or to a name nothing
    registered), as violations."""
    from inflight.config.validate import env_class_problem

    out = [v for v in (_refusal(key, get_key(cfg, key)) for key in refused_keys()) if v is not None]
    out += [v for v in (env_class_problem(cfg.environment.env_class),) if v is not None]
    out += _unregistered(cfg)
    out += backend_refusals(cfg)
    for key, applies, ok, rule, fix in NOT_IMPLEMENTED_WHEN:
        value = get_key(cfg, key)
        if applies(cfg) and not ok(value):
            out.append(Violation(key, value, rule, fix))
    return out


def require_implemented(cfg: Config) -> None:
    """Raise one `ConfigError` listing every key set to something not implemented yet."""
    violations = unimplemented(cfg)
    if violations:
        raise ConfigError(violations)
