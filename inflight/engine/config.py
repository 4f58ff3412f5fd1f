"""EngineConfig: what the engine loads and how much memory and batching it may use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.engine.errors import InvalidRequestError
from inflight.engine.models.linear import LINEAR_BACKENDS

NATIVE_BACKENDS = ("auto", "native", "torch")  # choices of attention_backend and elementwise_backend
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Engine settings. `num_kv_blocks=None` derives the block count from `kv_cache_memory_gib`."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    weight_version: int = 0
    # Keep the pre-update weights until an update finishes, so a failed one can be rolled back
    # (abort_weight_update). Costs up to one extra copy of the weights during an update.
    weight_update_rollback: bool = True
    # A weight update that receives nothing (begin, a chunk) for this long is abandoned as if
    # abort_weight_update() were called: a sender that died between begin and finish must not
    # freeze generation. None: no lease.
    weight_update_timeout_s: float | None = 300.0
    # Decode attention: "native" (the C kernel over paged KV, CPU), "torch" (gather + SDPA, any
    # device) or "auto" (native where it is supported and builds, else torch).
    attention_backend: str = "auto"
    # Linear layers: "onednn" (weights prepacked once for oneDNN in their dtype, CPU), "onednn_fp32"
    # (bfloat16 weights packed and computed in float32: CPUs where oneDNN refuses bfloat16),
    # "torch" (F.linear) or "auto" (onednn where oneDNN runs the dtype, else onednn_fp32 for
    # bfloat16, else torch).
    linear_backend: str = "auto"
    # RMSNorm, residual add, rotary and silu*mul: "native" (fused C kernels, CPU float32/bfloat16),
    # "torch" (PyTorch ops) or "auto" (native where supported and the kernels build, else torch).
    elementwise_backend: str = "auto"

    def validate(self) -> None:
        """Raise InvalidRequestError listing every invalid setting."""
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        for key in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, key) < 1:
                problems.append(f"{key}={getattr(self, key)!r} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            problems.append(f"num_kv_blocks={self.num_kv_blocks!r} must be >= 1 (or None to derive it)")
        if self.attention_backend not in NATIVE_BACKENDS:
            problems.append(
                f"attention_backend={self.attention_backend!r} must be one of {list(NATIVE_BACKENDS)}"
            )
        if self.elementwise_backend not in NATIVE_BACKENDS:
            problems.append(
                f"elementwise_backend={self.elementwise_backend!r} must be one of {list(NATIVE_BACKENDS)}"
            )
        if self.linear_backend not in LINEAR_BACKENDS:
            problems.append(f"linear_backend={self.linear_backend!r} must be one of {list(LINEAR_BACKENDS)}")
        if self.kv_cache_memory_gib <= 0:
            problems.append(f"kv_cache_memory_gib={self.kv_cache_memory_gib!r} must be > 0")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            problems.append(f"device={self.device!r} is not a torch device (e.g. 'cpu', 'cuda:0')")
        if problems:
            raise InvalidRequestError("invalid engine config: " + "; ".join(problems))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
