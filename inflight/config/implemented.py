"""Keys of the (SkyRL-compatible) schema set to what this project does not implement: refused, never ignored.

`validate` accepts them, because the schema and the weight-sync plan cover SkyRL's whole space (a
SkyRL config always loads, and `inflight train --print-config` lists what a run would refuse); a
run refuses them: `require_implemented` is called before anything starts (`inflight train`) and
where the config becomes engines (`inflight.train.engine_settings.engine_config`) and training
steps (`inflight.train.step.StepOptions.from_config`). What is refused comes from two places: each
key's declared status (`inflight.config.status`, next to its field: the values a run takes), and
`NOT_IMPLEMENTED_WHEN`, the combinations (a key's value on some backend or placement).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from inflight.config.errors import ConfigError, Violation
from inflight.config.keys import default_config, get_key, schema_fields
from inflight.config.schema import Config
from inflight.config.schema.generator import weight_transport
from inflight.config.status import REFUSED, field_status


def refused_keys() -> dict[str, str]:
    """{key: why} of every key whose status is refused (some of its values do not run)."""
    return {key: field_status(f).note for key, f in schema_fields().items() if field_status(f).state == REFUSED}


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


def on_vllm(cfg: Config) -> bool:
    """The engines are vLLM servers (started by the run or elsewhere)."""
    return cfg.generator.inference_engine.backend == "vllm"


def starts_vllm(cfg: Config) -> bool:
    """The run starts vLLM servers itself."""
    return on_vllm(cfg) and cfg.generator.inference_engine.run_engines_locally


def on_servers(cfg: Config) -> bool:
    """The engines are HTTP servers behind one RemoteClient (vLLM, or servers started elsewhere)."""
    return on_vllm(cfg) or not cfg.generator.inference_engine.run_engines_locally


def external(cfg: Config) -> bool:
    """The engines are servers started elsewhere."""
    return not cfg.generator.inference_engine.run_engines_locally


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def servers_on_this_host(cfg: Config) -> bool:
    """Every server is on this host: started by the run, or external at a loopback address."""
    ie = cfg.generator.inference_engine
    hosts = [urlsplit(u).hostname for u in ie.external_server_urls or []]
    return ie.run_engines_locally or all(h in _LOOPBACK for h in hosts)


_NOT_PASSED_TO_VLLM = {  # engine keys the vLLM server command does not carry: only their defaults run
    "attention_backend": "auto", "linear_backend": "auto", "elementwise_backend": "auto", "num_kv_blocks": None,
    "block_size": 16, "enable_chunked_prefill": True, "weight_update_rollback": True,
}
_SET_ON_THE_SERVERS = {  # engine keys a run cannot apply to servers started elsewhere, and their defaults
    name: getattr(Config().generator.inference_engine, name)
    for name in ("device", "model_dtype", "block_size", "num_kv_blocks", "kv_cache_memory_gib", "max_num_seqs",
                 "max_num_batched_tokens", "enable_chunked_prefill", "weight_update_rollback",
                 "weight_update_timeout_s", "attention_backend", "linear_backend", "elementwise_backend")
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
            out.append(Violation(key, name, f"is not a registered {what} (built in: {', '.join(known)}; also names "
                                 f"given to inflight.algorithms.register_{what.replace(' ', '_')} before the run "
                                 "starts)", f"{hint}use one of those, or package.module:name for your own function"))
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
     "trainer.strategy=megatron is not implemented yet: the megatron worker builds a GPTModel without a value head",
     "use trainer.strategy=fsdp for gae, or an estimator without a critic (grpo, rloo, reinforce++, maxrl)"),
    (_IE + "enable_return_routed_experts", on_vllm, lambda v: v is False,
     "is not implemented on the vLLM backend: vLLM 0.32 captures the routing only in its V2 GPU model runner "
     "(its aux-output connector), which its CPU worker does not run, and the shim does not return it",
     f"use {BACKEND}=native for routing replay, or set {_IE}enable_return_routed_experts=false and "
     "trainer.policy.megatron_config.moe_enable_routing_replay=false"),
    (_IE + "enable_return_routed_experts", lambda c: c.generator.agent.path is not None, lambda v: v is False,
     "is not implemented for your agent's episodes (generator.agent.path): their calls do not keep the "
     "routing record", f"set {_IE}enable_return_routed_experts=false and "
     "trainer.policy.megatron_config.moe_enable_routing_replay=false"),
    (
        _IE + "weight_sync_host",
        lambda c: (external(c) and not servers_on_this_host(c)
                   and _transport_fact(c.generator.inference_engine.weight_sync_backend, "forms_group")),
        lambda v: v not in _LOOPBACK,
        "is a loopback address, which servers on other hosts cannot reach: they join the weight group the "
        "trainer hosts there", f"set {_IE}weight_sync_host to an address of this machine that the servers reach",
    ),
    (
        _IE + "weight_sync_backend", lambda c: external(c) and not servers_on_this_host(c),
        lambda v: not _transport_fact(v, "same_node"),
        "shm needs the servers on this host (it hands them chunk files in /dev/shm); some of "
        f"{_IE}external_server_urls are elsewhere",
        f"set {_IE}weight_sync_backend=inprocess (chunks in request bodies)",
    ),
    (
        _IE + "offload_kv_for_weight_sync", lambda c: on_vllm(c) and c.generator.inference_engine.device != "cpu",
        lambda v: v is False,
        "cannot offload vLLM's KV on CUDA: its sleep (level 1) frees the KV cache without a copy to restore (on "
        "CPU it is keep: the KV already lives in host memory)",
        f"set {_IE}offload_kv_for_weight_sync=false (or fully_async.clear_kv_cache_on_weight_sync=true to "
        f"recompute the frozen requests), or {_IE}device=cpu",
    ),
    *(
        (_IE + name, starts_vllm, (lambda v, d=default: v == d),
         f"is a native-engine setting the vLLM server command does not carry (vLLM picks its own); only the "
         f"default {default!r} runs there", f"set {_IE}{name}={'null' if default is None else default}, or {BACKEND}=native")
        for name, default in _NOT_PASSED_TO_VLLM.items()
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
like `NOT_IMPLEMENTED` where `applies`."""


def unimplemented(cfg: Config) -> list[Violation]:
    """The keys of `cfg` set to something this project does not implement yet (or to a name nothing
    registered), as violations."""
    from inflight.config.validate import env_class_problem

    out = [v for v in (_refusal(key, get_key(cfg, key)) for key in refused_keys()) if v is not None]
    out += [v for v in (env_class_problem(cfg.environment.env_class),) if v is not None]
    out += _unregistered(cfg)
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
