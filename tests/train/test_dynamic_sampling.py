"""Dynamic sampling's batch logic (SkyRL's filter and replace) without an engine: what is trained,
what is dropped and why, and the limit on sampled batches."""

from __future__ import annotations

import pytest

from inflight.rollout.trajectory import Trajectory, TrajectoryGroup
from inflight.tasks import Problem
from inflight.train.dynamic_sampling import DynamicSampler, DynamicSamplingLimitError


def _group(name: str, rewards: list[float]) -> TrajectoryGroup:
    trajs = [Trajectory([1], [2], [0.0], [0], [1], r, "stop") for r in rewards]
    return TrajectoryGroup(Problem(name, "q", "a"), trajs, ref=name)


def test_filter_collects_informative_groups_over_batches():
    sampler = DynamicSampler("filter", target=3, max_batches=5)
    first = [_group("a", [1, 0]), _group("b", [1, 1]), _group("c", [0, 0])]
    ready, dropped = sampler.offer(first, 1)
    assert ready is None and [(g.prompt_id, why) for g, why in dropped] == [
        ("b", "rejected"),
        ("c", "rejected"),
    ]
    ready, dropped = sampler.offer([_group("d", [0, 1]), _group("e", [1, 1]), _group("f", [0.5, 1]),
                                    _group("g", [1, 0])], 1)
    assert [g.prompt_id for g in ready] == ["a", "d", "f"]
    assert [(g.prompt_id, why) for g, why in dropped] == [("e", "rejected"), ("g", "surplus")]
    assert sampler.batches == 0 and sampler.rest() == []


def test_filter_gives_up_after_max_sample_batches():
    sampler = DynamicSampler("filter", target=2, max_batches=2)
    sampler.offer([_group("a", [1, 1])], 1)
    with pytest.raises(DynamicSamplingLimitError, match="max_sample_batches=2"):
        sampler.offer([_group("b", [0, 0])], 1)
    unlimited = DynamicSampler("filter", target=2, max_batches=-1)
    for _ in range(50):
        assert unlimited.offer([_group("c", [0, 0])], 1)[0] is None


def test_replace_copies_informative_groups_into_uninformative_places():
    sampler = DynamicSampler("replace", target=4, min_replace_ratio=0.3, seed=1)
    batch = [_group("a", [1, 0]), _group("b", [1, 1]), _group("c", [0, 1]), _group("d", [0, 0])]
    ready, dropped = sampler.offer(batch, 7)
    assert [g.prompt_id for g in ready][::2] == ["a", "c"] and {g.prompt_id for g in ready[1::2]} <= {
        "a",
        "c",
    }
    assert all(g.ref is None for g in ready[1::2]) and [g.prompt_id for g, _ in dropped] == ["b", "d"]
    too_few = [_group("a", [1, 0]), _group("b", [1, 1]), _group("c", [0, 0]), _group("d", [0, 0])]
    ready, dropped = DynamicSampler("replace", target=4, min_replace_ratio=0.3).offer(too_few, 1)
    assert ready is None and {why for _, why in dropped} == {"discarded"}


def test_one_sample_groups_always_count_as_informative():
    ready, dropped = DynamicSampler("filter", target=2).offer([_group("a", [1]), _group("b", [0])], 1)
    assert [g.prompt_id for g in ready] == ["a", "b"] and dropped == []
