"""Build tiny random Hugging Face model directories on the spot (no downloads).

`make_tiny_model(path, arch)` writes config.json, model.safetensors and tokenizer files (a byte-level
BPE trained here, with a ChatML chat template), so that tests, the README job and benchmarks can load
a real HF checkpoint directory with `transformers` and with the inflight engine alike.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

SUPPORTED_ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")
# Mixtures of experts: 8 experts, 2 per token, each expert a quarter of the dense MLP's width.
# Qwen3-MoE checkpoints renormalise the chosen experts' weights, Qwen2-MoE (Qwen1.5-MoE) ones do not
# and add a gated shared expert.
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
_MOE_DEFAULTS = {
    "qwen3_moe": dict(_MOE, norm_topk_prob=True),
    "qwen2_moe": dict(_MOE, norm_topk_prob=False, shared_expert_intermediate_size=64),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    # ChatML; with `tools`, Qwen2.5's rendering: a system turn lists them as JSON in <tools>, an
    # assistant's tool_calls come out as <tool_call> blocks, and tool results go back as one user turn
    # of <tool_response> blocks. Without tools, tool calls or tool messages: plain ChatML.
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls is defined and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}{%- if message['content'] %}{{ '\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.tool_calls %}{%- if call.function is defined %}{%- set call = call.function %}"
    "{%- endif %}{{ '\n<tool_call>\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{ (call.arguments if call.arguments is string else call.arguments | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
_WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or had "
    "by word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here must big high"
).split()


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        nums = f"{rng.randint(0, 999)}+{rng.randint(0, 999)}={rng.randint(0, 1998)}"
        out.append(" ".join(words) + ". " + nums + " ?!,;:'\"()[]{}<>-_/\\*#@$%&^~`|")
    return out


def make_tokenizer(vocab_size: int = 384, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on a generated corpus; every byte string is encodable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(arch: str, vocab_size: int, tokenizer: PreTrainedTokenizerFast, overrides: dict[str, Any]):
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        # A wide init gives peaked logits, so greedy decoding is not decided by float rounding.
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    common.update(_MOE_DEFAULTS.get(arch, {}))
    common.update(overrides)
    if arch in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")


def make_tiny_model(path: str | Path, arch: str = "qwen2", seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random-init HF causal LM (`arch` in qwen2|qwen3|llama|qwen3_moe|qwen2_moe) plus tokenizer
    to `path`.

    `config_overrides` go into the transformers config (hidden_size, num_hidden_layers, ...; for the
    mixtures of experts also num_experts, num_experts_per_tok, moe_intermediate_size,
    norm_topk_prob, decoder_sparse_step, mlp_only_layers, shared_expert_intermediate_size).
    The checkpoint is what transformers' `save_pretrained` writes (MoE experts under per-expert names).
    The same `seed` always gives the same weights and tokenizer. Returns the directory.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(seed=seed)
    vocab_size = config_overrides.pop("vocab_size", None) or max(len(tokenizer), 64)
    config = _config(arch, vocab_size, tokenizer, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
