"""Training a vision-language policy (Qwen2.5-VL and Qwen3-VL: every test runs for both): one training
forward's per-token log-probabilities and gradients equal transformers' `Qwen2_5_VLForConditionalGeneration`
/ `Qwen3VLForConditionalGeneration` on the same batch (images from PIL through transformers' image
processor), chunked and full; the vision tower frozen by default (no
gradient, no optimizer state), trained with `freeze_vision_tower=false`; LoRA on the language model
only, against peft's own model; images carried from trajectories into the batch."""

from __future__ import annotations

import logging

import numpy as np
import peft
import pytest
import torch
from PIL import Image
from tolerance import assert_close_to_reference, other_thread_count
from transformers import AutoConfig

from inflight.config import ConfigError, load_config
from inflight.engine.multimodal import MultimodalInput
from inflight.rollout.trajectory import Trajectory, TrajectoryGroup
from inflight.tasks.base import Problem
from inflight.testing import LOCAL_CPU
from inflight.testing.tiny_vlm import TINY_VLMS, load_tiny_processor
from inflight.train import LocalPolicyWorker, TrainBatch
from inflight.train.batch import image_rows
from inflight.train.step import build_batch
from inflight.train.vision import check_vision_settings

TEMPERATURE = 0.8
TOWER = "model.visual."


@pytest.fixture(scope="module", params=sorted(TINY_VLMS))
def vlm_dir(request, tmp_path_factory):
    return TINY_VLMS[request.param][0](tmp_path_factory.mktemp(request.param), seed=3)


def _hf_class(vlm_dir) -> type:
    """transformers' class of the tiny model in `vlm_dir`."""
    return TINY_VLMS[AutoConfig.from_pretrained(vlm_dir).model_type][1]


def _image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8))


ROWS = [  # (images, text after them, response): 1 image, 2 images of other sizes, none (a shorter row)
    ([(60, 90)], "what is shown?", " a red square"),
    ([(56, 112), (84, 84)], "compare them", " the left one is larger than the other"),
    ([], "no picture here", " ok"),
]


def _texts_and_images(processor):
    texts, images = [], []
    for i, (sizes, question, response) in enumerate(ROWS):
        parts = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": question}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": parts}], add_generation_prompt=True
        )
        texts.append(prompt + response)
        images.append([_image(h, w, 10 * i + j) for j, (h, w) in enumerate(sizes)])
    return texts, images


@pytest.fixture(scope="module")
def data(vlm_dir):
    """(our TrainBatch, transformers' batched processor output for the same rows)."""
    processor = load_tiny_processor(vlm_dir)
    texts, images = _texts_and_images(processor)
    flat = [im for row in images for im in row]
    reference = processor(text=texts, images=flat, padding=True, padding_side="right", return_tensors="pt",
                          return_mm_token_type_ids=True)
    per_row = []
    for row_images in images:
        if not row_images:
            per_row.append(None)
            continue
        out = processor.image_processor(images=row_images, return_tensors="pt")
        per_row.append(MultimodalInput(out["pixel_values"], out["image_grid_thw"]))
    ids, attention = reference["input_ids"], reference["attention_mask"]
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)
    for row, (_, _, response) in enumerate(ROWS):
        n = len(processor.tokenizer(response)["input_ids"])
        end = int(attention[row].sum())
        loss_mask[row, end - n : end] = 1
    batch = TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask, **image_rows(per_row))
    return batch, reference


def _config(*overrides: str):
    return load_config(None, [*LOCAL_CPU, f"generator.sampling_params.temperature={TEMPERATURE}", *overrides])


def _worker(vlm_dir, *overrides: str) -> LocalPolicyWorker:
    worker = LocalPolicyWorker(_config(*overrides), model_path=str(vlm_dir)).setup()
    worker.model.train()
    return worker


