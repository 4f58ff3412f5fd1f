"""inflight.algorithms.entropy against SkyRL 0.3.0's chunked entropy and verl 0.9.1's entropy_from_logits."""

from __future__ import annotations

import pytest
import torch
from algorithm_batches import TOL, random_mask
from skyrl_worker import TokenTable, skyrl_forward_backward

from inflight.algorithms import entropy, masked_mean


def _logits(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(4, 11, 50, generator=gen, dtype=dtype)
    logits[0, 0] = 0.0  # uniform: log(50)
    logits[0, 1, 7] = 1e4  # one-hot: 0
    return logits


@pytest.mark.parametrize("seed", (0, 1))
@pytest.mark.parametrize("chunk_size", (1, 4, 1024))
def test_chunked_entropy_matches_skyrl(skyrl, seed, chunk_size):
    logits = _logits(seed)
    mask = random_mask(torch.Generator().manual_seed(seed), 4, 11)
    for attention_mask in (None, mask):
        ours = entropy.chunked_entropy_from_logits(logits, chunk_size, attention_mask)
        sky = skyrl.torch_utils.chunked_entropy_from_logits(
            logits, attention_mask=attention_mask, chunk_size=chunk_size
        )
        torch.testing.assert_close(ours, sky, **TOL)
    whole = entropy.entropy_from_logits(logits)
    torch.testing.assert_close(whole, entropy.chunked_entropy_from_logits(logits, chunk_size), **TOL)
    torch.testing.assert_close(whole[0, 0], torch.tensor(50.0).log(), **TOL)
    assert whole[0, 1] == 0


def test_entropy_gradients_match_skyrl(skyrl):
    logits = _logits(2)
    mask = random_mask(torch.Generator().manual_seed(2), 4, 11)
    grads = []
    for fn in (
        lambda x: entropy.chunked_entropy_from_logits(x, 4, mask, requires_grad=True),
        lambda x: skyrl.torch_utils.chunked_entropy_from_logits(x, True, mask, chunk_size=4),
    ):
        x = logits.clone().requires_grad_(True)
        (fn(x) * torch.linspace(0.5, 2, 11)).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], **TOL)
    assert not entropy.chunked_entropy_from_logits(logits.requires_grad_(True), 4).requires_grad


def test_entropy_matches_verls_formula_in_float64(verl):
    """verl computes logsumexp - sum(p * logits), SkyRL -sum(p * log p): the same number (float64)."""
    logits = _logits(3, torch.float64)[1:]
    torch.testing.assert_close(
        entropy.entropy_from_logits(logits), verl.F.entropy_from_logits(logits), rtol=1e-12, atol=1e-12
    )


def test_entropy_loss_term_is_the_workers(skyrl):
    ent = entropy.chunked_entropy_from_logits(_logits(4), 1024)
    mask = random_mask(torch.Generator().manual_seed(4), 4, 11)
    term, mean = entropy.entropy_loss_term(ent, mask, 0.01)
    sky_mean = skyrl.torch_utils.masked_mean(ent, mask)
    torch.testing.assert_close(mean, sky_mean, **TOL)
    torch.testing.assert_close(term, sky_mean * 0.01, **TOL)


@pytest.mark.parametrize("micro_batch_size", (1, 2, 4, 8))
def test_entropy_weights_are_skyrl_workers(skyrl, monkeypatch, micro_batch_size):
    """SkyRL 0.3.0's worker over two mini-batches cut into micro-batches of `micro_batch_size` rows:
    the gradient its entropy bonus puts on each token's entropy and the `policy_entropy` it logs are
    ours with `entropy_token_weights` (rows without tokens count as rows, as in SkyRL)."""
    gen = torch.Generator().manual_seed(micro_batch_size)
    rows, width, coef = 16, 11, 0.05
    mask = random_mask(gen, rows, width)
    mask[9] = 0.0  # an empty row in the second mini-batch too
    ent, log_probs = 3 * torch.rand(rows, width, generator=gen), -torch.rand(rows, width, generator=gen)
    bounds = [(0, 8), (8, 16)]
    weights = entropy.entropy_token_weights(mask, bounds, micro_batch_size)
    alg = skyrl.config.AlgorithmConfig(use_entropy_loss=True, entropy_loss_coef=coef, use_kl_loss=False)
    for start, end in bounds:
        table = TokenTable(log_probs[start:end], ent[start:end])
        metrics = skyrl_forward_backward(monkeypatch, table, alg, micro_batch_size,
                                         advantages=torch.randn(end - start, width, generator=gen),
                                         loss_mask=mask[start:end], action_log_probs=log_probs[start:end])
        ours = -coef * weights[start:end, None] * mask[start:end]
        torch.testing.assert_close(table.entropy.grad, ours, rtol=1e-5, atol=0)
        logged = (ent[start:end] * mask[start:end] * weights[start:end, None]).sum()
        torch.testing.assert_close(
            logged.double(), torch.tensor(metrics["policy_entropy"], dtype=torch.float64), rtol=1e-5, atol=0
        )
    if micro_batch_size == 1:  # SkyRL's default: the mean of the rows' means, not the token mean
        first = (ent[:8] * mask[:8] * weights[:8, None]).sum()
        torch.testing.assert_close(first, masked_mean(ent[:8], mask[:8], dim=-1).mean(), **TOL)
        assert abs(float(first - masked_mean(ent[:8], mask[:8]))) > 1e-3


def test_entropy_weights_refuse_a_micro_batch_of_no_rows():
    with pytest.raises(ValueError, match="micro_batch_size"):
        entropy.entropy_token_weights(torch.ones(2, 3), [(0, 2)], 0)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="chunk_size"):
        entropy.chunked_entropy_from_logits(torch.zeros(1, 2, 3), 0)
    with pytest.raises(ValueError, match=r"\[B, S, V\]"):
        entropy.chunked_entropy_from_logits(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="attention_mask"):
        entropy.chunked_entropy_from_logits(torch.zeros(1, 2, 3), 4, torch.ones(2, 2))
