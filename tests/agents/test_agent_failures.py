"""A harness fault costs its episode only (issue 40): an agent that raises after its first model
call, or before any, through the real trainer, engine, agent endpoint and openai client. The trained
batch keeps every group; the failed episodes' rows have loss mask 0 (the one that made a call keeps
its tokens, the engine's own); the finished siblings' advantages are what SkyRL's GRPO gives them
alone (the oracle: SkyRL 0.3.0's `compute_grpo_outcome_advantage`)."""

from __future__ import annotations

import asyncio
import json

import failing_agents
import pytest
import torch
from oracle_import import import_oracle
from support import EngineRecords, assert_sample_is_the_engines

import inflight.train.step as step_module
from inflight.config import load_config
from inflight.config.job import JobConfig
from inflight.testing import LOCAL_CPU
from inflight.train.main import make_task
from inflight.train.runtime import start_local
from inflight.train.trainer import make_trainer

ROLES = {"a": ["after", "before", "1", "1"], "b": ["before", "1", "0.5", "0"]}


@pytest.fixture
def data(tmp_path):
    for name, ids in (("train", ROLES), ("val", ["v"])):  # a held-out file: no train row is split off
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(
                json.dumps({"id": pid, "prompt": f"Weather in city {pid}?", "answer": "x"}) + "\n"
                for pid in ids
            )
        )
    return tmp_path


def _config(model_dir, data, out):
    return load_config(
        None,
        [
            *LOCAL_CPU,
            f"trainer.policy.model.path={model_dir}",
            f"data.train_data=['{data}/train.jsonl']",
            f"data.val_data=['{data}/val.jsonl']",
            "generator.agent.path=failing_agents:agent",
            "trainer.fully_async.enabled=false",
            "trainer.train_batch_size=2",
            "trainer.policy_mini_batch_size=2",
            "generator.n_samples_per_prompt=4",
            "trainer.max_training_steps=1",
            "generator.sampling_params.max_generate_length=12",
            "generator.sampling_params.temperature=1.3",
            "trainer.eval_interval=-1",
            "trainer.max_prompt_length=512",
            "generator.inference_engine.max_model_len=1024",
            "trainer.algorithm.zero_variance_filter=false",
            "generator.inference_engine.weight_sync_backend=inprocess",
            f"trainer.export_path={out}/export",
            f"trainer.ckpt_path={out}/ckpt",
            "trainer.logger=[console]",
            "trainer.dump_data_batch=true",
        ],
    )


def test_a_failed_agent_episode_is_masked_and_left_out_of_its_groups_advantages(model_dir, data, tmp_path,
                                                                               monkeypatch):
    failing_agents.ROLES.clear()
    failing_agents.ROLES.update(ROLES, v=["1"])
    failing_agents.STARTED.clear()
    cfg = _config(model_dir, data, tmp_path)
    job = JobConfig(output_dir=str(tmp_path), plot=False)
    records: list[EngineRecords] = []
    computed = []
    real = step_module.compute_advantages

    def recording_advantages(*args, **kwargs):  # the step's own computation, kept for the check
        out = real(*args, **kwargs)
        computed.append((kwargs["left_out"], out))
        return out

    monkeypatch.setattr(step_module, "compute_advantages", recording_advantages)

    async def recording_start(cfg, job, **kwargs):
        runtime = await start_local(cfg, job, **kwargs)
        runtime.client = EngineRecords(runtime.engines.local[0])
        records.append(runtime.client)
        return runtime

    async def run():
        trainer = make_trainer(cfg, job, make_task(cfg, job), start=recording_start)
        try:
            await trainer.setup()
            return await trainer.train()
        finally:
            await trainer.close()

    [metrics] = asyncio.run(run())
    consumed = [json.loads(line) for line in (tmp_path / "consumed.jsonl").read_text().splitlines()]
    assert sorted(p for c in consumed for p in c.get("trained", [])) == ["a", "b"]
    assert not any("failed" in c for c in consumed), "a group with finished episodes was dropped"
    rows = [json.loads(line) for line in (tmp_path / "dumped_data" / "step_1.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == ["a"] * 4 + ["b"] * 4
    failed = [i for i, r in enumerate(rows) if r["finish_reason"] == "rollout_error"]
    assert len(failed) == 3
    for i, row in enumerate(rows):
        if i in failed:
            assert not any(row["loss_mask"]), "a failed episode's tokens are trained on"
        else:
            assert any(row["loss_mask"])
            assert_sample_is_the_engines(_Sample(row), records[0].outputs)
    after = [rows[i] for i in failed if rows[i]["response_ids"]]
    [made_a_call] = after  # its tokens are kept: the engine's answer to its one call
    assert any(list(o.prompt_token_ids) == made_a_call["prompt_ids"]
               and list(o.output_token_ids) == made_a_call["response_ids"]
               and list(o.logprobs) == made_a_call["logprobs"] for o in records[0].outputs)
    before = [rows[i] for i in failed if not rows[i]["response_ids"]]
    assert len(before) == 2  # a finished sibling's prompt, no response
    assert all(r["prompt_ids"] in [s["prompt_ids"] for s in rows if s["prompt_id"] == r["prompt_id"]
                                   and s["finish_reason"] != "rollout_error"] for r in before)
    assert metrics["agent/episodes_failed"] == 3 and metrics["agent/episodes_failed_before_first_call"] == 2
    assert metrics["rollout/failed_tokens_masked"] == len(made_a_call["response_ids"])
    assert metrics["trained_tokens"] == sum(sum(r["loss_mask"]) for r in rows)

    [(left_out, adv)] = computed
    assert [i for i, x in enumerate(left_out) if x] == failed
    finished = [i for i in range(len(rows)) if i not in failed]
    skyrl = import_oracle("skyrl.backends.skyrl_train.utils.ppo_utils")
    want, _ = skyrl.compute_grpo_outcome_advantage(
        torch.tensor([[rows[i]["reward"]] for i in finished]), torch.ones(len(finished), 1),
        [rows[i]["prompt_id"] for i in finished])
    assert want.abs().max() > 0.5  # group b's rewards differ: the check is not of zeros
    for k, i in enumerate(finished):
        n = len(rows[i]["response_ids"])
        torch.testing.assert_close(adv.raw[i, :n], want[k, 0].expand(n), rtol=1e-6, atol=0.0)
    for i in failed:
        assert not adv.raw[i].any() and not adv.scaled[i].any()


class _Sample:
    def __init__(self, row: dict) -> None:
        self.prompt_ids, self.response_ids = row["prompt_ids"], row["response_ids"]
        self.loss_mask, self.logprobs, self.versions = row["loss_mask"], row["logprobs"], row["versions"]
