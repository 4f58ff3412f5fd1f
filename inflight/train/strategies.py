"""The policy-worker strategies: one `Strategy` entry per worker kind (`job.worker`: `local`, `fsdp`,
`megatron`), registered here, looked up with `strategy_entry(name)`; the entries that
`trainer.strategy` may name are `strategy_names()`.

`make_worker` (`inflight.train.policy`) picks an entry (`pick_strategy`) and builds the worker class
it names, and the start-up checks ask it what the worker refuses, instead of comparing names. This
module is a leaf (the standard library and `inflight.import_path` only; its own rank in
tests/test_layers.py), so an entry names its classes as `package.module:name`, imported when a
worker is built: train never imports the packages above it that hold a worker (`inflight.megatron`).
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.import_path import import_object


@dataclass(frozen=True)
class Strategy:
    """One policy-worker kind: the classes it builds and what it refuses."""

    name: str
    worker: str
    """`package.module:name` of the `PolicyWorker` class (`(cfg, *, model_path, device, role)`)."""
    critic: str | None = None
    """`package.module:name` of its critic worker class (`gae`'s value model); None: no critic (refused)."""
    aliases: tuple[str, ...] = ()
    """SkyRL's `trainer.strategy` values read as this one."""
    trainer_strategy: bool = True
    """`trainer.strategy` may name it (else only `job.worker` does)."""
    distributed: bool = True
    """Its ranks form a torch.distributed group (one rank of its own when none was launched)."""
    alone: str | None = None
    """The entry `job.worker=auto` picks instead when no torch.distributed group is initialised."""
    moe_refusal: str | None = None
    """Why it cannot train a mixture-of-experts model; None: it can."""
    vision_refusal: str | None = None
    """Why it cannot train a vision-language model; None: it can."""

    def worker_class(self, role: str = "policy") -> type:
        """The class of the `role` worker (`policy`, `ref` or `critic`); a ValueError when this kind
        has no critic (the config check refuses that run first)."""
        if role == "critic":
            if self.critic is None:
                raise ValueError(
                    f"a critic on the {self.name} worker is not implemented (refused by the config check)"
                )
            return import_object(self.critic, f"the {self.name} strategy's critic", TypeError)
        return import_object(self.worker, f"the {self.name} strategy's worker", TypeError)


_REGISTRY: dict[str, Strategy] = {}


def register_strategy(entry: Strategy) -> Strategy:
    """Add `entry` to the kinds `strategy_entry` finds (its name and aliases must be new); returns it."""
    taken = [n for n in (entry.name, *entry.aliases) if n in _REGISTRY or n in strategy_aliases()]
    if taken:
        raise ValueError(f"policy strategy {entry.name!r}: {taken} already name a registered strategy")
    _REGISTRY[entry.name] = entry
    return entry


def strategy_names() -> tuple[str, ...]:
    """The entries `trainer.strategy` may name, in registration order."""
    return tuple(n for n, s in _REGISTRY.items() if s.trainer_strategy)


def worker_names() -> tuple[str, ...]:
    """Every registered kind (what `job.worker` may name besides `auto`), in registration order."""
    return tuple(_REGISTRY)


def strategy_aliases() -> dict[str, str]:
    """{alias: name} of every entry's aliases (SkyRL's names)."""
    return {alias: s.name for s in _REGISTRY.values() for alias in s.aliases}


def strategy_entry(name: str) -> Strategy:
    """The entry called `name` (or one of its aliases); a ValueError lists the known ones."""
    entry = _REGISTRY.get(strategy_aliases().get(name, name))
    if entry is None:
        raise ValueError(f"policy strategy {name!r} is not registered; known: {', '.join(_REGISTRY)}")
    return entry


def pick_strategy(strategy: str, worker: str, distributed: bool) -> Strategy:
    """The entry a run builds: `job.worker`'s (`worker`) unless it is `auto`, else `trainer.strategy`'s
    (`strategy`), or that entry's `alone` one when no torch.distributed group is up (`distributed`)."""
    if worker != "auto":
        return strategy_entry(worker)
    entry = strategy_entry(strategy)
    return strategy_entry(entry.alone) if entry.alone and not distributed else entry


_W = "inflight.train."
LOCAL = register_strategy(Strategy(
    "local", worker=_W + "workers.local:LocalPolicyWorker", critic=_W + "critic:LocalCriticWorker",
    trainer_strategy=False, distributed=False,
))
FSDP = register_strategy(Strategy(
    "fsdp", worker=_W + "workers.fsdp:FSDPPolicyWorker", critic=_W + "critic:FSDPCriticWorker",
    aliases=("fsdp2",), alone="local",
))
MEGATRON = register_strategy(Strategy(
    "megatron", worker="inflight.megatron.worker:MegatronPolicyWorker", critic=None,
    moe_refusal="the Megatron worker takes dense models only (its Hugging Face conversion and CPU shim "
                "have no experts)",
    vision_refusal="the Megatron worker takes text models only",
))

__all__ = ["Strategy", "pick_strategy", "register_strategy", "strategy_aliases", "strategy_entry",
           "strategy_names", "worker_names"]
