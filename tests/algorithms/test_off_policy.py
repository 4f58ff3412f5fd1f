"""inflight.algorithms.off_policy against SkyRL 0.3.0's off_policy_correction_utils."""

from __future__ import annotations

import itertools

import pytest
import torch
from algorithm_batches import TOL, assert_metrics_close, make_batch

from inflight.algorithms import off_policy
from inflight.algorithms.off_policy import OffPolicyCorrection

TIS = [
    {},
    dict(tis_ratio_type="token", token_tis_ratio_clip_high=1.3),
    dict(tis_ratio_type="sequence", sequence_tis_ratio_clip_high=2.5),
]
SEQUENCE = [
    {},
    dict(sequence_mask_metric="geometric", geo_mask_high=1.08, geo_mask_low=0.93),
    dict(sequence_mask_metric="product", product_mask_high=3.0, product_mask_low=0.4),
]
TOKENS = [
    {},
    dict(outlier_token_is_threshold_high=2.2),
    dict(outlier_token_is_threshold_low=0.5),
    dict(token_mask_is_threshold_low=0.7, token_mask_is_threshold_high=1.6),
    dict(
        outlier_token_is_threshold_low=0.45,
        outlier_token_is_threshold_high=2.5,
        token_mask_is_threshold_low=0.8,
        token_mask_is_threshold_high=1.25,
    ),
]
GRID = [dict(**a, **b, **c) for a, b, c in itertools.product(TIS, SEQUENCE, TOKENS)]


@pytest.mark.parametrize("settings", GRID, ids=lambda s: ",".join(sorted(s)) or "off")
def test_correction_matches_skyrl(skyrl, settings):
    b = make_batch(7, drift=0.3)
    sky_cfg = skyrl.config.OffPolicyCorrectionConfig(**settings)
    ours = off_policy.off_policy_correction(
        b.old_log_probs, b.rollout_logprobs, b.mask, OffPolicyCorrection.from_config(sky_cfg)
    )
    sky = skyrl.opc.compute_off_policy_correction(b.old_log_probs, b.rollout_logprobs, b.mask, sky_cfg)
    assert (ours[0] is None) == (sky[0] is None)
    if sky[0] is not None:
        torch.testing.assert_close(ours[0], sky[0], **TOL)
    assert_metrics_close(ours[1], sky[1])
    torch.testing.assert_close(ours[2], sky[2], **TOL)
    assert OffPolicyCorrection(**settings).enabled == skyrl.opc.off_policy_correction_enabled(sky_cfg)


@pytest.mark.parametrize("settings", [GRID[7], GRID[-1]])
def test_apply_matches_skyrl(skyrl, settings):
    b = make_batch(8, drift=0.3)
    sky_cfg = skyrl.config.OffPolicyCorrectionConfig(**settings)
    loss = torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(8))
    for rollout in (b.rollout_logprobs, None):
        ours = off_policy.apply_off_policy_correction(
            loss, b.old_log_probs, rollout, b.mask, OffPolicyCorrection(**settings)
        )
        sky = skyrl.opc.apply_off_policy_correction(loss, b.old_log_probs, rollout, b.mask, sky_cfg)
        torch.testing.assert_close(ours[0], sky[0], **TOL)
        torch.testing.assert_close(ours[1], sky[1], **TOL)
        assert_metrics_close(ours[2], sky[2])


def test_an_all_masked_batch(skyrl):
    b = make_batch(9)
    mask = torch.zeros_like(b.mask)
    settings = dict(
        tis_ratio_type="token",
        sequence_mask_metric="geometric",
        outlier_token_is_threshold_high=2.0,
        token_mask_is_threshold_low=0.5,
        token_mask_is_threshold_high=2.0,
    )
    ours = off_policy.off_policy_correction(
        b.old_log_probs, b.rollout_logprobs, mask, OffPolicyCorrection(**settings)
    )
    sky = skyrl.opc.compute_off_policy_correction(
        b.old_log_probs, b.rollout_logprobs, mask, skyrl.config.OffPolicyCorrectionConfig(**settings)
    )
    torch.testing.assert_close(ours[0], sky[0], **TOL)
    assert_metrics_close(ours[1], sky[1])
    assert torch.all(ours[2] == 0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(tis_ratio_type="seq"), "tis_ratio_type"),
        (dict(sequence_mask_metric="arithmetic"), "sequence_mask_metric"),
        (dict(token_mask_is_threshold_low=0.5), "set both"),
        (dict(token_mask_is_threshold_high=2.0), "set both"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        OffPolicyCorrection(**settings)


def test_from_config_reads_skyrls_section(skyrl):
    sky_cfg = skyrl.config.OffPolicyCorrectionConfig(tis_ratio_type="sequence", geo_mask_low=0.5)
    ours = OffPolicyCorrection.from_config(sky_cfg)
    assert ours == OffPolicyCorrection(tis_ratio_type="sequence", geo_mask_low=0.5)
    assert OffPolicyCorrection.from_config(ours) is ours
