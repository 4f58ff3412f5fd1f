"""lm-eval-harness's `local-completions` model runs a loglikelihood (multiple-choice) task with local
JSONL data against the served engine, and every score equals transformers' log-likelihood of the
continuation given the context (fp32). lm-eval picks its remote tokenizer by itself here (our
`/tokenizer_info` and `/tokenize`), and sends what it always sends: echo=True, logprobs=1,
max_tokens=1, temperature=0 on token-id prompts."""

from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

DOCS = [
    {"question": "the sound of", "choices": ["water", "the day", "one more time"], "answer": 0},
    {"question": "what is 12+34?", "choices": ["46", "a number", "word"], "answer": 0},
    {"question": "make a good", "choices": ["day", "home for all", "line"], "answer": 1},
]
TASK = """task: inflight_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def hf_loglikelihood(hf, tokenizer, context: str, continuation: str) -> float:
    """Sum of log P(continuation tokens | context) from transformers, split as lm-eval splits them
    (the pair's tokens, the context's prefix of them)."""
    whole = tokenizer(context + continuation)["input_ids"]
    n_ctx = len(tokenizer(context)["input_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(n_ctx, len(whole)))


def test_local_completions_scores_equal_transformers(server, tokenizer, model_dir, hf_model_factory, tmp_path,
                                                     monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=server.model_name, max_retries=1,
                             num_concurrent=1, batch_size=3, max_length=512)
    assert lm.tokenizer_backend == "remote"  # found /tokenizer_info and /tokenize
    results = simple_evaluate(model=lm, tasks=["inflight_tiny_choice"], task_manager=TaskManager(
        include_path=str(tmp_path), include_defaults=False), log_samples=True, cache_requests=False)
    samples = results["samples"]["inflight_tiny_choice"]
    hf = hf_model_factory(model_dir)
    scored = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            loglikelihood = resp[0][0]
            assert loglikelihood == pytest.approx(
                hf_loglikelihood(hf, tokenizer, context, continuation), abs=3e-5
            )
            scored += 1
    assert scored == sum(len(d["choices"]) for d in DOCS)
    assert 0.0 <= results["results"]["inflight_tiny_choice"]["acc,none"] <= 1.0
