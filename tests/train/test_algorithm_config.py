"""What validation says about the algorithm keys: combinations SkyRL forbids or silently mishandles
are violations naming the keys and a fix; what only a run can judge (a registry name, megatron with a
critic) is refused by the run."""

from __future__ import annotations

import pytest

from inflight.config import ConfigError, load_config
from inflight.config.implemented import unimplemented
from inflight.testing import LOCAL_CPU

ALG = "trainer.algorithm."
OPC = ALG + "off_policy_correction."


@pytest.mark.parametrize(("overrides", "key", "words"), [
    # LOCAL_CPU: token TIS
    ([ALG + "policy_loss_type=clip_cov"], ALG + "policy_loss_type", "off-policy correction"),
    ([ALG + "policy_loss_type=cispo", ALG + "cispo.cispo_anchor=rollout"],
     ALG + "cispo.cispo_anchor", "twice"),
    ([OPC + "token_mask_is_threshold_low=0.5"], OPC + "token_mask_is_threshold_low", "one-sided"),
    ([ALG + "use_tis=true"], ALG + "tis_imp_ratio_cap", "> 0"),
    ([ALG + "use_tis=true", ALG + "tis_imp_ratio_cap=2", OPC + "tis_ratio_type=sequence"],
     ALG + "use_tis", "token-level"),
    ([ALG + "value_head_prefix=model"], ALG + "value_head_prefix", "other than 'model'"),
    (["trainer.critic.model.path=/m", "trainer.critic_mini_batch_size=3"],
     "trainer.critic_mini_batch_size", "divide"),
    ([ALG + "loss_reduction=token_mean_legacy", "trainer.micro_train_batch_size_per_gpu=5"],
     "trainer.micro_train_batch_size_per_gpu", "token_mean_legacy"),
    ([ALG + "loss_reduction=seq_mean_token_sum_norm"], ALG + "max_seq_len", "must be set"),
    ([ALG + "advantage_estimator=gae"], "trainer.critic.model.path", "required"),
    ([ALG + "dynamic_sampling.type=replace"], ALG + "dynamic_sampling.type", "fully-async"),
    ([ALG + "overlong_buffer_penalty_factor=-1"], ALG + "overlong_buffer_penalty_factor", ">= 0"),
    (["trainer.update_ref_every_epoch=true"], "trainer.update_ref_every_epoch", "reference"),
    ([ALG + "advantage_estimator=pkg.mod:9x"], ALG + "advantage_estimator", "package.module:name"),
])  # fmt: skip
def test_violations_name_the_key_and_why(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, *overrides])
    violation = next(v for v in err.value.violations if v.key == key)
    assert words in violation.rule and violation.fix


def test_a_critic_on_megatron_is_refused_by_a_run():
    cfg = load_config(None, [*LOCAL_CPU, "trainer.strategy=megatron", "trainer.critic.model.path=/m",
                             "trainer.critic_mini_batch_size=8",
                             ALG + "advantage_estimator=gae"])
    (refusal,) = [v for v in unimplemented(cfg) if v.key == "trainer.critic.model.path"]
    assert "value head" in refusal.rule and "fsdp" in refusal.fix
