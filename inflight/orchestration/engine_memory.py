"""How much KV cache an engine gets when `generator.inference_engine.gpu_memory_utilization` sizes it.

vLLM's meaning: an engine may use that share of its device's memory for its weights and KV cache.
On CUDA the share is of the device's total memory; on CPU it is of the memory available when the
engines start (`MemAvailable`), split evenly between the engines started on this host. The KV
cache gets what the weights leave; the engine itself never allocates more blocks than
`max_num_seqs` requests of `max_model_len` tokens can use. `kv_cache_memory_gib` or
`num_kv_blocks`, when set, decide instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from inflight.config import InferenceEngineConfig

MIN_KV_GIB = 1 / 1024
"""The least KV memory an engine is given (1 MiB): an engine with too little for even one request
says so when a request arrives, naming max_model_len and the memory keys."""
_ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def available_bytes(device: str) -> int:
    """The memory the share is taken of: CUDA's total on `device`, else the host's MemAvailable."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def weight_bytes(model_dir: str | Path, dtype: str) -> int:
    """Bytes of the model's weights in the engine's `dtype` (from its safetensors headers)."""
    return (parameter_count(model_dir) or 0) * _ELEMENT_SIZE.get(dtype, 4)


def parameter_count(model_dir: str | Path | None) -> int | None:
    """The parameters in a Hugging Face directory's safetensors files (their headers only; a tied LM
    head counts once), or None where there are none to read."""
    if model_dir is None or not (files := sorted(Path(model_dir).glob("*.safetensors"))):
        return None
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                total += math.prod(f.get_slice(name).get_shape())
    return total


def usable_kv_bytes(ie: InferenceEngineConfig, model_dir: str | Path) -> int:
    """The most KV memory an engine can ever use: `max_num_seqs` requests of `max_model_len` tokens
    (the model's context when null), from the model's layers, KV heads and head size."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(model_dir)).get_text_config()  # a VLM's: its language model's
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    tokens = ie.max_model_len or hf.max_position_embeddings
    per_token = 2 * hf.num_hidden_layers * kv_heads * head_dim * _ELEMENT_SIZE.get(ie.model_dtype, 4)
    return ie.max_num_seqs * tokens * per_token


def kv_cache_gib(ie: InferenceEngineConfig, model_dir: str | Path, engines_on_host: int) -> float:
    """The KV memory (GiB) of one engine of `ie` on `model_dir`: `kv_cache_memory_gib` when set, else
    `gpu_memory_utilization`'s share of the device (CPU: of the available memory over
    `engines_on_host` engines) less the weights, at most what the engine can use (`usable_kv_bytes`:
    on CPU, where a KV pool is allocated whole, a run does not take 80% of the host for a small model),
    at least `MIN_KV_GIB`."""
    if ie.kv_cache_memory_gib is not None:
        return float(ie.kv_cache_memory_gib)
    sharing = 1 if ie.device.startswith("cuda") else max(1, engines_on_host)
    budget = ie.gpu_memory_utilization * available_bytes(ie.device) / sharing - weight_bytes(
        model_dir, ie.model_dtype
    )
    return max(MIN_KV_GIB, min(budget, usable_kv_bytes(ie, model_dir)) / 2**30)
