"""A run's agent: the endpoint over the run's client, and the generators that play its episodes.

`AgentRun(cfg, client, tokenizer, max_model_len)` is what a trainer holds when `generator.agent.path`
names an agent, or `environment.env_class` an environment of a hub whose agent plays it
(`verifiers:<env id>`, a `VerifiersAgent`: `inflight.rewards.hubs.agent_hub`) (`uses_agent(cfg)`):
`await start()` serves the endpoint on the trainer's loop (and starts the hub's agent: verifiers'
worker), `generator(sampling, n, seed)` makes an `AgentGenerator` (training and evaluation each get
one, over the same endpoint), `await close()` stops both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inflight.agents.agent import load_agent
from inflight.agents.agent_generator import AgentGenerator
from inflight.agents.endpoint import AgentEndpoint
from inflight.agents.session import SessionSampling
from inflight.chat.templates import resolve_chat_template
from inflight.chat.turns import ChatFormat
from inflight.import_path import import_object
from inflight.rewards import RewardError
from inflight.rewards.hubs import agent_hub
from inflight.rollout.rate_limit import shared_limiter


def uses_agent(cfg: Any) -> bool:
    """Whether the run trains an agent: `generator.agent.path` is set, or a verifiers environment plays."""
    return cfg.generator.agent.path is not None or agent_hub(cfg.environment.env_class) is not None


class AgentRun:
    """The run's agent endpoint and agent (see the module docstring)."""

    def __init__(self, cfg: Any, client: Any, tokenizer: Any, max_model_len: int, agent: Any = None) -> None:
        self.cfg = cfg
        settings, generator = cfg.generator.agent, cfg.generator
        template = generator.chat_template
        fmt = ChatFormat(resolve_chat_template(template.source, template.name_or_path),
                         dict(generator.chat_template_kwargs))
        model = Path(str(cfg.trainer.policy.model.path)).name
        served = generator.inference_engine.served_model_name
        hub = agent_hub(cfg.environment.env_class)
        self.hub_agent = None  # the hub's agent (verifiers'): started and closed with the endpoint
        if agent is None and settings.path is None and hub is not None:
            found, env_id = hub
            cls = import_object(found.agent, "environment.env_class", RewardError)
            args = dict(getattr(cfg.environment, found.section))  # the loader's arguments
            agent = self.hub_agent = cls(env_id, args, model=served or model)
        self.agent = agent if agent is not None else load_agent(settings.path)
        self.endpoint = AgentEndpoint(
            client,
            tokenizer,
            model_name=model,
            max_model_len=max_model_len,
            served_model_name=served,
            fmt=fmt,
            host=settings.host,
            port=settings.port,
        )

    async def start(self) -> AgentRun:
        if self.hub_agent is not None:
            await self.hub_agent.start()
        try:
            await self.endpoint.start()
        except BaseException:
            await self.close()
            raise
        return self

    def generator(self, sampling: Any, n: int, seed: int | None) -> AgentGenerator:
        """Episodes with `sampling` (a `generator.sampling_params` section), `n` per problem."""
        g = self.cfg.generator
        session = SessionSampling(
            sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_generate_length
        )
        return AgentGenerator(self.endpoint, self.agent, n, session, seed=seed, timeout_s=g.agent.timeout_s,
                              skip_failed_rollouts=g.skip_failed_rollouts,
                              zero_reward_on_non_stop=g.zero_reward_on_non_stop,
                              apply_overlong_filtering=g.apply_overlong_filtering,
                              rate_limiter=shared_limiter(g.rate_limit))

    async def close(self) -> None:
        await self.endpoint.close()
        if self.hub_agent is not None:
            await self.hub_agent.close()


__all__ = ["AgentRun", "uses_agent"]
