"""A tiny Qwen2 checkpoint that calls a tool whatever the prompt (shared by the agent tests).

Its weights make it a bigram model (attention and MLP outputs zeroed, so each next token depends on
the current one only) that writes, greedily, a short text, then one Hermes-format call of
`get_weather` through the tokens `<tool_call>` / `</tool_call>` (added tokens, as in Qwen2.5's
tokenizer), then EOS (`<|im_end|>`); its chat template is `make_tiny_model`'s (Qwen2.5's rendering
of tools). Sampled at temperature 1 it keeps to that chain with probability ~0.98 per token.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from inflight.testing import make_tiny_model

CONTENT = "Let me check."
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CHAIN = [CONTENT, "<tool_call>", f"\n{json.dumps(CALL)}\n", "</tool_call>"]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def make_agent_model(path) -> None:
    """A Qwen2 checkpoint whose greedy output is CHAIN then EOS for any prompt (see module doc)."""
    make_tiny_model(path, "qwen2", seed=0, vocab_size=400)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(CHAIN)
    tokenizer.save_pretrained(path)
    chain = tokenizer.convert_tokens_to_ids(CHAIN) + [tokenizer.eos_token_id]
    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()  # the residual stream stays the token's embedding
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed.zero_()
    embed[:, 0] = 1.0  # every token not in the chain: direction 0
    head.zero_()
    head[chain[0], 0] = 10.0  # ... is followed by the chain's first token
    for slot, (token, successor) in enumerate(zip(chain[:-1], chain[1:], strict=True), start=1):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(slot), embed.shape[1]).float()
        head[successor, slot] = 10.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