def _oracle(model, reference, loss_mask, dtype=torch.float32):
    """transformers' forward and torch's log-softmax, with autograd's gradients of the masked sum."""
    model = model.to(dtype).train()
    model.zero_grad(set_to_none=True)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in reference.items()}
    logits = model(**inputs).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    picked = logprobs.gather(-1, reference["input_ids"][:, 1:, None])[..., 0]
    (picked * loss_mask[:, 1:]).sum().backward()
    return picked.detach(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def oracle(vlm_dir, data):
    """transformers' values and gradients, and two variants (another thread count, float64) that
    measure its own rounding."""
    batch, reference = data
    load = lambda: _hf_class(vlm_dir).from_pretrained(str(vlm_dir), dtype=torch.float32)  # noqa: E731
    main = _oracle(load(), reference, batch.loss_mask)
    with other_thread_count():
        threads = _oracle(load(), reference, batch.loss_mask)
    wide = _oracle(load(), reference, batch.loss_mask, torch.float64)
    return main, [threads, wide]


def test_the_batch_carries_the_processor_s_images(data):
    batch, reference = data
    pixels, grids = batch.images()
    assert torch.equal(pixels, reference["pixel_values"]) and torch.equal(grids, reference["image_grid_thw"])
    assert batch.select(torch.tensor([2])).images() is None  # the text-only row
    part = batch.select(torch.tensor([1])).trimmed()  # a micro-batch: its own images, padding cut
    n = int(reference["image_grid_thw"][0].prod())
    assert torch.equal(part.images()[0], reference["pixel_values"][n:])


@pytest.mark.parametrize("chunk", ["5", "null"])
def test_logprobs_and_gradients_equal_transformers(vlm_dir, data, oracle, chunk):
    """Every parameter trains (freeze_vision_tower=false): the vision tower's gradients too."""
    batch, _ = data
    (expected, grads), variants = oracle
    worker = _worker(
        vlm_dir, f"trainer.logprobs_chunk_size={chunk}", "trainer.policy.model.freeze_vision_tower=false"
    )
    got = worker.compute_logprobs(batch)
    mask = batch.attention_mask[:, 1:].bool()
    assert_close_to_reference(
        got[:, 1:][mask], expected[mask], [v[0][mask] for v in variants], what="logprobs"
    )
    (got * batch.loss_mask).sum().backward()
    params = dict(worker.model.named_parameters())
    assert any(name.startswith(TOWER) for name in grads)
    for name, grad in grads.items():
        assert_close_to_reference(params[name].grad, grad, [v[1][name] for v in variants], what=name)


def test_the_vision_tower_is_frozen_by_default(vlm_dir, data, oracle):
    batch, _ = data
    (expected, grads), variants = oracle
    worker = _worker(vlm_dir, "trainer.logprobs_chunk_size=5")
    hf_names = [n for n, _ in _hf_class(vlm_dir).from_pretrained(str(vlm_dir)).named_parameters()]
    tower = {n for n in hf_names if n.startswith(TOWER)}
    assert tower and all(not p.requires_grad for n, p in worker.model.named_parameters() if n in tower)
    assert {id(p) for p in worker.optimizer_parameters()} == {
        id(p) for n, p in worker.model.named_parameters() if n not in tower
    }
    (worker.compute_logprobs(batch) * batch.loss_mask).sum().backward()
    for name, param in worker.model.named_parameters():
        if name in tower:
            assert param.grad is None, name
        else:
            assert_close_to_reference(param.grad, grads[name], [v[1][name] for v in variants], what=name)
    assert [n for n, _ in worker.iter_sync_tensors()] == hf_names  # an engine takes only complete updates


def test_lora_adapts_the_language_model_as_peft_does(vlm_dir, data):
    """peft's own LoRA model over transformers' (the tower left out by a pattern of its own) with our
    adapter weights: the same log-probabilities and adapter gradients; no adapter in the tower."""
    batch, reference = data
    lora = [
        "trainer.policy.model.lora.rank=4",
        "trainer.policy.model.lora.alpha=8",
        "trainer.logprobs_chunk_size=5",
    ]
    worker = _worker(vlm_dir, *lora)
    with torch.no_grad():
        for name, param in worker.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    names = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and ".visual." not in n for n in names)
    assert not any("visual" in n for n, _ in worker.iter_sync_tensors())
    base = _hf_class(vlm_dir).from_pretrained(str(vlm_dir), dtype=torch.float32)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=r"model\.visual\..*"
    )
    oracle = peft.get_peft_model(base, config).train()
    oracle.load_state_dict(
        {n: p.detach() for n, p in worker.model.named_parameters() if "lora_" in n}, strict=False
    )
    expected, grads = _oracle(oracle, reference, batch.loss_mask)
    assert set(grads) == set(names)
    got = worker.compute_logprobs(batch)
    mask = batch.attention_mask[:, 1:].bool()
    with other_thread_count():
        variant, variant_grads = _oracle(oracle, reference, batch.loss_mask)
    assert_close_to_reference(got[:, 1:][mask], expected[mask], [variant[mask]], what="LoRA logprobs")
    (got * batch.loss_mask).sum().backward()
    params = dict(worker.model.named_parameters())
    for name in names:
        assert_close_to_reference(params[name].grad, grads[name], [variant_grads[name]], what=name)


def test_shared_prefix_forward_is_refused_for_images_once(vlm_dir, data, caplog):
    batch, _ = data
    worker = _worker(vlm_dir, "trainer.shared_prefix_forward=true", "trainer.logprobs_chunk_size=5")
    plain = _worker(vlm_dir, "trainer.logprobs_chunk_size=5")
    with caplog.at_level(logging.INFO, logger="inflight.train.vision"), torch.no_grad():
        got = [worker.compute_logprobs(batch) for _ in range(2)]
    assert worker.forward_tokens == batch.input_ids.numel()
    assert torch.equal(got[0], plain.compute_logprobs(batch).detach())
    assert sum("shared-prefix forward off" in r.message for r in caplog.records) <= 1


