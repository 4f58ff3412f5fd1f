"""MegatronPolicyWorker: a megatron-core GPTModel with tensor parallelism, seen from outside in HF terms.

Every rank of the default process group runs one worker; megatron's `parallel_state` groups them
into tensor-parallel groups of `tensor_parallel_size`, the rest is data parallelism. The model is
built from a Hugging Face directory (`MegatronLayout` checks that it fits), the checkpoint is loaded
into the TP shards, and for a weight sync the shards are gathered and unfused back into the exact HF
names and layouts (`convert`), so an engine cannot tell this worker from FSDP. Training,
the loss and the sync are the base class's; this file adds the TP-aware parts: log-probabilities
through megatron's vocab-parallel cross-entropy, and the gradient reduction and clipping norm over
sharded and replicated parameters.

With `trainer.bf16`, precision is megatron's own (SkyRL's megatron worker): the GPTModel's parameters
and compute are bfloat16 (`TransformerConfig(bf16=True)`: softmax in float32), while each trained
parameter has a float32 main copy that its gradients accumulate into (`grad_reduce_in_fp32`), that
AdamW steps and that checkpoints and weight syncs read; after each step the bfloat16 parameters are
the main copies rounded.

With `trainer.policy.model.lora.rank` > 0 the base is frozen and each target layer gets an adapter
(`lora_layers`: SkyRL's `lora_type: lora`); syncs, checkpoints and exports read the merged weights
(`megatron_config.lora_config.merge_lora`, SkyRL's default) or, with merge_lora=false, the adapter in
Hugging Face form, which the native engines merge themselves; a checkpoint's `adapter/` is peft's
format either way.

Without CUDA, megatron-core runs behind `cpu_shim` (applied here, nowhere else). The
batch must be right-padded: megatron's rotary embedding numbers positions from 0 in every row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig

from inflight.config import Config, ConfigError, Violation
from inflight.megatron import cpu_shim
from inflight.megatron.convert import (
    ConversionError,
    MegatronLayout,
    hf_lookup,
    hf_to_megatron_shard,
    is_tensor_parallel,
    megatron_param_names,
    megatron_shards_to_hf,
)
from inflight.megatron.lora_layers import LoraAdapter, add_adapters, hf_adapter, megatron_adapter
from inflight.train.batch import TrainBatch
from inflight.train.lora import lora_enabled
from inflight.train.losses import LossFn
from inflight.train.workers.base import PolicyWorker
from inflight.train.workers.local import use_bf16

_PEFT_PREFIX = "base_model.model."  # peft's prefix of a saved adapter's tensor names


@contextmanager
def _safetensors_reader(model_dir: str | Path) -> Iterator[Callable[[str], torch.Tensor]]:
    """`get(name)`: one HF tensor of a directory's safetensors files, read lazily (files open meanwhile)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{str(model_dir)!r} has no *.safetensors weights")
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        where = {name: handle for handle in handles for name in handle.keys()}

        def get(name: str) -> torch.Tensor:
            if name not in where:
                raise ConversionError(f"the checkpoint lacks {name!r}")
            return where[name].get_tensor(name)

        yield get


