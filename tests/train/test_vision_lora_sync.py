"""LoRA on a vision-language policy, synced into the native engine: one LoRA step on the tiny Qwen2.5-VL and
Qwen3-VL, the adapter sync (the trainer's names, `model.language_model.layers...`, which the engine resolves
as the full-weight path does), then the engine's greedy logprobs on an image prompt at the new version equal
the trainer's forward of the same tokens and images (issue 42)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tolerance import assert_close_to_reference, other_thread_count

from inflight.config import load_config
from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.engine.multimodal import MultimodalInput
from inflight.testing import LOCAL_CPU
from inflight.testing.tiny_vlm import TINY_VLMS, load_tiny_processor
from inflight.train import LocalPolicyWorker, TrainBatch
from inflight.train.batch import image_rows


@pytest.fixture(scope="module", params=sorted(TINY_VLMS))
def vlm_dir(request, tmp_path_factory):
    return TINY_VLMS[request.param][0](tmp_path_factory.mktemp(request.param), seed=5)


def _prompt(vlm_dir):
    processor = load_tiny_processor(vlm_dir)
    rng = np.random.RandomState(1)
    images = [
        Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((56, 112), (84, 84))
    ]
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "compare them"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    out = processor(text=[text], images=images, return_tensors="pt")
    return out["input_ids"], MultimodalInput(out["pixel_values"], out["image_grid_thw"])


def test_a_lora_step_synced_into_the_engine_scores_as_the_trainer(vlm_dir):
    ids, images = _prompt(vlm_dir)
    cfg = load_config(
        None,
        [
            *LOCAL_CPU, "trainer.policy.model.lora.rank=4", "trainer.policy.model.lora.alpha=8",
            "trainer.logprobs_chunk_size=5", "trainer.policy.optimizer_config.lr=0.05",
        ],
    )
    worker = LocalPolicyWorker(cfg, model_path=str(vlm_dir)).setup()
    worker.model.train()
    loss_mask = torch.ones_like(ids, dtype=torch.float32).index_fill(1, torch.tensor([0]), 0)
    worker.train_step(TrainBatch(input_ids=ids, loss_mask=loss_mask, **image_rows([images])))
    sent = list(worker.iter_sync_tensors())
    assert sent and all("lora_" in n and "visual" not in n for n, _ in sent)
    assert any(float(t.abs().sum()) > 0 for n, t in sent if "lora_B" in n)  # the step moved the adapter

    engine = LLMEngine(EngineConfig(model=str(vlm_dir), block_size=8))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = engine.generate([ids[0].tolist()], params, multimodal=[images])[0]
    engine.begin_weight_update()
    engine.load_weights(sent)
    assert engine.finish_weight_update(1) == 1
    out = engine.generate([ids[0].tolist()], params, multimodal=[images])[0]
    assert set(out.token_weight_versions) == {1}
    assert out.logprobs != base.logprobs  # the adapter is in the engine's weights

    # a sampled placeholder id is text to the engine but an image to transformers' forward (the trainer's):
    # cut there
    placeholder = engine.vision.image_token_id
    response = out.output_token_ids[: (out.output_token_ids + [placeholder]).index(placeholder)]
    assert len(response) >= 3
    full = torch.tensor([ids[0].tolist() + response])
    batch = TrainBatch(
        input_ids=full, loss_mask=torch.ones_like(full, dtype=torch.float32), **image_rows([images])
    )
    worker.temperature = 1.0  # the engine's logprobs are of the unscaled distribution
    worker.model.eval()
    with torch.no_grad():
        trainer = worker.compute_logprobs(batch)[0, ids.shape[1]:]
        with other_thread_count():
            variant = worker.compute_logprobs(batch)[0, ids.shape[1]:]
    assert_close_to_reference(torch.tensor(out.logprobs[: len(response)]), trainer, [variant],
                              what="engine vs trainer logprobs")
