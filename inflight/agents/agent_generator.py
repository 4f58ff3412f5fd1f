"""`AgentGenerator`: your agent's episodes as trajectory groups, a drop-in for `TaskGenerator`.

For a problem it plays `n` episodes at once (within `generator.rate_limit`): each opens a session on
the agent endpoint, calls the agent with the session's `base_url` and `api_key` and the problem, and
closes the session when the agent returns (within `generator.agent.timeout_s`). The session's calls
become samples (`merge.py`: one token-in/token-out sequence while each call continues the previous
one); the episode trains on its last sample, which holds the reply the reward judged, with the
agent's reward at its last sampled token. Earlier samples (before the agent rewrote its history)
are not trained on: counted as `agent/untrained_samples`, their calls as `agent/rewritten_histories`.

An agent that raises, times out or returns no number is a fault of the harness, not an answer of
the model, and costs that episode only, as an environment failure does
(`Trajectory.mark_rollout_failed`; `skip_failed_rollouts`, false lets the error end the run; but
`AgentStopped`, an agent that can play no more episodes, stops the run): what its calls generated is
kept with loss mask 0, it is left out of its group's advantages, and its finished siblings are
trained on as if it had not been played. One that failed before its first call has no tokens: its
row in the group is the prompt of a finished sibling and nothing after it (`TrajectoryGroup`); a
group none of whose episodes finished is dropped. An episode whose agent made no model call at all
is an error too: nothing was generated. Counted per step (`metrics`): `agent/episodes_failed`,
`agent/episodes_failed_before_first_call`, and (`rollout_metrics`) `rollout/failed_tokens_masked`.
`zero_reward_on_non_stop` and `apply_overlong_filtering` act on the finish reason of the sample's
last call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from inflight.agents.agent import AgentStopped, parse_result, run_agent
from inflight.agents.endpoint import AgentEndpoint
from inflight.agents.merge import merge_calls
from inflight.agents.session import SessionSampling
from inflight.rollout.rate_limit import NO_LIMIT
from inflight.rollout.trajectory import Trajectory, TrajectoryGroup
from inflight.tasks.base import Problem

log = logging.getLogger(__name__)


class AgentGenerator:
    """`n` episodes of `agent` per problem through `endpoint` (see the module docstring).

    `sampling`: the run's sampling for every call (`seed`: the run's seed, or None); `timeout_s`:
    the most seconds one episode may take (None: no limit)."""

    def __init__(
        self,
        endpoint: AgentEndpoint,
        agent: Callable[..., Any],
        n: int,
        sampling: SessionSampling,
        *,
        seed: int | None = None,
        timeout_s: float | None = None,
        skip_failed_rollouts: bool = True,
        zero_reward_on_non_stop: bool = False,
        apply_overlong_filtering: bool = False,
        rate_limiter: Any = NO_LIMIT,
    ) -> None:
        self.endpoint, self.agent, self.n, self.sampling = endpoint, agent, n, sampling
        self.seed, self.timeout_s = seed, timeout_s
        self.skip_failed_rollouts = skip_failed_rollouts
        self.zero_reward_on_non_stop = zero_reward_on_non_stop
        self.apply_overlong_filtering = apply_overlong_filtering
        self.rate_limiter = rate_limiter

    async def __call__(self, problem: Problem, epoch: int = 0, index: int = 0) -> TrajectoryGroup:
        started = time.perf_counter()
        trajectories = await asyncio.gather(*(self.episode(problem, epoch, i) for i in range(self.n)))
        return TrajectoryGroup(problem, list(trajectories), epoch, index, time.perf_counter() - started)

    async def episode(self, problem: Problem, epoch: int = 0, sample: int = 0) -> Trajectory:
        """One session of the agent on `problem`, as a trajectory."""
        seed = None if self.seed is None else (self.seed, epoch, problem.id, sample)
        async with self.rate_limiter:
            session = self.endpoint.open_session(dataclasses.replace(self.sampling, seed=seed))
            error: Exception | None = None
            reward, info = 0.0, {}
            try:
                async with asyncio.timeout(self.timeout_s):
                    result = await run_agent(
                        self.agent, self.endpoint.base_url(session), session.token, problem
                    )
                reward, info = parse_result(result)
            except TimeoutError:
                error = TimeoutError(
                    f"the agent took longer than generator.agent.timeout_s={self.timeout_s:g} s"
                )
            except AgentStopped:
                raise  # not this episode's failure: the run's
            except Exception as err:  # the agent's own failure: the episode's, not the run's
                error = err
            finally:
                self.endpoint.close_session(session)
        if error is None and not session.records:
            error = RuntimeError(
                "the agent returned without calling the model (no request reached its base_url)"
            )
        return self._trajectory(problem, session.records, reward, info, error)

    def _trajectory(self, problem: Problem, records: Sequence[Any], reward: float, info: dict[str, Any],
                    error: Exception | None) -> Trajectory:
        merged = merge_calls(records)
        stats = {"agent_calls": len(records), "agent_samples": len(merged.samples),
                 "agent_rewritten_histories": merged.new_samples}
        if not merged.samples:
            traj = Trajectory([], [], [], [], [], 0.0, "rollout_error", num_turns=0, info={**info, **stats})
        else:
            s = merged.samples[-1]
            traj = Trajectory(
                s.prompt_ids,
                s.response_ids,
                s.logprobs,
                s.versions,
                s.loss_mask,
                reward,
                s.finish_reason,
                num_turns=len(s.calls),
                num_recomputed_tokens=s.num_recomputed_tokens,
                num_cached_tokens=s.num_cached_tokens,
                info={**info, **stats},
            )
            last = max((i for i, m in enumerate(s.loss_mask) if m), default=len(s.loss_mask) - 1)
            traj.turn_rewards = [(last, reward)]
        if error is not None:
            return self._failed(problem, traj, error)
        stopped = traj.finish_reason == "stop"
        if self.zero_reward_on_non_stop and not stopped:
            traj.reward, traj.turn_rewards = 0.0, [(i, 0.0) for i, _ in traj.turn_rewards]
        if self.apply_overlong_filtering and not stopped:
            traj.loss_mask = [0] * len(traj.loss_mask)
        return traj

    def _failed(self, problem: Problem, traj: Trajectory, err: Exception) -> Trajectory:
        message = f"{type(err).__name__}: {err}"
        if not self.skip_failed_rollouts:
            raise RuntimeError(
                f"problem {problem.id!r}: the agent failed ({message}); "
                "generator.skip_failed_rollouts=true skips such episodes instead (not trained on)"
            ) from err
        traj.mark_rollout_failed(f"agent: {message}")
        log.warning("problem %r: the agent failed (%s); the episode is not trained on, its siblings are "
                    "(agent/episodes_failed)", problem.id, message)
        return traj

    @staticmethod
    def metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """A step's agent figures: model calls per episode, histories the agents rewrote (calls that
        started a new sample), the samples not trained on (all but each episode's last), and the
        episodes whose agent failed (not trained on), those of them before any model call included."""
        trajs = [t for g in groups for t in g.trajectories]
        if not trajs:
            return {}
        calls = [t.info.get("agent_calls", 0) for t in trajs]
        failed = [c for t, c in zip(trajs, calls, strict=True) if t.rollout_failed]
        return {
            "agent/calls_per_episode": sum(calls) / len(trajs),
            "agent/rewritten_histories": float(
                sum(t.info.get("agent_rewritten_histories", 0) for t in trajs)
            ),
            "agent/untrained_samples": float(sum(max(0, t.info.get("agent_samples", 0) - 1) for t in trajs)),
            "agent/episodes_failed": float(len(failed)),
            "agent/episodes_failed_before_first_call": float(sum(c == 0 for c in failed)),
        }


__all__ = ["AgentGenerator"]
