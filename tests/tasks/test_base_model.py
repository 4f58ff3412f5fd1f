"""The tiny base model: its shape, that the engine and transformers both load it, and that the
supervised warm-up learns and its teacher-forced accuracy equals the engine's greedy accuracy."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from inflight.engine import EngineConfig, LLMEngine, SamplingParams
from inflight.tasks import AdditionTask, build_base_model, teacher_forced_accuracy, warm_up

SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256)


def test_default_shape_is_about_one_million_parameters(tmp_path):
    path = build_base_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.tie_word_embeddings, cfg.vocab_size) == (128, 4, 4, 2, 512, True, 14)
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.1e6
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=8))
    assert engine.eos_token_ids == {1}


def test_warm_up_learns_and_teacher_forcing_matches_engine_greedy(tmp_path):
    task = AdditionTask(max_digits=1, num_eval=20, num_train=10)
    path = build_base_model(tmp_path / "m", **SMALL)
    report = warm_up(path, task, steps=300, batch_size=64, target_accuracy=0.3, eval_every=20)  # no time cap
    assert report.accuracy >= 0.3 and report.stopped_by == "accuracy"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert teacher_forced_accuracy(model, task, task.eval_problems()) == pytest.approx(report.accuracy)
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32))
    prompts = [task.encode_prompt(p.prompt) for p in task.eval_problems()]
    outs = engine.generate(prompts, SamplingParams(max_tokens=task.max_new_tokens, temperature=0.0))
    correct = [task.reward(p, task.decode(o.output_token_ids)) == 1.0 and o.finish_reason == "stop"
               for p, o in zip(task.eval_problems(), outs, strict=True)]
    assert sum(correct) / len(correct) == pytest.approx(report.accuracy)
