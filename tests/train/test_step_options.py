"""StepOptions read from the `trainer.*` keys by name; the old `job.*` spellings still set the
schema keys they stand for."""

from __future__ import annotations

import math

import pytest

from inflight.config import Config, ConfigError, load_config
from inflight.testing import LOCAL_CPU
from inflight.train.main import resolve_config
from inflight.train.objective import off_policy_correction
from inflight.train.step import StepOptions

OPC = "trainer.algorithm.off_policy_correction."


def test_the_default_config_gives_the_default_options():
    assert StepOptions.from_config(load_config(None)) == StepOptions()
    assert StepOptions().shared_prefix_forward  # on by default: packs where it pays
    assert StepOptions.from_config(load_config(None, list(LOCAL_CPU))) == StepOptions(
        shared_prefix_forward=False
    )


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        (["trainer.correct_threshold=0.5"], {"correct_threshold": 0.5}),
        (["trainer.max_tokens_per_microbatch=30"], {"max_tokens_per_micro_batch": 30}),
        (["trainer.micro_batch_pass_tokens=0"], {"micro_batch_pass_tokens": 0.0}),
        (["trainer.micro_batch_pass_tokens=.inf"], {"micro_batch_pass_tokens": math.inf}),
    ],
)  # fmt: skip
def test_each_key_sets_its_option(overrides, want):
    assert StepOptions.from_config(load_config(None, [*LOCAL_CPU, *overrides])) == StepOptions(
        shared_prefix_forward=False, **want
    )


@pytest.mark.parametrize(
    ("override", "rule"),
    [
        (f"{OPC}tis_ratio_type=tokens", "must be token, sequence or null"),
        (f"{OPC}token_tis_ratio_clip_high=0", "must be > 0"),
        (f"{OPC}sequence_tis_ratio_clip_high=-1", "must be > 0"),
        ("trainer.max_tokens_per_microbatch=0", "must be -1 or >= 1"),
        ("trainer.micro_batch_pass_tokens=-1", "must be >= 0"),
    ],
)
def test_bad_values_are_listed(override, rule):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, override])
    (v,) = err.value.violations
    assert v.key == override.split("=")[0] and v.rule == rule and v.fix


def _tis(cfg: Config) -> tuple[str | None, float, float, bool]:
    opc = off_policy_correction(cfg)
    return (opc.tis_ratio_type, opc.token_tis_ratio_clip_high, opc.sequence_tis_ratio_clip_high,
            cfg.trainer.algorithm.zero_variance_filter)


def test_the_old_job_keys_set_the_schema_keys():
    cfg, job = resolve_config(
        None, ["job.tis=sequence", "job.tis_cap=3", "job.drop_zero_advantage_groups=false"]
    )
    assert _tis(cfg) == ("sequence", 3.0, 3.0, False)
    cfg, _ = resolve_config(None, ["job.tis=none"])
    assert cfg.trainer.algorithm.off_policy_correction.tis_ratio_type is None
    cfg, _ = resolve_config(None, [])  # SkyRL's default: no correction
    assert _tis(cfg)[0] is None


def test_a_schema_key_on_the_command_line_wins_over_the_alias_in_the_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("job:\n  tis: sequence\n  drop_zero_advantage_groups: false\n")
    cfg, _ = resolve_config(str(path), [f"{OPC}tis_ratio_type=token"])
    assert _tis(cfg)[0] == "token" and _tis(cfg)[3] is False


def test_both_spellings_with_different_values_are_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve_config(None, ["job.tis=sequence", f"{OPC}tis_ratio_type=token"])
    assert err.value.keys == ["job.tis"]
    resolve_config(None, ["job.tis=none", f"{OPC}tis_ratio_type=null"])  # the same value twice is fine
    path = tmp_path / "job.yaml"
    path.write_text("job:\n  tis_cap: 3\ntrainer:\n  algorithm:\n    off_policy_correction:\n"
                    "      sequence_tis_ratio_clip_high: 4\n")
    with pytest.raises(ConfigError) as err:
        resolve_config(str(path), [])
    assert err.value.keys == ["job.tis_cap"] and f"{OPC}sequence_tis_ratio_clip_high" in str(err.value)
