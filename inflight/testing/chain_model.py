"""A tiny Qwen2 checkpoint that writes a fixed chain of tokens then EOS whatever the prompt (what the
tool-call and agent tests need: a model that calls a tool every time).

Its weights make it a bigram model: attention and MLP outputs are zeroed, so the residual stream stays
the current token's embedding and each next token depends on that token only. Every token outside the
chain points at the chain's first token; each chain token (added to the tokenizer, all distinct)
points at its successor, the last at EOS. Greedy decoding writes the chain exactly; at temperature 1 it
keeps to it with probability ~0.98 per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from inflight.testing.tiny_model import make_tiny_model


def make_chain_model(path: str | Path, chain: Sequence[str], chat_template: str | None = None) -> Path:
    """Build the checkpoint in `path`: `make_tiny_model`'s Qwen2 (vocab 400) with `chain`'s strings
    added as tokens, its chat template replaced by `chat_template` when given."""
    path = make_tiny_model(path, "qwen2", seed=0, vocab_size=400)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(list(chain))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids(list(chain)) + [tokenizer.eos_token_id]
    weights = load_file(path / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed.zero_()
    embed[:, 0] = 1.0  # every token not in the chain: direction 0 ...
    head.zero_()
    head[ids[0], 0] = 10.0  # ... is followed by the chain's first token
    for slot, (token, successor) in enumerate(zip(ids[:-1], ids[1:], strict=True), start=1):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(slot), embed.shape[1]).float()
        head[successor, slot] = 10.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
