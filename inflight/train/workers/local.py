"""LocalPolicyWorker: a transformers causal LM in one process, unsharded.

For single-process runs, tests and small demos, and the reference the sharded backends are checked
against: the same training step and the same HF names, with no collective anywhere.

Precision (`bf16`): the parameters, their gradients and AdamW's state stay float32 (the master
copy); the forward and backward run under `torch.autocast` in bfloat16, so the activations (the
bulk of a step's memory at long sequences and large vocabularies) are half the size. A LoRA
policy's frozen base is held in bfloat16 (no master copy needed), its adapters in float32.
Log-probabilities are taken in float32, `trainer.logprobs_chunk_size` tokens at a time
(`inflight.train.chunked_logprobs`). `gradient_checkpointing`: each decoder layer's activations
are recomputed in the backward instead of kept (transformers' non-reentrant checkpointing).
A mixture-of-experts model's routers are hooked (`inflight.train.moe_replay`): routing replay
(`megatron_config.moe_enable_routing_replay`), the routing counts, `freeze_moe_router`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from inflight.chat.vision import auto_model_class
from inflight.config import Config
from inflight.engine.cpu import cpu_flags
from inflight.train import shared_prefix, vision
from inflight.train.batch import TrainBatch
from inflight.train.chunked_logprobs import chunked_token_logprobs, state_logprobs
from inflight.train.lora import (
    adapter_tensors,
    apply_lora,
    load_adapter,
    lora_enabled,
    merged_tensors,
    save_adapter,
)
from inflight.train.losses import LossFn, token_entropy, token_logprobs
from inflight.train.moe_replay import RoutingReplay, attach_routing
from inflight.train.workers.base import PolicyWorker

NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags (as /proc/cpuinfo spells them) under which oneDNN multiplies bfloat16 natively; without
them it converts to float32 around each matmul, slower than float32 alone."""


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes bfloat16 matmuls natively, and what says so."""
    if device.type == "cuda":
        return True, "the device is CUDA"
    if device.type != "cpu":
        return False, f"bfloat16 is not chosen automatically on {device.type}"
    have = [flag for flag in NATIVE_BF16_CPU_FLAGS if flag in cpu_flags()]
    if have:
        return True, f"the CPU has {', '.join(have)}"
    return (
        False,
        "the CPU has neither AMX nor AVX-512-BF16, so bfloat16 matmuls would run slower than float32",
    )


def use_bf16(cfg: Config, device: torch.device) -> bool:
    """`trainer.bf16`, with null meaning: where the device computes bfloat16 natively (`native_bf16`)."""
    return native_bf16(device)[0] if cfg.trainer.bf16 is None else cfg.trainer.bf16


def describe_precision(cfg: Config, device: torch.device) -> str:
    """One line for the run's start: the training precision `trainer.bf16` gives on `device`, and why
    (null: the automatic choice; true on a CPU without native bfloat16: a warning with the fix)."""
    bf16, reason = use_bf16(cfg, device), native_bf16(device)[1]
    what = "bfloat16 autocast over float32 master weights" if bf16 else "float32"
    if cfg.trainer.bf16 is None:
        return f"training precision: {what} (trainer.bf16=null: {reason})"
    if bf16 and not native_bf16(device)[0] and device.type == "cpu":
        return (f"training precision: {what} (trainer.bf16=true), but {reason}: "
                "set trainer.bf16=false or null (chosen per device)")
    return f"training precision: {what} (trainer.bf16={str(bf16).lower()})"


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""`fsdp_config.mixed_precision` dtype names."""


def attention_implementation(cfg: Config, device: torch.device) -> str:
    """The training forward's attention (`trainer.flash_attn`): flash-attention 2 on CUDA where the
    `flash_attn` package is installed, else PyTorch's SDPA."""
    if cfg.trainer.flash_attn and device.type == "cuda":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return "sdpa"


