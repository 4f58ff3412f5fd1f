"""Length-aware micro-batches: the plan (rows sorted longest first, each micro-batch padded only
to its own longest row, within the row and token caps), trimming, and data-parallel ranks that
agree on the number of passes while each cuts its own share (no processes, no model)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from inflight.tasks.count_up import CountUpTask
from inflight.train.batch import plan_micro_batches, plan_shared_micro_batches
from inflight.train.data_parallel import DataParallel, MicroPlan, micro_batches, shard_step
from inflight.train.objective import RLBatch


def _padded(lengths: list[int], parts: list[list[int]]) -> int:
    return sum(len(p) * max(lengths[i] for i in p) for p in parts)


def count_up_lengths(n: int, seed: int = 0) -> list[int]:
    """Prompt + reference answer + EOS token counts of `n` random count_up problems (long-tailed)."""
    task = CountUpTask()
    problems = task.sample_problems(random.Random(seed), n)
    return [len(task.tokenizer(p.prompt)["input_ids"]) + len(task.tokenizer(p.answer)["input_ids"]) + 1
            for p in problems]


@pytest.mark.parametrize("max_rows,max_tokens,pass_cost", [(4, None, 0.0), (128, None, 64.0), (8, 60, 16.0),
                                                           (5, None, math.inf), (3, 10, math.inf)])
def test_every_row_once_within_the_caps(max_rows, max_tokens, pass_cost):
    lengths = [random.Random(i).randint(1, 40) for i in range(50)]
    parts = plan_micro_batches(lengths, max_rows, max_tokens, pass_cost)
    assert sorted(i for p in parts for i in p) == list(range(50))
    flat = [lengths[i] for p in parts for i in p]
    assert flat == sorted(flat, reverse=True)  # longest first, within and across micro-batches
    for p in parts:
        width = max(lengths[i] for i in p)
        assert len(p) <= max_rows and (max_tokens is None or len(p) == 1 or len(p) * width <= max_tokens)


def test_padding_is_bounded_by_the_rows_own_lengths():
    lengths = count_up_lengths(128)
    real = sum(lengths)
    assert 128 * max(lengths) > 2.5 * real  # one padded pass: the long tail pads every row
    exact = plan_micro_batches(lengths, 128, pass_cost=0.0)
    assert _padded(lengths, exact) == real  # no pass cost: rows of one length per micro-batch
    default = plan_micro_batches(lengths, 128, pass_cost=64.0)
    assert _padded(lengths, default) <= 1.2 * real and len(default) <= 10
    fewest = plan_micro_batches(lengths, 32, pass_cost=math.inf)
    assert len(fewest) == 4 and _padded(lengths, fewest) < 0.6 * 128 * max(lengths)  # sorted, trimmed


def test_equal_lengths_keep_the_plain_cut():
    assert plan_micro_batches([1] * 5, 2, pass_cost=math.inf) == [[0, 1], [2, 3], [4]]
    assert plan_micro_batches([], 2) == []


def test_trimmed_cuts_every_per_token_tensor_to_the_longest_row():
    attention = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    batch = RLBatch(
        input_ids=torch.arange(10).reshape(2, 5), loss_mask=attention.float(), attention_mask=attention,
        advantages=torch.tensor([1.0, -1.0]), rollout_logprobs=torch.zeros(2, 5),
        row_weight=torch.tensor([0.5, 0.5]),
    )
    assert batch.widths().tolist() == [3, 2]
    cut = batch.trimmed()
    assert cut.input_ids.tolist() == [[0, 1, 2], [5, 6, 7]] and cut.rollout_logprobs.shape == (2, 3)
    assert cut.advantages.shape == (2,) and cut.row_weight.shape == (2,)
    assert batch.select(torch.tensor([1])).trimmed().input_ids.tolist() == [[5, 6]]


def test_ranks_agree_on_the_passes_while_each_cuts_its_own_share():
    # 4 groups of 2 rows; rank 0 gets groups 0 and 2 (uniform lengths), rank 1 groups 1 and 3 (spread)
    lengths = [5, 5, 2, 30, 5, 5, 9, 17]
    plan = MicroPlan(max_rows=4, pass_cost=0.0)
    r0 = shard_step(4, 2, 4, plan, DataParallel(0, 2), lengths)
    r1 = shard_step(4, 2, 4, plan, DataParallel(1, 2), lengths)
    assert r0.rows == [0, 1, 4, 5] and r1.rows == [2, 3, 6, 7]
    (m0,), (m1,) = r0.mini_batches, r1.mini_batches
    assert m0.parts == ((0, 1, 2, 3),) and m1.parts == ((1,), (3,), (2,), (0,))
    assert m0.micro_batches == m1.micro_batches == 4  # rank 0 pads with 3 zero-weight passes


def test_groups_of_unequal_sizes_are_dealt_and_cut_whole():
    """Step-wise trajectories: groups of 3, 1, 4 and 2 rows, two groups per mini-batch, two ranks."""
    plan = MicroPlan(max_rows=8, pass_cost=math.inf)
    r0 = shard_step(4, [3, 1, 4, 2], 2, plan, DataParallel(0, 2))
    r1 = shard_step(4, [3, 1, 4, 2], 2, plan, DataParallel(1, 2))
    assert r0.rows == [0, 1, 2, 4, 5, 6, 7] and r1.rows == [3, 8, 9]
    assert (
        [m.rows for m in r0.mini_batches] == [slice(0, 4), slice(4, 10)] == [m.rows for m in r1.mini_batches]
    )
    assert r0.rank_rows == r1.rank_rows == ((0, 1, 2, 4, 5, 6, 7), (3, 8, 9))
    equal = shard_step(4, 2, 2, plan, DataParallel(1, 2))
    assert equal == shard_step(4, [2, 2, 2, 2], 2, plan, DataParallel(1, 2))


def test_micro_batches_are_trimmed_and_padded_up_to_the_common_count():
    widths = torch.tensor([3, 8, 2, 8])
    attention = (torch.arange(8)[None, :] < widths[:, None]).long()
    batch = RLBatch(input_ids=torch.ones(4, 8, dtype=torch.long), loss_mask=attention.float(),
                    attention_mask=attention, advantages=torch.ones(4))
    (mini,) = shard_step(
        1, 4, 1, MicroPlan(2, pass_cost=math.inf), DataParallel(), widths.tolist()
    ).mini_batches
    mini = type(mini)(mini.rows, mini.local, mini.micro_batches + 1, mini.parts)  # as if a rank had more
    parts = micro_batches(batch, mini)
    assert [tuple(p.input_ids.shape) for p, _ in parts] == [(2, 8), (2, 3), (1, 2)]
    assert [r.tolist() for _, r in parts[:2]] == [[1, 3], [0, 2]] and parts[2][1] is None
    assert parts[2][0].loss_mask.sum() == 0 and parts[2][0].advantages.abs().sum() == 0


@pytest.mark.parametrize("max_rows,max_tokens,pass_cost", [(8, None, 0.0), (16, None, 64.0), (16, 60, 16.0),
                                                           (3, None, math.inf)])
def test_shared_plans_hold_whole_groups_within_the_caps(max_rows, max_tokens, pass_cost):
    """`trainer.shared_prefix_forward`'s plan: every row once, a group's rows together (in runs of
    `max_rows` when it has more), at most `max_rows` rows and `max_tokens` packed tokens each."""
    rng = random.Random(0)
    groups = [g for g in range(10) for _ in range(4)]
    contexts = [5 + g for g in groups]
    lengths = [c + rng.randint(1, 12) for c in contexts]
    parts = plan_shared_micro_batches(lengths, groups, contexts, max_rows, max_tokens, pass_cost)
    assert sorted(i for p in parts for i in p) == list(range(40))
    for p in parts:
        assert len(p) <= max_rows
        units = {}
        for i in p:
            units.setdefault(groups[i], []).append(i)
        packed = [contexts[r[0]] + sum(lengths[i] - contexts[i] for i in r) for r in units.values()]
        assert max_tokens is None or len(units) == 1 or len(units) * max(packed) <= max_tokens
    for g in range(10):  # a group in as few micro-batches as its runs of max_rows rows
        assert sum(any(groups[i] == g for i in p) for p in parts) <= math.ceil(4 / max_rows)
