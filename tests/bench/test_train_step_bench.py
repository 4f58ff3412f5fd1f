"""`inflight bench train-step` end to end on a small shape: each mode runs in its own process and
the table names the CPU (the real shape's figures are in docs/benchmarks.md). Two modes keep it short:
the baseline, the full fine-tuning mode that uses every option, and LoRA over a bfloat16 base."""

from __future__ import annotations

import json

import pytest

from inflight.bench.train_step_bench import main


def test_every_mode_measures_a_step(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert (
        main(
            [
                "--shape",
                "small",
                "--seqs",
                "2",
                "--len",
                "16",
                "--warmup",
                "0",
                "--threads",
                "1",
                "--modes",
                "plain,bf16_gc,lora16_bf16",
                "--logprobs-chunk-size",
                "5",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["results"]] == ["plain", "bf16_gc", "lora16_bf16"]
    for r in result["results"]:
        assert r["seconds_per_step"] > 0 and r["cpu_seconds_per_step"] > 0 and r["peak_rss_mib"] > 0
        assert 0 < r["fraction_of_peak"]
    table = capsys.readouterr().out
    assert result["cpu"] in table and "| bf16_gc |" in table


def test_unknown_mode_is_refused(capsys):
    assert main(["--modes", "fp32,fp8"]) == 2
    assert "unknown mode(s) ['fp8']" in capsys.readouterr().err


def _real_shaped_model(tmp_path):
    """A tiny Llama with tied embeddings whose vocabulary (10,000) lies between the built-in shapes'
    (1,024 and 151,936): token ids drawn from the default shape's vocabulary fall outside it."""
    from inflight.testing import make_tiny_model

    return make_tiny_model(
        tmp_path / "model",
        "llama",
        vocab_size=10_000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )


def test_a_model_dir_is_measured_with_its_own_vocabulary_shape_and_parameters(tmp_path, capsys):
    """`--model-dir` of an existing model (e.g. `inflight models get`'s): the batch is drawn from its
    vocabulary (the built-in shape's ids made an IndexError), and the FLOPs, parameter count and table
    are its own; counted here from transformers' model of the directory."""
    from transformers import AutoModelForCausalLM

    model_dir = _real_shaped_model(tmp_path)
    out = tmp_path / "result.json"
    assert (
        main(
            [
                "--model-dir",
                str(model_dir),
                "--seqs",
                "2",
                "--len",
                "12",
                "--warmup",
                "0",
                "--threads",
                "1",
                "--modes",
                "plain,fp32",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    assert result["model"]["params"] == hf.num_parameters() and result["model"]["path"] == str(model_dir)
    params = dict(hf.named_parameters())
    trunk = sum(p.numel() for n, p in params.items() if n.endswith("proj.weight"))
    tokens, cfg = 2 * 12, hf.config
    attention = 4 * cfg.num_hidden_layers * cfg.hidden_size * 2 * 12 * 13 // 2
    flops = 3.0 * (
        2.0 * trunk * tokens + 2.0 * params["model.embed_tokens.weight"].numel() * tokens + attention
    )
    for r in result["results"]:
        assert r["flops_per_s"] * r["seconds_per_step"] == pytest.approx(flops, rel=1e-9)
    table = capsys.readouterr().out
    assert (
        f"model: llama ({model_dir}), hidden 64, 3 layers, vocab 10000, {hf.num_parameters() / 1e6:.1f}M"
        in table
    )


def test_a_shape_beside_an_existing_model_dir_is_refused(tmp_path, capsys):
    model_dir = _real_shaped_model(tmp_path)
    assert main(["--model-dir", str(model_dir), "--shape", "small"]) == 2
    assert f"--model-dir {model_dir} holds a model already" in capsys.readouterr().err
