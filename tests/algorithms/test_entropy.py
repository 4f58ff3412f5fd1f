"""inflight.algorithms.entropy against SkyRL 0.3.0's chunked entropy and verl 0.9.1's entropy_from_logits."""

from __future__ import annotations

import pytest
import torch
from algorithm_batches import TOL, random_mask

from inflight.algorithms import entropy


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


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="chunk_size"):
        entropy.chunked_entropy_from_logits(torch.zeros(1, 2, 3), 0)
    with pytest.raises(ValueError, match=r"\[B, S, V\]"):
        entropy.chunked_entropy_from_logits(torch.zeros(2, 3), 4)
    with pytest.raises(ValueError, match="attention_mask"):
        entropy.chunked_entropy_from_logits(torch.zeros(1, 2, 3), 4, torch.ones(2, 2))
