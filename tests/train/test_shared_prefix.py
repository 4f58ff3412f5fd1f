"""`trainer.shared_prefix_forward`: a micro-batch's groups of rows with one context run as one packed
sequence each, and the log-probabilities, the entropy and the gradients equal plain `transformers`
row-by-row logits through torch's log-softmax (the oracle); where packing cannot apply or would not
pay, rows run as they are. Compared within a small multiple of what the oracle itself moves by
(`tests/tolerance.py`: in float64, and row by row on another thread count)."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerance import assert_close_to_reference, other_thread_count
from transformers import AutoModelForCausalLM

from inflight.config import load_config
from inflight.testing import LOCAL_CPU
from inflight.train import LocalPolicyWorker, TrainBatch
from inflight.train.shared_prefix import pack, pair_cost_of

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen2", seed=7)


def _groups(vocab: int, contexts=(9, 5), responses=((3, 1, 4, 2), (6, 2, 5)), seed=0) -> TrainBatch:
    """Rows of groups: each group one context, each row its own response (right-padded), the
    context untrained, every response token trained. Rows of different groups interleave."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for ctx, lengths in zip(contexts, responses, strict=True):
        prompt = torch.randint(0, vocab, (ctx,), generator=gen)
        rows += [(prompt, torch.randint(0, vocab, (n,), generator=gen)) for n in lengths]
    order = rows[::2] + rows[1::2]  # the groups' rows mixed
    width = max(len(p) + len(r) for p, r in order)
    ids = torch.zeros(len(order), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss = torch.zeros(len(order), width)
    for i, (p, r) in enumerate(order):
        ids[i, : len(p) + len(r)] = torch.cat([p, r])
        attention[i, : len(p) + len(r)] = 1
        loss[i, len(p) : len(p) + len(r)] = 1
    return TrainBatch(input_ids=ids, loss_mask=loss, attention_mask=attention)


def _worker(model_dir, chunk: str = "1024", shared: bool = True) -> LocalPolicyWorker:
    cfg = load_config(None, [*LOCAL_CPU, f"trainer.logprobs_chunk_size={chunk}",
                             f"trainer.shared_prefix_forward={str(shared).lower()}",
                             f"generator.sampling_params.temperature={TEMPERATURE}"])
    worker = LocalPolicyWorker(cfg, model_path=str(model_dir)).setup()
    worker.model.train()
    return worker


def _oracle(model: torch.nn.Module, batch: TrainBatch, weights: torch.Tensor | None,
            temperature: float = TEMPERATURE, entropy_coef: float = 0.1):
    """`model`'s logits of each row alone (no padding anywhere), torch's log-softmax, autograd of
    sum((logprob + entropy_coef * entropy) * weights) (none without `weights`): (logprobs, entropy,
    {name: gradient}), in the model's dtype."""
    dtype = next(model.parameters()).dtype
    logprobs = torch.zeros(batch.input_ids.shape, dtype=dtype)
    entropy = torch.zeros(batch.input_ids.shape, dtype=dtype)
    total = 0.0
    with torch.set_grad_enabled(weights is not None):
        for row, width in enumerate(batch.widths().tolist()):
            logits = model(input_ids=batch.input_ids[row : row + 1, :width]).logits[0, :-1] / temperature
            log_p = torch.log_softmax(logits, dim=-1)
            picked = log_p.gather(-1, batch.input_ids[row, 1:width, None])[:, 0]
            ent = -(log_p.exp() * log_p).sum(-1)
            if weights is not None:
                total = total + ((picked + entropy_coef * ent) * weights[row, 1:width]).sum()
            logprobs[row, 1:width], entropy[row, 1:width] = picked.detach(), ent.detach()
    if weights is not None:
        total.backward()
    return logprobs, entropy, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _variants(model: torch.nn.Module, batch: TrainBatch, weights: torch.Tensor | None, **kw) -> list[tuple]:
    """The oracle's own variation: the same rows in float64, and in float32 on another thread count."""
    wide = _oracle(copy.deepcopy(model).double(), batch, None if weights is None else weights.double(), **kw)
    with other_thread_count():
        return [wide, _oracle(copy.deepcopy(model), batch, weights, **kw)]


def _transformers(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()


@pytest.mark.parametrize("chunk", ["1024", "3", "null"])
def test_packed_groups_equal_transformers_row_by_row(model_dir, chunk):
    worker = _worker(model_dir, chunk)
    batch = _groups(worker.model.config.vocab_size)
    assert worker.packed(batch, worker.causal_lm()) is not None  # the packed path is the one under test
    weights = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
    weights *= batch.attention_mask
    hf = _transformers(model_dir)
    variants = _variants(hf, batch, weights)
    expected, expected_entropy, grads = _oracle(hf, batch, weights)
    logprobs, entropy = worker.compute_logprobs(batch, entropy=True)
    real = batch.attention_mask.bool()
    assert_close_to_reference(logprobs * real, expected, [v[0] for v in variants], "logprobs")
    assert_close_to_reference(entropy * real, expected_entropy, [v[1] for v in variants], "entropy")
    ((logprobs + 0.1 * entropy) * weights).sum().backward()
    for name, param in worker.model.named_parameters():
        assert_close_to_reference(param.grad, grads[name], [v[2][name] for v in variants], name)


def test_the_packed_rows_hold_each_context_once(model_dir):
    worker = _worker(model_dir)
    batch = _groups(worker.model.config.vocab_size)
    packed = pack(batch.input_ids, batch.loss_mask, batch.widths(), pair_cost_of(worker.model.config))
    assert packed.input_ids.shape == (2, max(9 + 3 + 1 + 4 + 2, 5 + 6 + 2 + 5))
    # a prediction per distinct (state, token): each context's own once, each response token once
    assert len(packed.targets) == (9 - 1 + 10) + (5 - 1 + 13)
    assert int(batch.loss_mask.sum()) == 10 + 13


def test_rows_with_no_shared_context_are_not_packed(model_dir):
    """Every row its own context: packing would only lengthen the rows, so the plain forward runs."""
    worker = _worker(model_dir)
    batch = _groups(worker.model.config.vocab_size, contexts=(4, 4, 4), responses=((3,), (2,), (5,)))
    assert worker.packed(batch, worker.causal_lm()) is None
    assert torch.isfinite(worker.compute_logprobs(batch)).all()


def test_long_responses_are_not_packed():
    """A short context before long responses: the packed row's attention costs more than its
    context saves (pair costs of a wide model), so `pack` declines."""
    ids = torch.arange(2 * 600).reshape(2, 600) % 50
    ids[1, :4] = ids[0, :4]
    loss = torch.zeros(2, 600)
    loss[:, 4:] = 1
    widths = torch.full((2,), 600)
    assert pack(ids, loss, widths, pair_cost=0.01) is None
    assert pack(ids, loss, widths, pair_cost=0.0) is not None


def test_off_the_plain_path_is_unchanged(model_dir):
    plain = _worker(model_dir, shared=False)
    batch = _groups(plain.model.config.vocab_size)
    assert plain.packed(batch, plain.causal_lm()) is None
    shared = _worker(model_dir)
    with torch.no_grad():
        got, want = (w.compute_logprobs(batch) * batch.attention_mask for w in (shared, plain))
    assert_close_to_reference(
        got, want, [v[0] for v in _variants(_transformers(model_dir), batch, None)], "logprobs"
    )


def test_a_lora_policy_packs_to_peft_s_plain_forward(model_dir):
    """A `peft` LoRA policy (adapters on every linear layer, randomised so they act): the packed
    forward's log-probabilities and adapter gradients equal the same adapters' unpacked forward."""
    lora = ["trainer.policy.model.lora.rank=4", "trainer.policy.model.lora.alpha=8"]

    def worker(shared: bool) -> LocalPolicyWorker:
        cfg = load_config(None, [*LOCAL_CPU, *lora, f"trainer.shared_prefix_forward={str(shared).lower()}"])
        w = LocalPolicyWorker(cfg, model_path=str(model_dir)).setup()
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, param in w.model.named_parameters():
                if "lora_" in name:
                    param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        w.model.train()
        return w

    packed, plain = worker(True), worker(False)
    batch = _groups(packed.model.config.vocab_size)
    assert packed.packed(batch, packed.causal_lm()) is not None
    real = batch.attention_mask
    # peft's own forward row by row, in float64 and on another thread count: what the reference varies by
    variants = _variants(plain.model, batch, real.float(), temperature=plain.temperature, entropy_coef=0.0)
    got, want = packed.compute_logprobs(batch) * real, plain.compute_logprobs(batch) * real
    assert_close_to_reference(got, want, [v[0] for v in variants], "logprobs")
    got.sum().backward()
    want.sum().backward()
    grads = dict(plain.model.named_parameters())
    trained = [(n, p) for n, p in packed.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    for name, param in trained:
        assert_close_to_reference(param.grad, grads[name].grad, [v[2][name] for v in variants], name)
