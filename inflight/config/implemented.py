"""Keys of the (SkyRL-compatible) schema that this project does not implement yet: refused, never ignored.

`validate` accepts them, because the schema and the weight-sync plan cover SkyRL's whole space (a
LoRA config has its plan); a run refuses them: `require_implemented` is called where the config
becomes engines (`inflight.train.engine_settings.engine_config`) and training steps
(`inflight.train.step.StepOptions.from_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from inflight.config.errors import ConfigError, Violation
from inflight.config.keys import get_key
from inflight.config.schema import Config

NOT_IMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "generator.inference_engine.tensor_parallel_size": (
        lambda v: v == 1,
        "> 1 is not implemented yet: an engine runs on one device",
        "set generator.inference_engine.tensor_parallel_size=1 (generator.inference_engine.num_engines "
        "adds engines)",
    ),
}
"""key -> (implemented(value), rule, fix): a value that is not implemented is refused with this rule."""


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


def servers_on_this_host(cfg: Config) -> bool:
    """Every server is on this host: started by the run, or external at a loopback address."""
    ie = cfg.generator.inference_engine
    hosts = [urlsplit(u).hostname for u in ie.external_server_urls or []]
    return ie.run_engines_locally or all(h in ("127.0.0.1", "localhost", "::1") for h in hosts)


_NOT_PASSED_TO_VLLM = {  # engine keys the vLLM server command does not carry: only their defaults run
    "attention_backend": "auto", "linear_backend": "auto", "elementwise_backend": "auto", "num_kv_blocks": None,
    "block_size": 16, "enable_chunked_prefill": True, "weight_update_rollback": True,
}
_SET_ON_THE_SERVERS = {  # engine keys a run cannot apply to servers started elsewhere, and their defaults
    name: getattr(Config().generator.inference_engine, name)
    for name in ("device", "dtype", "block_size", "num_kv_blocks", "kv_cache_memory_gib", "max_num_seqs",
                 "max_num_batched_tokens", "enable_chunked_prefill", "weight_update_rollback",
                 "weight_update_timeout_s", "attention_backend", "linear_backend", "elementwise_backend")
}

NOT_IMPLEMENTED_WHEN: list[tuple[str, Callable[[Config], bool], Callable[[Any], bool], str, str]] = [
    (
        _IE + "weight_sync_backend", on_servers, lambda v: v in ("inprocess", "shm"),
        "broadcast into an HTTP server is not implemented yet: servers take weights as safetensors chunks "
        "through the client (inprocess: in request bodies; shm: as files in /dev/shm, servers on this host)",
        f"set {_IE}weight_sync_backend=shm (servers on this host) or inprocess",
    ),
    (
        _IE + "weight_sync_backend", lambda c: external(c) and not servers_on_this_host(c), lambda v: v != "shm",
        "shm needs the servers on this host (it hands them chunk files in /dev/shm); some of "
        f"{_IE}external_server_urls are elsewhere",
        f"set {_IE}weight_sync_backend=inprocess (chunks in request bodies)",
    ),
    (
        "trainer.placement.colocate_all", on_vllm, lambda v: v is False,
        "colocated vLLM engines are not implemented yet (vLLM's sleep frees nothing on CPU; on CUDA the "
        "server's sleep/wake is not built)",
        f"set trainer.placement.colocate_all=false, or {BACKEND}=native",
    ),
    (
        _IE + "offload_kv_for_weight_sync", lambda c: on_vllm(c) and c.generator.inference_engine.device != "cpu",
        lambda v: v is False,
        "offloading vLLM's KV during a sync on CUDA (sleep level 1) is not built yet (on CPU it is keep: the KV "
        "already lives in host memory)",
        f"set {_IE}offload_kv_for_weight_sync=false, or {_IE}device=cpu",
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
    """The keys of `cfg` set to something this project does not implement yet, as violations."""
    out = []
    for key, (ok, rule, fix) in NOT_IMPLEMENTED.items():
        value = get_key(cfg, key)
        if not ok(value):
            out.append(Violation(key, value, rule, fix))
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
