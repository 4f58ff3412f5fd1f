"""A converted directory checked against transformers' reading of the GGUF file it came from.

float32: on each of the model's check prompts (chat template applied), the saved tokenizer gives the
same ids, greedy decoding the same tokens, and a forward over prompt + answer the same logits within
`RTOL` of their magnitude. Both sides run the same transformers Llama code on the same weights, shapes
and threads, so they agree bit for bit unless a weight differs; `RTOL` only leaves room for a kernel
choice that a saved-and-reloaded tensor's layout could change. bfloat16: every saved tensor equals the
reference's float32 weight rounded to bfloat16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inflight.models_hub.convert import Reference
from inflight.models_hub.registry import KnownModel, ModelError

RTOL = 1e-5
NEW_TOKENS = 16


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """`prompt` as one user turn through the tokenizer's chat template, ready for the answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def greedy(model: Any, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of `ids`."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def _mismatch(model: KnownModel, out: Path, reference: Reference, what: str) -> ModelError:
    return ModelError(f"{out} does not match transformers' reading of {reference.gguf_path}: {what}; delete "
                      f"{out} and run `inflight models get {model.name}` again (if it repeats, report it "
                      "with the output of `inflight env`)")


@torch.no_grad()
def check_float32(model: KnownModel, out: Path, reference: Reference) -> dict[str, Any]:
    """Check the float32 directory `out` (module docstring); the evidence, or a ModelError."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    worst, answers = 0.0, {}
    for prompt in model.check_prompts:
        ids = chat_ids(reference.tokenizer, prompt)
        if chat_ids(tokenizer, prompt) != ids:
            raise _mismatch(model, out, reference, f"the saved tokenizer's chat ids for {prompt!r} differ")
        expected = greedy(reference.model, ids)
        if greedy(saved, ids) != expected:
            raise _mismatch(model, out, reference, f"greedy tokens for {prompt!r} differ")
        x = torch.tensor([ids + expected])
        want, got = reference.model(x).logits, saved(x).logits
        rel = ((want - got).abs().max() / want.abs().max()).item()
        worst = max(worst, rel)
        if not rel <= RTOL:
            raise _mismatch(model, out, reference, f"logits for {prompt!r} differ by {rel:.1e} of their "
                            f"magnitude (allowed {RTOL:.0e})")
        answers[prompt] = tokenizer.decode(expected, skip_special_tokens=True)
    return {"prompts": list(model.check_prompts), "greedy_tokens_equal": True, "new_tokens": NEW_TOKENS,
            "max_relative_logit_diff": worst, "rtol": RTOL, "greedy_answers": answers}


@torch.no_grad()
def check_rounded(model: KnownModel, out: Path, reference: Reference, dtype: str) -> dict[str, Any]:
    """Check that the `dtype` directory `out` loads (dtype "auto") as the reference's float32 weights
    rounded to `dtype`, every tensor."""
    from transformers import AutoModelForCausalLM

    target = getattr(torch, dtype)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype="auto").state_dict()
    want = reference.model.state_dict()
    if saved.keys() != want.keys():
        raise _mismatch(
            model, out, reference, f"tensor names differ ({sorted(saved.keys() ^ want.keys())[:3]})"
        )
    for name, tensor in want.items():
        if saved[name].dtype != target or not torch.equal(saved[name], tensor.to(target)):
            raise _mismatch(model, out, reference, f"{name} is not the float32 weight rounded to {dtype}")
    return {"weights_equal_float32_rounded": True, "tensors": len(want)}