class LocalPolicyWorker(PolicyWorker):
    """`AutoModelForCausalLM` from a local directory (`trainer.policy.model.path` or `model_path`)."""

    def __init__(self, cfg: Config, model_path: str | None = None, rank: int = 0, world_size: int = 1,
                 loss_fn: LossFn | None = None, device: str | torch.device = "cpu", bf16: bool | None = None,
                 gradient_checkpointing: bool | None = None, role: str = "policy") -> None:
        """`bf16` and `gradient_checkpointing` default to `trainer.bf16` (null: `native_bf16`) and
        `trainer.gradient_checkpointing`; `role` (`policy`, `ref`, `critic`) picks the model's
        section (`trainer.<role>`: model_config_kwargs, fsdp_config, LoRA)."""
        super().__init__(cfg, rank, world_size, loss_fn, device, model_path, role)
        self.lora = lora_enabled(cfg) and role == "policy"  # only the policy takes adapters
        self.bf16 = use_bf16(cfg, self.device) if bf16 is None else bf16
        default = cfg.trainer.gradient_checkpointing
        self.gradient_checkpointing = default if gradient_checkpointing is None else gradient_checkpointing
        self.routing: RoutingReplay | None = None  # a mixture of experts' router hooks (load_hf_model)

    def load_hf_model(self) -> torch.nn.Module:
        """The transformers model of `model_path`, its config overridden by `model_config_kwargs`,
        with the attention `trainer.flash_attn` picks and the activation checkpointing
        `trainer.gradient_checkpointing(_use_reentrant)` asks for."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.model_path), **self.section.model_config_kwargs)
        model = auto_model_class(config).from_pretrained(
            str(self.model_path), config=config, dtype=self.load_dtype(),
            attn_implementation=attention_implementation(self.cfg, self.device))
        if vision.freezes_tower(self.cfg, self.role):
            vision.freeze_tower(model)
        if self.gradient_checkpointing:
            model.config.use_cache = False
            reentrant = self.cfg.trainer.gradient_checkpointing_use_reentrant
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": reentrant}
            )
        self.routing = attach_routing(model, self.cfg, self.role)
        return model.to(self.device)

    def compute_dtype(self) -> torch.dtype:
        """The dtype of the forward under `bf16`: `fsdp_config.mixed_precision.param_dtype`."""
        return PRECISIONS[self.section.fsdp_config.mixed_precision.param_dtype]

    def load_dtype(self) -> torch.dtype:
        """The dtype the weights are loaded in: a LoRA policy's frozen base in bfloat16 under
        `bf16` (it gets no gradient and no optimizer state, so it needs no float32 master; the
        adapters `peft` adds stay float32), otherwise float32 (the master weights)."""
        return self.compute_dtype() if self.bf16 and self.lora else torch.float32

    def build_model(self) -> None:
        model = self.load_hf_model()
        self.model = apply_lora(model, self.cfg) if self.lora else model

    def autocast(self) -> AbstractContextManager:
        """The forward's precision context: bfloat16 autocast when `bf16`, else nothing."""
        if not self.bf16 or self.compute_dtype() == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype())

    def compute_logprobs(
        self, batch: TrainBatch, entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The log-probabilities (with `entropy`, and the token entropy) `trainer.logprobs_chunk_size`
        tokens at a time (the full logits never exist), or from the model's full logits (null, or a
        model whose forward changes its logits after the LM head)."""
        if self.routing is not None:
            self.routing.prepare(batch)  # the rollout's experts, with routing replay
        chunk = self.logprobs_chunk_size()
        lm = self.causal_lm()
        packed = self.packed(batch, lm)
        self.forward_tokens = (batch if packed is None else packed).input_ids.numel()
        if packed is not None:
            return self._packed_logprobs(packed, lm, chunk, entropy)
        inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      **vision.image_inputs(lm, batch.input_ids, batch.images()))
        if chunk is None or _post_processes_logits(lm):
            with self.autocast():
                logits = self.model(**inputs).logits
            logprobs = token_logprobs(logits, batch.input_ids, self.temperature)
            return (logprobs, token_entropy(logits, self.temperature)) if entropy else logprobs
        with self.autocast():
            hidden = vision.hidden_trunk(lm)(**inputs)
            return chunked_token_logprobs(
                hidden.last_hidden_state,
                lm.get_output_embeddings(),
                batch.input_ids,
                self.temperature,
                chunk,
                entropy=entropy,
            )

    def packed(self, batch: TrainBatch, lm: torch.nn.Module) -> shared_prefix.PackedRows | None:
        """`batch` packed by shared context (`trainer.shared_prefix_forward`), or None: not asked
        for, a model it does not apply to (routing hooks, logits changed after the LM head, no SDPA
        or not every layer full attention), rows with images, or packing would not pay."""
        if (
            not self.cfg.trainer.shared_prefix_forward
            or self.routing is not None
            or _post_processes_logits(lm)
        ):
            return None
        if vision.is_vision_language(lm.config):
            vision.tell_once(
                "shared-prefix forward off for this vision-language policy: its rows run as they are "
                "(the packed row would need each group's images encoded once and M-RoPE positions "
                "for the tree of rows, which it does not compute)"
            )
            return None
        if not shared_prefix.supports(lm):
            return None
        return shared_prefix.pack(
            batch.input_ids, batch.loss_mask, batch.widths(), shared_prefix.pair_cost_of(lm.config)
        )

    def _packed_logprobs(self, packed: shared_prefix.PackedRows, lm: torch.nn.Module, chunk: int | None,
                         entropy: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        inputs = dict(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                      position_ids=packed.position_ids)
        with self.autocast():
            if chunk is None:  # the whole model's forward (under FSDP its root unit holds the LM head)
                logits = self.model(**inputs).logits
                states, head = logits.reshape(-1, logits.shape[-1])[packed.states], torch.nn.Identity()
            else:
                hidden = lm.get_decoder()(**inputs).last_hidden_state
                states, head = hidden.reshape(-1, hidden.shape[-1])[packed.states], lm.get_output_embeddings()
            out = state_logprobs(states, packed.targets, head, self.temperature, chunk, entropy=entropy)
        if entropy:
            return packed.unpack(out[0]), packed.unpack(out[1])
        return packed.unpack(out)

    def logprobs_chunk_size(self) -> int | None:
        """Tokens per log-probability chunk (`trainer.logprobs_chunk_size`), None: the full logits."""
        return self.cfg.trainer.logprobs_chunk_size

    def causal_lm(self) -> torch.nn.Module:
        """The transformers causal LM (inside a `peft` model: the base model its adapters are in)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def iter_full_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora:
            yield from merged_tensors(self.model)
            return
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def full_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF-named state on the CPU; a LoRA policy's merged weights are new tensors
        already, so only those that are the model's own parameters are copied."""
        if not self.lora:
            return super().full_hf_state_dict()
        own = {p.data_ptr() for p in self.model.parameters()}
        return {name: t.to("cpu", copy=t.data_ptr() in own) for name, t in merged_tensors(self.model)}

    def iter_sync_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return adapter_tensors(self.model) if self.lora else self.iter_full_hf_tensors()

    def save_adapter(self, out: Path) -> None:
        """A LoRA policy's adapter in peft's format (`inflight.train.lora.save_adapter`); rank 0 writes."""
        if self.rank == 0:
            save_adapter(self.model, out)

    def load_adapter(self, adapter_dir: Path) -> None:
        """Put the adapter `save_adapter` wrote (a checkpoint's `adapter/`) into the peft model."""
        load_adapter(self.model, adapter_dir, self.cfg)


def _post_processes_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward changes the LM head's output (Gemma 2's soft-capping, Cohere's
    logit scale): then the chunks, which apply the LM head alone, would not match it."""
    config = getattr(model, "config", None)
    return any(
        getattr(config, key, None) not in (None, 1, 1.0) for key in ("final_logit_softcapping", "logit_scale")
    )
