"""Keys of the (SkyRL-compatible) schema that this project does not implement yet: refused, never ignored.

`validate` accepts them, because the schema and the weight-sync plan cover SkyRL's whole space (a
LoRA config has its plan); a run refuses them: `require_implemented` is called where the config
becomes engines (`inflight.train.engine_settings.engine_config`) and training steps
(`inflight.train.step.StepOptions.from_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def unimplemented(cfg: Config) -> list[Violation]:
    """The keys of `cfg` set to something this project does not implement yet, as violations."""
    out = []
    for key, (ok, rule, fix) in NOT_IMPLEMENTED.items():
        value = get_key(cfg, key)
        if not ok(value):
            out.append(Violation(key, value, rule, fix))
    return out


def require_implemented(cfg: Config) -> None:
    """Raise one `ConfigError` listing every key set to something not implemented yet."""
    violations = unimplemented(cfg)
    if violations:
        raise ConfigError(violations)