def test_trajectories_bring_their_images_into_the_batch(data):
    _, reference = data
    grids, pixels = reference["image_grid_thw"], reference["pixel_values"]
    n = int(grids[0].prod())
    first, second = MultimodalInput(pixels[:n], grids[:1]), MultimodalInput(pixels[n:], grids[1:])

    def trajectory(prompt, images, response=(5, 6)):
        return Trajectory(list(prompt), list(response), [0.0] * len(response), [0] * len(response),
                          [1] * len(response), 1.0, "stop", images=images)

    failed = Trajectory([], [], [], [], [], 0.0, "rollout_error", images=None, rollout_failed=True)
    groups = [TrajectoryGroup(Problem("a", "q", "x"), [trajectory((1, 2, 3), first), failed]),
              TrajectoryGroup(Problem("b", "q", "x"), [trajectory((4,), second), trajectory((4,), None)])]
    batch = build_batch(groups, None, pad_id=0)
    assert failed.images is first  # its prompt is the donor's, placeholders and images
    want = torch.cat([pixels[:n], pixels[:n], pixels[n:]]), torch.cat([grids[:1], grids[:1], grids[1:]])
    got = batch.images()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_lora_with_a_training_tower_and_megatron_are_refused(vlm_dir, tmp_path):
    lora_unfrozen = _config(
        "trainer.policy.model.lora.rank=4", "trainer.policy.model.freeze_vision_tower=false"
    )
    problems = check_vision_settings(lora_unfrozen, vlm_dir, "local")
    assert [p.key for p in problems] == ["trainer.policy.model.freeze_vision_tower"]
    assert "freeze_vision_tower=true" in str(problems[0])
    assert [p.key for p in check_vision_settings(_config(), vlm_dir, "megatron")] == ["trainer.strategy"]
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')  # a text model: nothing asked of it
    assert check_vision_settings(lora_unfrozen, tmp_path, "megatron") == []
    with pytest.raises(ConfigError, match="freeze_vision_tower"):
        from inflight.train.vision import raise_vision_settings
        raise_vision_settings(lora_unfrozen, vlm_dir, "local")


def test_freeze_vision_tower_defaults_to_true():
    assert load_config(None, []).trainer.policy.model.freeze_vision_tower is True


def test_after_a_step_and_a_sync_the_engine_scores_as_the_trainer(vlm_dir):
    """One optimizer step with the tower training (its weights move), the sync's full weights into the
    native engine: its greedy tokens' logprobs for an image prompt, at the new weight
    version, equal the trainer's forward of the same tokens and images."""
    from inflight.engine import EngineConfig, LLMEngine, SamplingParams

    processor = load_tiny_processor(vlm_dir)
    texts, images = _texts_and_images(processor)
    prompt = processor(text=[texts[1]], images=images[1], return_tensors="pt")
    worker = _worker(vlm_dir, "trainer.logprobs_chunk_size=5", "trainer.policy.optimizer_config.lr=0.01",
                     "trainer.policy.model.freeze_vision_tower=false")
    ids = prompt["input_ids"]
    images_in = MultimodalInput(prompt["pixel_values"], prompt["image_grid_thw"])
    step_batch = TrainBatch(
        input_ids=ids,
        loss_mask=torch.ones_like(ids, dtype=torch.float32).index_fill(1, torch.tensor([0]), 0),
        **image_rows([images_in]),
    )
    tower_before = {n: p.detach().clone() for n, p in worker.model.named_parameters() if TOWER in n}
    worker.train_step(step_batch)
    assert any(
        not torch.equal(p, tower_before[n]) for n, p in worker.model.named_parameters() if n in tower_before
    )
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), block_size=8))
    engine.begin_weight_update()
    engine.load_weights(worker.iter_sync_tensors())
    assert engine.finish_weight_update(1) == 1
    out = engine.generate([ids[0].tolist()], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                          multimodal=[images_in])[0]
    assert set(out.token_weight_versions) == {1}
    # a sampled placeholder id is text to the engine but an image to transformers' forward (the trainer's):
    # cut there
    placeholder = engine.vision.image_token_id
    response = out.output_token_ids[: (out.output_token_ids + [placeholder]).index(placeholder)]
    assert len(response) >= 3
    full = torch.tensor([ids[0].tolist() + response])
    batch = TrainBatch(
        input_ids=full, loss_mask=torch.ones_like(full, dtype=torch.float32), **image_rows([images_in])
    )
    worker.temperature = 1.0  # the engine's logprobs are of the unscaled distribution
    with torch.no_grad():
        trainer = worker.compute_logprobs(batch)[0, ids.shape[1]:]
        with other_thread_count():
            variant = worker.compute_logprobs(batch)[0, ids.shape[1]:]
    assert_close_to_reference(torch.tensor(out.logprobs[: len(response)]), trainer, [variant],
                              what="engine vs trainer logprobs")
