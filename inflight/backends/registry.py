"""The inference backends: one `Backend` entry per `generator.inference_engine.backend` value (and
`inflight serve --backend`), registered here, looked up with `backend_entry(name)`.

The rest of the tree asks an entry what it needs to know (how `inflight serve` starts it, can a
run hold its engines in-process, does it serve LoRA adapters, which weight transports and settings
it takes, what it refuses) instead of comparing names. This module is a leaf below the config layer
(the standard library and `inflight.import_path` only; its own rank in tests/test_layers.py):
config validation and the weight-sync plan read the entries. So an entry names its code as
`package.module:name`, imported when it is used. Adding a backend: docs/design.md, "Adding an
inference backend".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inflight.import_path import import_object

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
    run_starts_servers: bool = False
    """A run with `run_engines_locally=true` starts its servers (`inflight.orchestration.servers`); else the
    run drives them only as servers started elsewhere (`external_server_urls`)."""
    start_timeout_s: float = 120.0
    """How long a started server may take to answer /health."""
    serves_adapters: bool = False
    """Takes LoRA adapters as a weight update (else the policy's merged weights)."""
    transports: tuple[str, ...] = ("inprocess", "shm", "broadcast")
    """The `weight_sync_backend` kinds its weight updates arrive by."""
    settings: tuple[str, ...] = ()
    """`generator.inference_engine` keys read by this backend only (e.g. its interpreter)."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Engine keys a server the run starts does not take: only these defaults run there."""
    refusals: tuple[Refusal, ...] = ()
    run_checks: str | None = None
    """`package.module:name` of `(cfg) -> list[Violation]`: what a run on it would refuse, found
    before anything starts (its interpreter, the model's shape, ...)."""

    def launcher(self) -> Callable[[list[str]], int] | None:
        """The `launch` function, imported (None: the native server)."""
        return None if self.launch is None else import_object(self.launch, f"backend {self.name}")

    def problems(self, cfg: Any) -> list[Any]:
        """The `run_checks` violations of `cfg` (none without checks)."""
        return [] if self.run_checks is None else list(import_object(self.run_checks, f"backend {self.name}")(cfg))


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


NATIVE = register_backend(Backend(
    "native", "this package's paged-KV engine: in the trainer's processes, or `inflight serve`",
    in_process=True, run_starts_servers=True, start_timeout_s=120.0, serves_adapters=True,
))


def _on_cuda(cfg: Any) -> bool:
    return cfg.generator.inference_engine.device != "cpu"


VLLM = register_backend(Backend(
    "vllm", "our routes over vLLM's AsyncLLM, run by vLLM's own venv (inflight/backends/vllm)",
    launch="inflight.backends.vllm.launch:main", run_starts_servers=True,
    start_timeout_s=600.0,  # vLLM CPU: ~30-60 s to start, more on a busy machine
    settings=("vllm_python",),
    fixed={"attention_backend": "auto", "linear_backend": "auto", "elementwise_backend": "auto",
           "num_kv_blocks": None, "block_size": 16, "enable_chunked_prefill": True, "weight_update_rollback": True},
    refusals=(
        Refusal(IE + "enable_return_routed_experts", lambda c: True, lambda v: v is False,
                "is not implemented on the vLLM backend: vLLM 0.32 captures the routing only in its V2 GPU model "
                "runner (its aux-output connector), which its CPU worker does not run, and the shim does not "
                "return it", f"use {IE}backend=native for routing replay, or set {IE}enable_return_routed_experts="
                "false and trainer.policy.megatron_config.moe_enable_routing_replay=false"),
        Refusal(IE + "offload_kv_for_weight_sync", _on_cuda, lambda v: v is False,
                "cannot offload vLLM's KV on CUDA: its sleep (level 1) frees the KV cache without a copy to restore "
                "(on CPU it is keep: the KV already lives in host memory)",
                f"set {IE}offload_kv_for_weight_sync=false (or fully_async.clear_kv_cache_on_weight_sync=true to "
                f"recompute the frozen requests), or {IE}device=cpu"),
    ),
    run_checks="inflight.backends.vllm.run_checks:run_problems",
))


HF_GENERATE = register_backend(Backend(
    "hf_generate", "transformers' own generate behind our routes, one request at a time (the baseline TRL uses; "
    "inflight/backends/hf_generate)", launch="inflight.backends.hf_generate.server:main", start_timeout_s=120.0,
    transports=("inprocess", "shm"),
    refusals=(
        Refusal("trainer.fully_async.clear_kv_cache_on_weight_sync", lambda c: c.trainer.fully_async.enabled,
                lambda v: v is False, "cannot recompute frozen requests on the hf_generate backend: their KV lives "
                "inside transformers' generate loop", "set trainer.fully_async.clear_kv_cache_on_weight_sync=false "
                f"(the frozen requests keep their KV), or {IE}backend=native"),
    ),
))
