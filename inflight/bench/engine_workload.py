"""What `inflight bench engine` measures: the model shape, the benchmark's settings and the workload
(seeded prompts and output lengths, with the useful FLOPs of serving them). Shared by the orchestrator
(`engine_bench`) and the sides it spawns (`engine_sides`, `vllm_side`)."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from inflight.bench.common import MODEL_SHAPES
from inflight.bench.engine_report import DEFAULT_MAX_OTHER_CPU

DEFAULT_HF_BATCH_SIZES = (32, 64)


@dataclass(frozen=True)
class ModelShape:
    """The benchmark model's transformers config overrides: a Qwen2 shape, or with `num_experts` a
    Qwen3-MoE one whose every MLP is `num_experts` experts of `moe_intermediate_size`,
    `num_experts_per_tok` per token. `from_model_dir` reads the shape of a model that exists."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 1024
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    attention_head_dim: int = 0  # the config's head_dim where it sets one; 0: hidden / heads

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShape:
        """The shape in `path`'s config (a Hugging Face causal LM directory; of a vision-language
        model, its language model's), read by transformers."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path).get_text_config()

        def get(key: str, default: int = 0) -> int:
            return getattr(config, key, None) or default

        return cls(
            hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
            intermediate_size=get("intermediate_size"), num_attention_heads=config.num_attention_heads,
            num_key_value_heads=get("num_key_value_heads", config.num_attention_heads),
            vocab_size=config.vocab_size, max_position_embeddings=get("max_position_embeddings"),
            num_experts=get("num_experts"), num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"), attention_head_dim=get("head_dim"),
        )  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def arch(self) -> str:
        """`make_tiny_model`'s architecture for this shape."""
        return "qwen3_moe" if self.num_experts else "qwen2"

    def config_overrides(self) -> dict[str, int]:
        """The transformers config fields of this shape (the expert fields only for an MoE)."""
        fields = asdict(self)
        head_dim = fields.pop("attention_head_dim")
        if head_dim:
            fields["head_dim"] = head_dim
        if not self.num_experts:
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                del fields[key]
        return fields

    def trunk_matmul_params(self) -> int:
        """Weights of the per-layer matmuls a token runs through, over all layers: q, k, v, o, and
        gate, up, down (an MoE: its router and its `num_experts_per_tok` experts' gate, up and down,
        the useful work; the other experts' weights are not)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        mlp = 3 * h * self.intermediate_size
        if self.num_experts:
            mlp = h * self.num_experts + self.num_experts_per_tok * 3 * h * self.moe_intermediate_size
        return self.num_hidden_layers * (2 * h * q + 2 * h * kv + mlp)


FULL_MODEL = ModelShape(**MODEL_SHAPES["50m"])  # hidden 512, 13 layers, MLP 1536, 8/4 heads, vocab 8192
SMALL_MODEL = ModelShape(128, 4, 512, 4, 2, 512)
_EXPERTS = dict(num_experts=8, num_experts_per_tok=2)
FULL_MOE = replace(FULL_MODEL, **_EXPERTS, moe_intermediate_size=384)
"""`--moe`: the full shape with 8 experts of 384 per layer, 2 per token (a tiny-active mixture: half
the dense MLP's work per token from 2x its weights)."""
SMALL_MOE = replace(SMALL_MODEL, **_EXPERTS, moe_intermediate_size=128)


@dataclass
class BenchConfig:
    """Everything `run_benchmark` needs; the CLI flags map onto these fields."""

    small: bool = False
    moe: bool = False  # a Qwen3-MoE of the same trunk (FULL_MOE / SMALL_MOE)
    requests: int = 64
    min_len: int = 16
    max_len: int = 256
    dtype: str = "float32"
    against: tuple[str, ...] = ("transformers",)  # any of PEERS; empty: the engine alone
    repeats: int = 3  # quiet timed passes wanted per side
    max_rounds: int = 0  # rounds of passes at most, until every side has `repeats` quiet ones; 0: 3 × repeats
    # a pass is quiet when other processes used at most this share of the CPUs meanwhile
    max_other_cpu: float = DEFAULT_MAX_OTHER_CPU
    hf_batch_sizes: tuple[int, ...] = DEFAULT_HF_BATCH_SIZES
    threads: int = 2
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int | None = None  # KV block size on every side; None: each one's own (16 / 128)
    model_dir: str | None = None
    images: bool = False  # one image per prompt on a vision-language model (bench.engine_images)
    vllm_problem: str | None = None  # why vLLM was left out of an --images run
    profile: bool = False  # one extra engine run under torch.profiler; the op table goes in the result
    vllm_python: str | None = None  # None: vllm_side.default_python()
    vllm_kv_cache_gib: int = 2
    # malloc of the engine's and transformers' processes: "auto" preloads tcmalloc where found (as on
    # vLLM's side), "tcmalloc" requires it, "system" keeps glibc's
    allocator: str = "auto"
    vllm_env: dict[str, str] = field(default_factory=dict)  # on top of vllm_side.vllm_env's settings
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM(...) arguments

    # the shape of the model that `model_dir` held when this config was made (None: a random model of
    # the built-in shape is benchmarked, built in `model_dir` or a temp dir)
    model_shape: ModelShape | None = None

    def __post_init__(self) -> None:
        if self.model_shape is None and self.model_dir and (Path(self.model_dir) / "config.json").is_file():
            self.model_shape = ModelShape.from_model_dir(self.model_dir)

    @property
    def shape(self) -> ModelShape:
        """The shape of the model in `model_dir`, or of the random one built for the benchmark."""
        if self.model_shape is not None:
            return self.model_shape
        if self.moe:
            return SMALL_MOE if self.small else FULL_MOE
        return SMALL_MODEL if self.small else FULL_MODEL

    @property
    def quiet_limit(self) -> float:
        """Cores that others may use during a quiet pass."""
        return self.max_other_cpu * (os.cpu_count() or 1)


@dataclass
class Workload:
    """The requests (prompt token ids, output lengths) and the useful FLOPs of serving them once."""

    prompts: list[list[int]]
    output_lens: list[int]
    flops: dict[str, float] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)  # one engine_images.BenchImage per prompt, or none

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(cfg: BenchConfig) -> Workload:
    """Seeded random prompts and output lengths, plus the useful FLOPs of serving them once."""
    rng = random.Random(cfg.seed)
    shape = cfg.shape
    prompts, output_lens = [], []
    for _ in range(cfg.requests):
        prompts.append(
            [rng.randrange(shape.vocab_size) for _ in range(rng.randint(cfg.min_len, cfg.max_len))]
        )
        output_lens.append(rng.randint(cfg.min_len, cfg.max_len))
    return Workload(prompts, output_lens, workload_flops(shape, prompts, output_lens))


def workload_flops(shape: ModelShape, prompts: list[list[int]], output_lens: list[int]) -> dict[str, float]:
    """The useful FLOPs of serving `prompts` with `output_lens` once through the language model of
    `shape` (a vision tower's are not counted)."""
    head = shape.hidden_size * shape.vocab_size
    # QK^T and AV: 2 matmuls × 2 FLOPs × heads × head_dim per attended position, per layer
    per_ctx = 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim
    tokens = [len(p) + o for p, o in zip(prompts, output_lens, strict=True)]
    flops = {
        "matmul": 2.0 * shape.trunk_matmul_params() * sum(tokens) + 2.0 * head * sum(output_lens),
        "attention": float(per_ctx * sum(n * (n + 1) // 2 for n in tokens)),
    }
    flops["total"] = flops["matmul"] + flops["attention"]
    return flops
