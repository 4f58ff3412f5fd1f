"""plan_weight_sync: THE policy for how a weight sync runs (docs/design.md section 4).

Pure: config in, plan out. Every policy backend executes the plan it returns through one
executor (`PolicyWorker.sync_weights`); none of them re-derives any part of it (SkyRL's bug was two
workers deriving the reset decision separately, from the wrong flag).

|colocate |fully_async |clear_kv |offload_kv |sleep |offload |kv_fate   |reset running |reset prefix cache |
|---------|------------|---------|-----------|------|--------|----------|--------------|-------------------|
|false    |false       |any      |false      |no    |no      |none      |no            |if prefix caching  |
|false    |false       |any      |true       |yes   |no      |none      |no            |if prefix caching  |
|false    |true        |false    |false      |no    |no      |keep      |no            |no                 |
|false    |true        |false    |true       |yes   |yes     |offload   |no            |no                 |
|false    |true        |true     |false      |no    |no      |recompute |yes           |if prefix caching  |
|false    |true        |true     |true       |yes   |no      |recompute |yes           |if prefix caching  |
|true     |(false)     |any      |(false)    |yes*  |no      |none      |no            |if prefix caching  |

`*` colocated: the engine sleeps after generation (the trainer needs the memory), not during the
sync; the sync wakes the weights, receives them, then wakes the KV pool. Every plan pauses with
`keep` (in the synchronous rows nothing is in flight, so it only holds back new requests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from inflight.backends.registry import backend_entry
from inflight.config import Config, validate_sync

PauseMode = Literal["keep", "abort", "wait"]
KVFate = Literal["none", "keep", "offload", "recompute"]


@dataclass(frozen=True)
class SyncPlan:
    """How one weight sync runs.

    - `pause_mode`: how the engines pause before the update (`keep`: in-flight requests freeze in place).
    - `sleep`: the engines sleep (free both memory pools) for the update; `offload_kv` says whether
      the KV pool is copied to host (restored bit-exactly) or discarded.
    - `kv_fate`: what happens to the KV of frozen requests: `none` (nothing is in flight), `keep`,
      `offload` or `recompute` (reset and re-prefilled with the new weights).
    - `reset_prefix_cache` / `reset_running_requests`: the reset the executor issues after the
      weights land, as one call `reset_prefix_cache(reset_running_requests=...)`.
    - `colocated`: the engine was put to sleep after generation; the sync only wakes it.
    - `takes_adapters`: the engines merge a LoRA adapter onto the weights they hold (the native
      engine); False for vLLM, whose server takes full weights only.
    """

    pause_mode: PauseMode
    sleep: bool
    offload_kv: bool
    kv_fate: KVFate
    reset_prefix_cache: bool
    reset_running_requests: bool
    colocated: bool = False
    takes_adapters: bool = True

    @property
    def sleeps(self) -> bool:
        """Whether the sync puts the engines to sleep (colocated engines slept after generation)."""
        return self.sleep and not self.colocated

    @property
    def wakes(self) -> bool:
        """Whether the engines are asleep for the update: the sync wakes the weights before the
        send and the KV pool after it."""
        return self.sleep or self.colocated

    @property
    def full_weights(self) -> bool:
        """Whether the update must carry every weight: the engines' sleep dropped theirs (a LoRA
        adapter is merged onto the weights the engine holds, so it cannot be sent alone), or they
        take no adapters; a LoRA policy then sends its merged weights (a new base) instead."""
        return self.wakes or not self.takes_adapters

    @property
    def resets(self) -> bool:
        """Whether the sync issues a reset."""
        return self.reset_prefix_cache or self.reset_running_requests

    def steps(self) -> tuple[str, ...]:
        """The names of the sync's steps in order, for logs and tests: `pause`, `sleep`,
        `wake_up_weights`, `send_weights`, `wake_up_kv_cache`, `reset` (each only where the plan has
        it) and `resume` (always, also when a step fails)."""
        return (
            "pause",
            *(("sleep",) if self.sleeps else ()),
            *(("wake_up_weights",) if self.wakes else ()),
            "send_weights",
            *(("wake_up_kv_cache",) if self.wakes else ()),
            *(("reset",) if self.resets else ()),
            "resume",
        )


def plan_weight_sync(cfg: Config) -> SyncPlan:
    """The plan for `cfg`, exactly the table in this module's docstring (docs/design.md section 4).

    `trainer.strategy` plays no part: FSDP and Megatron get the same plan. Raises `ConfigError` when the keys
    it reads contradict each other (e.g. colocated and fully-async).
    """
    validate_sync(cfg)
    engine, fully_async = cfg.generator.inference_engine, cfg.trainer.fully_async
    colocated, offload = cfg.trainer.placement.colocate_all, engine.offload_kv_for_weight_sync
    fate: KVFate
    if colocated or not fully_async.enabled:
        fate = "none"  # synchronous trainer: nothing is in flight during the sync
    elif fully_async.clear_kv_cache_on_weight_sync:
        fate = "recompute"
    else:
        fate = "offload" if offload else "keep"
    sleep = colocated or offload
    # Clearing always resets the frozen requests, whether sleep discarded their KV or it stayed in
    # place: they must not resume on KV that the new weights did not compute.
    reset_running = fate == "recompute"
    # Frozen requests that keep their KV keep their cached blocks too; the new weight version in
    # the prefix keys already isolates requests that start after the update.
    reset_prefix = engine.enable_prefix_caching and fate in ("none", "recompute")
    takes_adapters = backend_entry(engine.backend).serves_adapters
    return SyncPlan(
        "keep", sleep, fate == "offload", fate, reset_prefix, reset_running, colocated, takes_adapters
    )
