"""`trainer.logprobs_chunk_size`: the training forward's log-probabilities (and, asked for it, the
token entropy of the entropy bonus) a chunk of tokens at a time equal plain `transformers` logits
through torch's log-softmax, values and gradients, and the forward keeps no [tokens, vocabulary]
tensor for the backward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.config import ConfigError, load_config
from inflight.testing import LOCAL_CPU
from inflight.train import LocalPolicyWorker, TrainBatch

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=5)


def _batch(vocab: int) -> TrainBatch:
    ids = torch.randint(0, vocab, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0  # a padded row
    return TrainBatch(input_ids=ids, attention_mask=mask, loss_mask=mask.clone())


def _worker(model_dir, chunk: str) -> LocalPolicyWorker:
    cfg = load_config(None, [*LOCAL_CPU, f"trainer.logprobs_chunk_size={chunk}",
                             f"generator.sampling_params.temperature={TEMPERATURE}"])
    worker = LocalPolicyWorker(cfg, model_path=str(model_dir)).setup()
    worker.model.train()
    return worker


def _reference(model_dir, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' full logits, torch's log-softmax and gather, torch autograd's gradients."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    picked = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    (picked * batch.loss_mask[:, 1:]).sum().backward()
    return picked.detach(), {n: p.grad for n, p in model.named_parameters()}


def _close(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal within 1e-6 of the tensor's largest magnitude: float32 rounding of sums taken in
    another order (a gradient accumulated chunk by chunk, a one-row matmul's kernel)."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(
        got, expected, atol=1e-6 * max(scale, 1.0), rtol=0, msg=lambda m: f"{name}: {m}"
    )


@pytest.mark.parametrize("chunk", ["1", "7", "1024"])  # one token, a chunk that does not divide, one chunk
def test_chunks_equal_the_full_logits_in_value_and_gradient(model_dir, chunk):
    worker = _worker(model_dir, chunk)
    batch = _batch(worker.model.config.vocab_size)
    expected, grads = _reference(model_dir, batch)
    got = worker.compute_logprobs(batch)
    assert torch.equal(got[:, 0], torch.zeros(3))
    _close(got[:, 1:], expected, "logprobs")
    (got * batch.loss_mask).sum().backward()
    for name, param in worker.model.named_parameters():
        _close(param.grad, grads[name], name)
    with torch.no_grad():  # no autograd: the plain chunks, the same values
        torch.testing.assert_close(worker.compute_logprobs(batch), got.detach(), atol=0, rtol=0)


@pytest.mark.parametrize("chunk", ["3", "null"])
def test_the_entropy_equals_autograd_s_of_transformers_logits(model_dir, chunk):
    """Entropy of the temperature-scaled distribution of each token, and the gradient of a loss mixing
    log-probabilities and entropy, against transformers' full logits through torch autograd."""
    worker = _worker(model_dir, chunk)
    batch = _batch(worker.model.config.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
    logits = (
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1] / TEMPERATURE
    )
    log_p = torch.log_softmax(logits, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    picked = log_p.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:]
    ((picked - 0.3 * entropy) * mask).sum().backward()
    got_lp, got_h = worker.compute_logprobs(batch, entropy=True)
    assert torch.equal(got_h[:, 0], torch.zeros(3))
    _close(got_h[:, 1:], entropy.detach(), "entropy")
    ((got_lp - 0.3 * got_h) * batch.loss_mask).sum().backward()
    for name, param in worker.model.named_parameters():
        _close(param.grad, dict(model.named_parameters())[name].grad, name)


def _saved_widths(worker: LocalPolicyWorker, batch: TrainBatch, entropy: bool = False) -> set[int]:
    """The last dimension of every tensor the forward keeps for the backward."""
    widths: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        widths.add(tensor.shape[-1] if tensor.dim() else 0)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        worker.compute_logprobs(batch, entropy=entropy)
    return widths


def test_the_forward_keeps_no_vocabulary_sized_tensor(model_dir):
    chunked, full = _worker(model_dir, "4"), _worker(model_dir, "null")
    vocab = chunked.model.config.vocab_size
    batch = _batch(vocab)
    assert vocab in _saved_widths(full, batch)  # the full logits' log-softmax is kept: the check sees it
    assert vocab not in _saved_widths(chunked, batch) and vocab not in _saved_widths(
        chunked, batch, entropy=True
    )
    torch.testing.assert_close(
        chunked.compute_logprobs(batch), full.compute_logprobs(batch), atol=1e-6, rtol=1e-6
    )


def test_a_chunk_size_below_one_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(None, [*LOCAL_CPU, "trainer.logprobs_chunk_size=0"])
    assert err.value.keys == ["trainer.logprobs_chunk_size"] and "null for no chunking" in str(err.value)