class MegatronPolicyWorker(PolicyWorker):
    """One megatron-core rank. Same constructor as `LocalPolicyWorker`, plus `tensor_parallel_size`
    (default: `trainer.policy.megatron_config.tensor_model_parallel_size`).

    torch.distributed must be initialised by the caller (gloo on CPU, nccl on CUDA); `rank` and
    `world_size` default to its. Every rank of a TP group must get the same batch.
    """

    def __init__(self, cfg: Config, model_path: str | Path | None = None, rank: int = 0, world_size: int = 1,
                 loss_fn: LossFn | None = None, device: str | torch.device = "cpu",
                 tensor_parallel_size: int | None = None, role: str = "policy") -> None:
        super().__init__(cfg, rank, world_size, loss_fn, device, model_path, role)
        self.bf16 = use_bf16(cfg, self.device)
        self.main_params: dict[str, torch.nn.Parameter] = {}
        """bf16: the float32 main copy of each trained parameter, by megatron name (else empty)."""
        self.lora = lora_enabled(cfg) and role == "policy"
        self.adapters: dict[str, LoraAdapter] = {}
        """LoRA: each adapted layer's adapter, by the layer's megatron name."""
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.megatron = self.section.megatron_config
        recompute = self.megatron.transformer_config_kwargs.get("recompute_granularity")
        if recompute is not None and self.device.type != "cuda":
            key = f"trainer.{role}.megatron_config.transformer_config_kwargs"
            raise ConfigError(
                [
                    Violation(
                        key,
                        self.megatron.transformer_config_kwargs,
                        f"asks for megatron's activation recompute (recompute_granularity={recompute!r}, "
                        "SkyRL's default), which megatron-core runs on CUDA only",
                        f"on CPU set {key}={{}} (or leave out its recompute_* entries)",
                    )
                ]
            )
        self.tp = tensor_parallel_size or self.megatron.tensor_model_parallel_size
        self.hf_config = AutoConfig.from_pretrained(self.model_path, **self.megatron.model_config_kwargs)
        self.layout = MegatronLayout.from_hf_config(self.hf_config, self.tp)

    # ---- building -----------------------------------------------------------------------------
    def build_model(self) -> None:
        """Initialise megatron's parallel state, build the GPTModel and load the HF checkpoint."""
        if not dist.is_initialized():
            raise RuntimeError(
                "MegatronPolicyWorker needs torch.distributed initialised (init_process_group)"
            )
        if self.world_size % self.tp:
            raise ConversionError(
                f"world size {self.world_size} is not divisible by tensor_parallel_size={self.tp}: "
                "set trainer.policy.megatron_config.tensor_model_parallel_size to a divisor of "
                "the number of ranks, or launch a multiple of it"
            )
        cpu_shim.apply()
        from megatron.core import parallel_state, tensor_parallel

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # megatron allocates on torch.cuda.current_device()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        elif parallel_state.get_tensor_model_parallel_world_size() != self.tp:
            raise RuntimeError("megatron's parallel state is already initialised with another TP size")
        tensor_parallel.model_parallel_cuda_manual_seed(self.cfg.trainer.seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.model = self._build_gpt_model().to(self.device)
        if self.bf16:  # every parameter, the norms' too, as megatron's Float16Module does
            self.model.bfloat16()
        if self.lora:
            self.adapters = add_adapters(self.model, self.cfg, self.tp, self.tp_rank)
        self._sharded = {n: self.tp > 1 and is_tensor_parallel(n) for n, _ in self.model.named_parameters()}
        """Whether each TP rank holds its own slice of a parameter (else all hold the same tensor)."""
        for layer, adapter in self.adapters.items():
            self._sharded[f"{layer}.lora.A"] = self.tp > 1 and not adapter.column
            self._sharded[f"{layer}.lora.B"] = self.tp > 1 and adapter.column
        self._names = megatron_param_names(self.layout)
        built = {name for name, _ in self.model.named_parameters() if ".lora." not in name}
        if built != set(self._names):
            names = set(self._names)
            raise ConversionError("the GPTModel's parameters differ from the conversion table: "
                                  f"extra {sorted(built - names)}, missing {sorted(names - built)}")
        if self.bf16:
            self._add_main_params()
        with _safetensors_reader(self.model_path) as get_hf:
            self._load_shards(get_hf)

    def _add_main_params(self) -> None:
        """A float32 main copy of every trained parameter, each bfloat16 gradient added into its
        main copy's gradient as soon as it is accumulated (megatron's fp32 `main_grad`)."""
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                main = torch.nn.Parameter(torch.empty(param.shape, dtype=torch.float32, device=param.device))
                self.main_params[name] = main
                param.register_post_accumulate_grad_hook(lambda p, main=main: _into_main_grad(p, main))

    def _build_gpt_model(self) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        lay = self.layout
        config = TransformerConfig(**{**dict(
            num_layers=lay.num_layers, hidden_size=lay.hidden_size, num_attention_heads=lay.num_heads,
            num_query_groups=lay.num_kv_heads, kv_channels=lay.head_dim, ffn_hidden_size=lay.ffn_hidden_size,
            normalization="RMSNorm", layernorm_epsilon=lay.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=lay.qkv_bias,
            qk_layernorm=lay.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=self.tp, bf16=self.bf16,
            params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
            use_cpu_initialization=self.device.type == "cpu",
            perform_initialization=False,  # every parameter is overwritten from the checkpoint
            # no fused kernels or CUDA-extension paths: the same numerics on every device
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        ), **self.megatron.transformer_config_kwargs})  # SkyRL's pass-through: recompute settings, ...
        spec = get_gpt_layer_local_spec(qk_layernorm=lay.qk_norm, normalization="RMSNorm")
        return GPTModel(config, spec, vocab_size=lay.padded_vocab_size,
                        max_sequence_length=lay.max_position_embeddings, pre_process=True, post_process=True,
                        parallel_output=True, share_embeddings_and_output_weights=lay.tie_word_embeddings,
                        position_embedding_type="rope", rotary_base=lay.rope_theta)

    def _load_shards(self, get_hf: Callable[[str], torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in self._names:
                shard = hf_to_megatron_shard(name, get_hf, self.layout, self.tp_rank)
                if tuple(shard.shape) != tuple(params[name].shape):
                    raise ConversionError(f"{name}: the converted shard has shape {tuple(shard.shape)}, "
                                          f"the model {tuple(params[name].shape)}")
                if name in self.main_params:
                    self.main_params[name].copy_(shard)
                params[name].copy_(shard)

    def load_hf_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite every parameter from full HF-named tensors (a checkpoint); all must be given."""
        self._load_shards(hf_lookup(dict(named_tensors)))

    def load_hf_state(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`load_hf_tensors` (every rank of the tensor-parallel group takes its own slices)."""
        self.load_hf_tensors(named_tensors)

    # ---- forward ------------------------------------------------------------------------------
    def _vocab_parallel_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's slice [B, T, V_padded / tp] of the logits; padded vocabulary entries are -inf."""
        input_ids = input_ids.to(self.device)
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=self.device).expand_as(input_ids)
        # True = hidden
        masked = torch.ones(seq, seq, dtype=torch.bool, device=self.device).triu(1)[None, None]
        if attention_mask is not None:  # padding keys are hidden too, as transformers does
            masked = masked | ~attention_mask.to(self.device, torch.bool)[:, None, None, :]
        logits = self.model(input_ids, positions, attention_mask=masked)
        lay = self.layout
        if lay.padded_vocab_size == lay.vocab_size:
            return logits
        per_rank = lay.padded_vocab_size // self.tp
        vocab_ids = torch.arange(per_rank, device=logits.device) + self.tp_rank * per_rank
        return logits.masked_fill(vocab_ids >= lay.vocab_size, float("-inf"))

    def compute_logprobs(
        self, batch: TrainBatch, entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[B, T] temperature-scaled token log-probabilities (position 0 is 0), computed with the
        vocabulary split across the TP ranks (megatron's vocab-parallel cross-entropy); with
        `entropy`, also the token entropy, reduced over the TP ranks the same way."""
        from megatron.core import tensor_parallel

        logits = (
            self._vocab_parallel_logits(batch.input_ids, batch.attention_mask)[:, :-1].float()
            / self.temperature
        )
        targets = batch.input_ids[:, 1:].to(self.device)
        # before the cross-entropy, which works on its input in place (a one-row batch's transpose is
        # no copy)
        token_entropy = F.pad(self._vocab_parallel_entropy(logits), (1, 0)) if entropy else None
        nll = tensor_parallel.vocab_parallel_cross_entropy(
            logits.transpose(0, 1).contiguous(), targets.transpose(0, 1).contiguous()
        )
        logprobs = F.pad(-nll.transpose(0, 1), (1, 0))
        return (logprobs, token_entropy) if entropy else logprobs

    def _vocab_parallel_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, T] entropy of the distributions whose vocabulary slices [B, T, V / tp] this TP group
        holds: H = log S - sum(e * z) / S with z the logits less their maximum and e = exp(z), both
        sums over the whole vocabulary (summed over the TP ranks, gradients flowing to each slice)."""
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        with torch.no_grad():
            peak = logits.max(dim=-1, keepdim=True).values
            if self.tp > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.tp_group)
        shifted = logits - peak
        weights = shifted.exp()  # padded vocabulary entries (-inf) weigh 0
        total = reduce_from_tensor_model_parallel_region(weights.sum(-1))
        spread = reduce_from_tensor_model_parallel_region(
            (weights * shifted.masked_fill(weights == 0, 0.0)).sum(-1)
        )
        return total.log() - spread / total

    @torch.no_grad()
    def forward_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Full-vocabulary float32 logits [B, T, vocab_size], gathered over TP, in eval mode (collective)."""
        from megatron.core import tensor_parallel

        self.model.eval()
        local = self._vocab_parallel_logits(input_ids, attention_mask)
        full = tensor_parallel.gather_from_tensor_model_parallel_region(local)
        return full[..., : self.layout.vocab_size].float()

    # ---- optimizer step -------------------------------------------------------------------------
    def optimizer_parameters(self) -> list[torch.nn.Parameter]:
        """The float32 main copies under bf16, else the trained parameters themselves."""
        return list(self.main_params.values()) or super().optimizer_parameters()

    def _grad_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(megatron name, parameter holding the gradient the optimizer steps with)."""
        return iter(self.main_params.items()) if self.main_params else self.model.named_parameters()

    def optimizer_step(self) -> dict[str, float]:
        """The base class's step on the optimizer's parameters; under bf16 the model's parameters
        then take the main copies' new values (rounded to bfloat16)."""
        metrics = super().optimizer_step()
        if self.main_params:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, main in self.main_params.items():
                    params[name].copy_(main)
        return metrics

    def _reduce_grads(self) -> None:
        """Complete the TP-replicated parameters' gradients, then average data-parallel replicas.

        q/k layernorms (qk-norm) are replicated but each TP rank applies them to its own heads only,
        so their full gradient is the sum over TP ranks (as megatron's `finalize_model_grads` does).
        The other replicated parameters (the hidden-size norms, without sequence parallelism) already
        get the full gradient on every rank; averaging keeps them bit-identical across ranks.
        """
        dp = dist.get_world_size(self.dp_group)
        for name, param in self._grad_params():
            if param.grad is None:
                continue
            if self.tp > 1 and not self._sharded[name]:
                dist.all_reduce(param.grad, group=self.tp_group)
                if not name.endswith(
                    ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
                ):
                    param.grad.div_(self.tp)
            if dp > 1:
                dist.all_reduce(param.grad, group=self.dp_group)
                param.grad.div_(dp)

    def clip_gradients(self, max_norm: float) -> float:
        """Complete the gradients across ranks (`_reduce_grads`), then scale them so the full
        (unsharded) model's norm is at most `max_norm`; returns the norm before clipping (TP-split
        gradients summed over the TP group, replicated ones once)."""
        self._reduce_grads()
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, param in self._grad_params():
            if param.grad is not None and (self._sharded[name] or self.tp_rank == 0):
                squares += param.grad.float().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(squares, group=self.tp_group)
        norm = squares.sqrt().item()
        if max_norm and norm > max_norm:
            scale = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            for _, param in self._grad_params():
                if param.grad is not None:
                    param.grad.mul_(scale)
        return norm

    # ---- weights out ----------------------------------------------------------------------------
    @torch.no_grad()
    def iter_full_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full HF-named tensor, gathered from the TP shards (a collective; every rank gets all).

        Names and layouts are exactly the HF checkpoint's (q/k/v and gate/up unfused, vocabulary
        padding dropped, no `lm_head.weight` when tied), as the FSDP worker produces them; under
        bf16 the float32 main copies (as FSDP's float32 shards).
        """
        params = {**dict(self.model.named_parameters()), **self.main_params}
        for name in self._names:
            local = params[name].detach()
            adapter = self.adapters.get(name.removesuffix(".weight"))
            if adapter is not None:
                local = local + adapter.delta_weight().to(local.dtype)
            local = local.contiguous()
            if self.tp > 1 and is_tensor_parallel(name):
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                dist.all_gather(shards, local, group=self.tp_group)
            else:
                shards = [local]
            yield from megatron_shards_to_hf(name, shards, self.layout)

    def iter_sync_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged weights, or (LoRA with `merge_lora=false`) the adapter as the engines take it:
        `<hf module>.lora_A.weight` and `.lora_B.weight` times alpha / rank (a collective)."""
        if not self.lora or self.megatron.lora_config.merge_lora:
            return self.iter_full_hf_tensors()
        scaling = self.cfg.trainer.policy.model.lora.alpha / self.cfg.trainer.policy.model.lora.rank
        return ((n, t * scaling if n.endswith(".lora_B.weight") else t) for n, t in self.hf_adapter_tensors())

    @torch.no_grad()
    def hf_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter under Hugging Face module names, gathered over TP (a collective): a fused
        layer's modules (q/k/v, gate/up) each with the shared A and their rows of B."""
        for layer, adapter in self.adapters.items():
            a, b = [adapter.A.detach().contiguous()], [adapter.B.detach().contiguous()]
            split = b if adapter.column else a
            if self.tp > 1:
                gathered = [torch.empty_like(split[0]) for _ in range(self.tp)]
                dist.all_gather(gathered, split[0], group=self.tp_group)
                split[:] = gathered
            yield from hf_adapter(layer, a, b, self.layout)

    def save_adapter(self, out: Path) -> None:
        """The adapter in peft's format (`PeftModel.from_pretrained` on the transformers model loads
        it). A collective; rank 0 writes."""
        import peft
        from safetensors.torch import save_file

        # own memory each
        tensors = {_PEFT_PREFIX + n: t.to("cpu", copy=True) for n, t in self.hf_adapter_tensors()}
        if self.rank != 0:
            return
        lora = self.cfg.trainer.policy.model.lora
        modules = sorted({n.split(".")[-3] for n in tensors})  # q_proj of ....q_proj.lora_A.weight
        config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                 target_modules=modules, base_model_name_or_path=str(self.model_path))
        out.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(out))
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})

    @torch.no_grad()
    def load_adapter(self, adapter_dir: Path) -> None:
        """Put an adapter `save_adapter` wrote (a checkpoint's `adapter/`) into this rank's adapters;
        ValueError when its rank, alpha or modules are not the run's."""
        import json

        from safetensors.torch import load_file

        saved = json.loads((adapter_dir / "adapter_config.json").read_text())
        lora = self.cfg.trainer.policy.model.lora
        if (saved.get("r"), saved.get("lora_alpha")) != (lora.rank, lora.alpha):
            raise ValueError(
                f"the checkpoint's adapter ({adapter_dir}) has r={saved.get('r')}, lora_alpha="
                f"{saved.get('lora_alpha')}, but the run asks for trainer.policy.model.lora.rank="
                f"{lora.rank}, alpha={lora.alpha}: resume with the run's LoRA settings"
            )
        saved_tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
        hf = {n.removeprefix(_PEFT_PREFIX): t for n, t in saved_tensors.items()}
        for layer, adapter in self.adapters.items():
            try:
                a, b = megatron_adapter(layer, hf, self.layout, self.tp_rank)
            except (KeyError, ConversionError) as err:
                raise ValueError(
                    f"the checkpoint's adapter ({adapter_dir}) does not adapt {layer} as this policy "
                    f"does (trainer.policy.model.lora.target_modules): {err}"
                ) from err
            adapter.A.copy_(a)
            adapter.B.copy_(b)

    def shutdown(self) -> None:
        """Drop the model and megatron's parallel state (the default process group is the caller's)."""
        from megatron.core import parallel_state

        self.model = self.optimizer = None
        self.main_params, self.adapters = {}, {}
        parallel_state.destroy_model_parallel()


def _into_main_grad(param: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
    """Add `param`'s freshly accumulated (bfloat16) gradient into `main`'s float32 one and free it."""
    grad = param.grad.float()
    main.grad = grad if main.grad is None else main.grad.add_(grad)
    param.grad = None
