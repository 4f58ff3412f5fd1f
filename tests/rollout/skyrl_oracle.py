"""SkyRL 0.3.0's own `SkyRLGymGenerator.agent_loop` as the oracle of the generator keys: the same
scripted engine outputs, the same skyrl-gym environment, the same tokenizer, through SkyRL's loop.

SkyRL is installed without its dependencies into .venv/oracles by scripts/bootstrap.sh (a folder
only tests put on sys.path); its Tinker types need `typing_extensions.TypedDict` on Python 3.11
while its modules import.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from oracle_import import import_oracle

import_skyrl = import_oracle  # a SkyRL module from .venv/oracles


class ScriptedEngine:
    """SkyRL's inference client, answering with scripted turns as vLLM would: the ids, their text
    (special tokens skipped; the stop string kept, SkyRL's `include_stop_str_in_output`)."""

    def __init__(self, tokenizer: Any, turns: list[tuple[list[int], str]]) -> None:
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate(self, engine_input: Any, model: Any = None) -> dict[str, Any]:
        ids, finish = self.turns.pop(0)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return {"responses": [text], "response_ids": [list(ids)], "stop_reasons": [finish],
                "response_logprobs": [[-0.5] * len(ids)]}

    async def finish_session(self, session_id: str) -> None:
        return None


def skyrl_episode(tokenizer: Any, turns: list[tuple[list[int], str]], prompt: list[dict], env_class: str,
                  extras: dict, *, stop: list[str] | None = None, max_turns: int = 1,
                  max_input_length: int = 4096, **generator_keys: Any) -> Any:
    """SkyRL's trajectory for one episode (`TrajectoryOutput`: prompt_ids, response_ids, loss_mask,
    per-token `reward`, `stop_reason`, rollout_logprobs)."""
    config = import_skyrl("skyrl.train.config")
    module = import_skyrl("skyrl.train.generators.skyrl_gym_generator")
    cfg = config.GeneratorConfig(max_turns=max_turns, **generator_keys)
    cfg.sampling_params.stop = stop
    generator = module.SkyRLGymGenerator(cfg, config.SkyRLGymConfig(max_env_workers=0),
                                         ScriptedEngine(tokenizer, turns), tokenizer)
    return asyncio.run(generator.agent_loop(prompt, env_class, copy.deepcopy(extras), max_tokens=64,
                                            max_input_length=max_input_length))
