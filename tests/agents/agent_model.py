"""A tiny Qwen2 checkpoint that calls a tool whatever the prompt (shared by the agent tests).

Its weights make it a bigram model (attention and MLP outputs zeroed, so each next token depends on
the current one only) that writes, greedily, a short text, then one Hermes-format call of
`get_weather` through the tokens `<tool_call>` / `</tool_call>` (added tokens, as in Qwen2.5's
tokenizer), then EOS (`<|im_end|>`); its chat template is `make_tiny_model`'s (Qwen2.5's rendering
of tools). Sampled at temperature 1 it keeps to that chain with probability ~0.98 per token.
"""

from __future__ import annotations

import json

from inflight.testing import make_chain_model

CONTENT = "Let me check."
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CHAIN = [CONTENT, "<tool_call>", f"\n{json.dumps(CALL)}\n", "</tool_call>"]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def make_agent_model(path) -> None:
    """A Qwen2 checkpoint whose greedy output is CHAIN then EOS for any prompt (`make_chain_model`)."""
    make_chain_model(path, CHAIN)
