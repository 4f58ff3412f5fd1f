"""Rollout generation (SkyRL: `generator`): the inference engines, how weights reach them,
sampling, chat templates and episodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inflight.backends.registry import backend_names
from inflight.config.status import accepted, example, gpu_only, ours, refused, skyrl
from inflight.weight_sync.kinds import TransportSpec, transport_aliases, transport_names, transport_spec

WEIGHT_SYNC_BACKEND_ALIASES = transport_aliases()
"""SkyRL's names of the registered weight transports (`nccl`/`gloo`: broadcast, `cuda_ipc`: shm)."""
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def canonical_weight_sync_backend(name: str) -> str:
    """`nccl`/`gloo` -> `broadcast`, `cuda_ipc` -> `shm`; anything else unchanged."""
    return WEIGHT_SYNC_BACKEND_ALIASES.get(name, name) if isinstance(name, str) else name


def weight_transport(name: str) -> TransportSpec | None:
    """The registered weight transport `name` (or SkyRL's name for it) names, whose facts rules read;
    None for a value that names none (SkyRL's `delta`, refused; a typo, which the choices rule reports)."""
    try:
        return transport_spec(name)
    except ValueError:
        return None


_MINISWE = refused("SkyRL's mini-swe-agent generator (SWE tasks in Docker sandboxes) is not implemented",
                   runs=lambda v: v is None)
_CHILD_AGENTS = refused("child agents (SkyRL's recursive-LM example generator) are not implemented",
                        runs=lambda v: v is False)
_THUNDER = refused("SkyRL's thunder-agent engine mode is not implemented", runs=lambda v: v in (None, False))
_DELTA = accepted("read only with weight_sync_backend=delta, which is refused")


@dataclass
class DeltaWeightSyncConfig:
    """SkyRL's weight sync through files (local, NFS, S3, GCS): not implemented (`delta` is refused)."""

    sync_dir: str = skyrl("", status=_DELTA)
    local_checkpoint_dir: str | None = skyrl(None, status=_DELTA)
    publish_staging_dir: str | None = skyrl(None, status=_DELTA)
    max_file_size_in_gb: float = skyrl(1.0, status=_DELTA)
    cloud_download_workers: int = skyrl(4, status=_DELTA)
    publish_num_workers: int | None = skyrl(None, status=_DELTA)
    checkpoint_load_format: str = skyrl("vllm_multi_thread_safetensors", status=_DELTA)
    multi_thread_safetensors_max_workers: int = skyrl(8, status=_DELTA)


_NO_EFFECT_TP1 = accepted("read only with tensor_parallel_size > 1, which is refused")


@dataclass
class InferenceEngineConfig:
    """The inference engines and how weights reach them."""

    model_dtype: str = skyrl("bfloat16", choices=("float32", "bfloat16", "float16"), aliases=DTYPE_ALIASES)
    """Engine weights and KV: `bfloat16` (default), `float32` or `float16` (also `bf16`, `fp32`,
    `fp16`). On a CPU without native bfloat16 (no AVX-512), the native engine multiplies bfloat16
    weights in float32 (`linear_backend=auto`)."""
    run_engines_locally: bool = skyrl(True)
    """True (default): the run starts its engines (native: in process or as child processes;
    vllm: `inflight serve --backend vllm` servers on free 127.0.0.1 ports, logs in
    `<trainer.log_path>/servers/`). False: the run drives servers started elsewhere, listed in
    external_server_urls (control token: `$INFLIGHT_CONTROL_TOKEN`); the engine settings are then
    the servers' own flags, and the run pushes its weights to them before the first rollout."""
    num_engines: int = skyrl(1)
    """Number of engines, >= 1. Default 1."""
    backend: str = skyrl("vllm", choices=backend_names())  # the registry's: inflight/backends/registry.py
    """The inference engine: `vllm` (default: vLLM in its own virtual environment, behind `inflight
    serve --backend vllm`: the same HTTP routes, driven through `RemoteClient`) or `native` (this
    project's paged-KV engine, in this process or in child processes)."""
    weight_sync_backend: str = skyrl("nccl", choices=(*transport_names(), "delta"),
                                       aliases=WEIGHT_SYNC_BACKEND_ALIASES)
    """Weight transport: `nccl` / `gloo` (default nccl: a torch.distributed broadcast group from
    the trainer to every engine, `broadcast`), `shm` (one host; SkyRL's `cuda_ipc` means it) or
    `inprocess`. Into HTTP servers (backend=vllm, external_server_urls) the broadcast group forms
    with the servers as its members (gloo on CPU, nccl on CUDA), `shm` hands them chunk files in
    /dev/shm (servers on this host) and `inprocess` sends chunks in request bodies. `delta` (files
    in a bucket) is refused."""
    weight_transfer_threshold_cuda_ipc_GB: float = skyrl(1.0)
    """Most GiB of weights one chunk of an `shm` (`cuda_ipc`) sync holds, > 0. Default 1.0."""
    delta_weight_sync: DeltaWeightSyncConfig = field(default_factory=DeltaWeightSyncConfig)
    tensor_parallel_size: int = skyrl(1, status=refused(
        "> 1 is not implemented yet: an engine runs on one device", runs=lambda v: v == 1,
        fix="set generator.inference_engine.tensor_parallel_size=1 (generator.inference_engine.num_engines "
            "adds engines)"))
    """Tensor-parallel ranks per engine. Default 1, the only one implemented."""
    pipeline_parallel_size: int = skyrl(1, status=gpu_only("pipeline parallelism of an engine"))
    expert_parallel_size: int = skyrl(1, status=gpu_only("expert parallelism of an engine"))
    data_parallel_size: int = skyrl(1, status=refused(
        "data parallelism inside an engine is not implemented", runs=lambda v: v == 1,
        fix="set it to 1 and add engines with generator.inference_engine.num_engines"))
    vllm_v1_disable_multiproc: bool = skyrl(True)
    """backend=vllm: run vLLM's engine core in the server's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
    Default true. The native engine has no engine-core process of its own."""
    enable_prefix_caching: bool = skyrl(True)
    """Reuse KV of shared prompt prefixes (keys include the weight version). Default true."""
    enable_chunked_prefill: bool = skyrl(True)
    """Split long prefills across steps. Default true."""
    enable_return_routed_experts: bool = skyrl(False)
    """Every rollout asks the engines for the experts a mixture-of-experts model chose at each
    position, prompt included, and keeps them with its trajectory: what routing replay
    (`trainer.policy.megatron_config.moe_enable_routing_replay`, on every worker kind) replays, and
    needs. Without replay (SkyRL refuses the record alone; allowed here) it still adds each step's
    `moe/routing_mismatch` and `moe/router_disagreement` (the training forward's routing against
    the rollout's), every `trainer.moe_logprob_gap_interval` steps the log-probability gap with and
    without replay, and the record in `trainer.dump_data_batch`'s lines. Native engine only; not
    with `generator.agent.path`. Default false."""
    max_num_batched_tokens: int = skyrl(8192)
    """Tokens per engine step, >= 1. Default 8192."""
    enforce_eager: bool = skyrl(False)
    """backend=vllm: run without CUDA graphs (`--enforce-eager`). The native engine never captures
    graphs. Default false."""
    fully_sharded_loras: bool = skyrl(False, status=accepted(
        "adapters are merged into the engines' weights: there are no LoRA kernels to shard"))
    enable_ray_prometheus_stats: bool = skyrl(True, status=accepted(
        "every engine's counters are in the run's metrics and, for servers, at /metrics"))
    gpu_memory_utilization: float = skyrl(0.8)
    """Share of the device's memory an engine may use for its weights and KV cache, in (0, 1]
    (vLLM's meaning); on CPU, of the memory available when the engine starts, split between the
    engines of this host. The KV cache takes what the weights leave, at most what max_num_seqs
    requests of max_model_len tokens can use (also on vLLM, whose CPU KV space is given that size).
    kv_cache_memory_gib or num_kv_blocks, when set, decide instead. Default 0.8."""
    offload_kv_for_weight_sync: bool = skyrl(False)
    """Non-colocated only: sleep the engine during a sync, freeing its memory; the KV of
    in-flight requests is copied to host and restored (unless cleared). The sleep drops the
    engine's weights, so a LoRA policy's sync sends its merged weights, not the adapter. Default
    false."""
    use_expandable_segments: bool = skyrl(False)
    """CUDA's `expandable_segments` allocator in the engines' processes. Default false."""
    max_num_seqs: int = skyrl(1024)
    """Requests running at once per engine, >= 1. Default 1024."""
    served_model_name: str | None = skyrl(None)
    """The model name the engines' OpenAI routes answer to; null (default): the model path."""
    distributed_executor_backend: str = skyrl("ray", choices=("ray", "mp"), status=_NO_EFFECT_TP1)
    language_model_only: bool = skyrl(False, status=accepted(
        "every model this project loads is a language model: there is no vision encoder to skip"))
    engine_init_kwargs: dict[str, Any] = skyrl(factory=dict)
    """Engine arguments passed through by name: vLLM's engine arguments for backend=vllm; for the
    native engine, the entries that name one of this section's keys (`max_model_len`, ...) set that
    key, any other is refused. Default {}."""
    speculative_config: dict[str, Any] | None = skyrl(None, status=refused(
        "speculative decoding is not implemented", runs=lambda v: v is None))
    external_proxy_url: str | None = skyrl(
        None,
        status=refused(
            "a separate data-plane URL is not implemented yet: generation goes to external_server_urls "
            "(sessions stay on one server)",
            runs=lambda v: v is None,
            fix="list the servers in external_server_urls",
        ),
    )
    external_server_urls: list[str] | None = skyrl(None)
    """run_engines_locally=false only: the servers' base URLs (`http://host:port`), one per engine
    (num_engines must equal their number). None (default): none."""
    enable_pd: bool = skyrl(False, status=gpu_only("prefill/decode disaggregation"))
    num_prefill: int = skyrl(0, status=gpu_only("prefill/decode disaggregation"))
    thunder_agent_mode: str | None = example(None, status=_THUNDER)
    """SkyRL's thunder-agent example: its engine mode. Default null."""
    thunder_agent_profile_enabled: bool = example(False, status=_THUNDER)
    """SkyRL's thunder-agent example: profile the agent. Default false."""
    thunder_agent_metrics_enabled: bool = example(False, status=_THUNDER)
    """SkyRL's thunder-agent example: its metrics. Default false."""
    router_init_kwargs: dict[str, Any] = skyrl(factory=dict, status=refused(
        "there is no vllm-router: the client routes requests itself (an episode's turns stay on one engine)",
        runs=lambda v: not v, fix="leave it empty"))
    # ---- the native engine and the transports (not SkyRL keys) ----
    vllm_python: str | None = ours(None)
    """backend=vllm only: the python of vLLM's virtual environment. None (default): `$INFLIGHT_VLLM_PYTHON`,
    else the repository's `.venv-vllm/bin/python` (`scripts/vllm_venv.sh` creates it)."""
    weight_sync_host: str = ours("127.0.0.1")
    """Address the trainer's `shm` / `broadcast` sender listens on (the engines connect to it).
    Default 127.0.0.1 (one host)."""
    weight_sync_port: int = ours(0)
    """Port of that sender, in [0, 65535]; 0 (default) picks a free one."""
    weight_sync_chunk_size_mb: float | None = ours(None)
    """Largest chunk a sync sends at once, in MiB, > 0 (the size of the shared / broadcast buffer);
    larger tensors go in pieces. None (default): the whole model when it is small, at most 256 MiB
    (and at most weight_transfer_threshold_cuda_ipc_GB for shm)."""
    weight_sync_staged: bool = ours(True)
    """`shm` only: pack each update into shared memory before the sync pauses the engines, so the
    pause holds only their copy out of it. Costs shared memory for a whole update (the trainer's
    dtype), made once; it grows only while 1 GiB of /dev/shm and of available memory stays free,
    and packs the rest during the pause. False: pack chunk by chunk during the pause."""
    block_size: int = ours(16)
    """Tokens per KV block, >= 1. Default 16."""
    num_kv_blocks: int | None = ours(None)
    """KV blocks per engine, >= 1; none (default) derives them from kv_cache_memory_gib or
    gpu_memory_utilization."""
    kv_cache_memory_gib: float | None = ours(None)
    """KV memory per engine in GiB, > 0; none (default): sized by gpu_memory_utilization."""
    max_model_len: int | None = ours(None)
    """Longest prompt + generation; none (default) uses the model's max_position_embeddings
    (SkyRL's scripts set it as engine_init_kwargs.max_model_len, which is read as this key)."""
    device: str = ours("cpu")
    """Torch device of the native engine: `cpu` (default), `cuda`, `cuda:N`."""
    attention_backend: str = ours("auto", choices=("auto", "native", "torch"))
    """Decode attention: `native` (the C kernel over paged KV, CPU), `torch` (gather + SDPA, any
    device) or `auto` (default: native where it is supported and builds, else torch)."""
    linear_backend: str = ours("auto", choices=("auto", "onednn", "onednn_fp32", "torch"))
    """Linear layers: `onednn` (weights prepacked for oneDNN in their dtype, CPU), `onednn_fp32`
    (bfloat16 weights computed in float32), `torch` (F.linear) or `auto` (default: onednn where
    oneDNN runs the dtype, else onednn_fp32 for bfloat16, else torch)."""
    elementwise_backend: str = ours("auto", choices=("auto", "native", "torch"))
    """RMSNorm, residual add, rotary and silu*mul: `native` (fused C kernels, CPU float32/bfloat16),
    `torch` or `auto` (default: native where supported and the kernels build, else torch)."""
    weight_update_rollback: bool = ours(True)
    """Keep the pre-update weights until an update finishes, so a failed one is rolled back (costs up
    to one extra copy of the weights during an update). Default true."""
    weight_update_timeout_s: float | None = ours(300.0)
    """An engine abandons a weight update that receives nothing for this long (the old weights come
    back where rollback kept them), so a sender that died mid-update cannot freeze generation, > 0.
    null: no lease. Default 300."""

    def __post_init__(self) -> None:
        self.weight_sync_backend = canonical_weight_sync_backend(self.weight_sync_backend)
        self.model_dtype = DTYPE_ALIASES.get(self.model_dtype, self.model_dtype)


@dataclass
class SamplingConfig:
    """Sampling for rollouts (SkyRL: `generator.sampling_params`)."""

    max_generate_length: int = skyrl(1024)
    """Most tokens generated per response, >= 1. Default 1024."""
    repetition_penalty: float = skyrl(1.0, status=refused(
        "repetition penalties are not implemented yet in the engines", runs=lambda v: v == 1.0))
    temperature: float = skyrl(1.0)
    """Softmax temperature, >= 0 (0 is greedy). Default 1.0."""
    top_p: float = skyrl(1.0)
    """Nucleus mass, in (0, 1]. Default 1.0 (off)."""
    min_p: float = skyrl(0.0, status=refused(
        "min-p sampling is not implemented yet in the engines", runs=lambda v: v == 0.0))
    top_k: int = skyrl(-1)
    """Keep the k most likely tokens; -1 (default) or 0 turns it off."""
    logprobs: int | None = skyrl(1, status=accepted(
        "the engines always record the sampled token's log-probability (what the trainer needs), at no cost"))
    stop: list[str] | None = skyrl(None)
    """Stop strings; none (default) stops only at EOS. A turn ends at the first one in the decoded
    response; the tokens up to the one that completed it are kept (and trained on)."""
    additional_kwargs: dict[str, Any] | None = skyrl(None, status=refused(
        "extra sampling arguments are not implemented yet", runs=lambda v: not v))
    include_stop_str_in_output: bool = ours(False)
    """Whether the text handed to the reward / environment keeps the stop string (vLLM's flag and
    default: false drops it). The trained tokens always include it. skyrl-gym's environments always
    get it (SkyRL always keeps it, and they parse it: `</search>`, `</sql>`)."""


@dataclass
class ChatTemplateConfig:
    """A chat template other than the tokenizer's own."""

    source: str = skyrl("name", choices=("name", "file"))
    """`name` (name_or_path is one of SkyRL's template names) or `file` (name_or_path is a Jinja file).
    Default name."""
    name_or_path: str | None = skyrl(None)
    """The template every prompt and every multi-turn observation is rendered with (token-in/token-out:
    earlier turns are never rendered again); null (default): the tokenizer's own. Names: SkyRL's
    `qwen3_with_thinking` (Qwen3's ChatML keeping each turn's thinking); `qwen3_without_thinking` is
    refused (it drops earlier turns' thinking by re-rendering the conversation, which token-in/token-out
    never does). SkyRL uses a template only for chat-message multi-turn; here it renders the prompts in
    every mode."""


@dataclass
class RateLimitConfig:
    """A limit on the episodes generated at once and per second (the key of SkyRL's agent examples)."""

    enabled: bool = example(False)
    """Limit episodes (training and evaluation share the limits). Default false."""
    trajectories_per_second: float | None = example(None)
    """Most episodes started per second (a token bucket holding max(1, this) starts, SkyRL's; rates
    below 1 work too); null (default): no rate limit."""
    max_concurrency: int | None = example(None)
    """Most episodes in flight at once; null (default): no limit."""


@dataclass
class AgentConfig:
    """Your own agent, trained through the agent endpoint (not a SkyRL key: SkyRL wires each agent
    framework in an example of its own). Every episode gets an OpenAI-compatible `base_url` and
    `api_key` (its session) served from the run's engines; every call is recorded token for token."""

    path: str | None = ours(None)
    """`package.module:name` of your agent: `async def agent(base_url, api_key, problem)` returning the
    episode's reward or `(reward, info)`, or a class whose instances are called so (a plain function
    runs in a thread). null (default): no agent; the environment (environment.env_class) plays the
    episodes."""
    timeout_s: float | None = ours(600.0)
    """Most seconds one episode (one agent call) may take, > 0; a slower one is a failed episode
    (generator.skip_failed_rollouts: not trained on, counted in `agent/episodes_failed`). null: no
    limit. Default 600."""
    host: str = ours("127.0.0.1")
    """Address the agent endpoint listens on (the agents' base_url). Default 127.0.0.1."""
    port: int = ours(0)
    """Its port, in [0, 65535]; 0 (default) picks a free one."""


@dataclass
class GeneratorConfig:
    """Rollout generation."""

    inference_engine: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    n_samples_per_prompt: int = skyrl(5)
    """Responses per prompt (the GRPO group size), >= 1. Default 5."""
    batched: bool = skyrl(False, status=accepted(
        "a batch's requests always reach the engines together (continuous batching), batched or not"))
    max_turns: int = skyrl(1)
    """Most model turns per episode, >= 1, for environments that leave it to the run (a ToolEnv, your
    own environment without a `max_turns`); an environment that sets its own `max_turns` keeps it.
    Default 1 (single-turn)."""
    max_input_length: int | None = skyrl(None)
    """Longest input of a turn (the prompt, every turn before it and the observation), in tokens: an
    episode whose next turn's input would be longer ends there with finish reason `length` (which
    zero_reward_on_non_stop and apply_overlong_filtering see). null (default): trainer.max_prompt_length."""
    chat_template: ChatTemplateConfig = field(default_factory=ChatTemplateConfig)
    chat_template_kwargs: dict[str, Any] = skyrl(factory=dict)
    """Extra arguments of every chat template rendering, prompts and turns (e.g. `{enable_thinking:
    false}`). Default {}."""
    sampling_params: SamplingConfig = field(default_factory=SamplingConfig)
    use_conversation_multi_turn: bool = skyrl(True)
    """Multi-turn: each observation is a chat message rendered by the template between the model's
    turns (true, default), or its messages' text appended straight after the model's response
    (false: the model's EOS before it is dropped, no template or generation prompt; the episode is one
    assistant message, closed with an EOS that is not trained on)."""
    append_eos_token_after_stop_str_in_multi_turn: bool = skyrl(True)
    """With chat-message observations: a turn ended by a stop string gets the tokenizer's EOS
    appended (loss mask 0, as SkyRL's), the last turn too. false: nothing is appended and the turn
    stays open (the template's end-of-turn EOS is left out before the observation, as in SkyRL).
    Default true."""
    eval_sampling_params: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling for evaluation (same fields and defaults as sampling_params)."""
    eval_n_samples_per_prompt: int = skyrl(1)
    """Responses per held-out prompt, >= 1; pass@k is reported for k = 1, 2, 4, ... up to it. Default 1."""
    zero_reward_on_non_stop: bool = skyrl(False)
    """Score 0 every episode whose finish reason is not `stop` (cut by the token budget or the input
    cap, aborted), its turn rewards too. Default false."""
    use_cache_salt: bool = skyrl(True, status=refused(
        "the weight version is part of every prefix-cache key by construction: sharing KV across weight "
        "versions is the bug class this project rules out", runs=lambda v: v is True))
    apply_overlong_filtering: bool = skyrl(False)
    """DAPO's overlong filtering: an episode whose finish reason is not `stop` (cut by the length
    budget or the input cap) gets loss mask 0 on every token; its reward still counts in its group.
    Default false."""
    step_wise_trajectories: bool = skyrl(False)
    """Train on each model turn of a multi-turn episode as its own sample (SkyRL's): its prompt is
    the conversation up to the turn (the tokens the engine was given for it: turns stay
    token-in/token-out, never re-rendered), its response the turn's tokens and the observation after
    them (loss mask 0). The episode's advantage is the estimator's on its last turn's reward (as
    SkyRL, earlier turns' rewards do not count), on every turn's tokens; groups then have as many
    rows as their episodes have turns. Needs an outcome estimator (grpo, rloo, maxrl),
    use_conversation_multi_turn=true, batched=false, no custom chat template, no routing record and
    a loss_reduction other than token_mean_legacy (SkyRL's rules). Default false."""
    vision_language_generator: bool = skyrl(False)
    """SkyRL's switch to its vision-language generator: prompts and chat-message observations may hold
    images (image parts), which go to the engine with the request (a vision-language policy such as
    Qwen2.5-VL; its processor expands the placeholders) and train with their tokens. As SkyRL's, it
    needs batched=false, step_wise_trajectories=false and use_conversation_multi_turn=true. Data rows
    holding images need it true (refused at start-up otherwise). Default false."""
    merge_stepwise_output: bool = skyrl(False)
    """With step_wise_trajectories: merge each episode's turns back into one sample where a turn's
    prompt extends the previous turn's prompt and response (SkyRL's prefix-aware merging). Turns are
    token-in/token-out here, so every episode merges whole: it trains as without step-wise. Default
    false."""
    skip_failed_rollouts: bool = ours(True)
    """An episode whose harness fails (its environment: building it, `reset()`, turning its
    observation into tokens; your agent: raising, timing out, returning no reward) costs that episode
    only, not its group or the run: its tokens stay in the batch with loss mask 0 and it is left out
    of its group's advantages, so the finished episodes' are what they would be without it (counted
    in `rollout/failed` and `rollout/failed_tokens_masked`). A group none of whose episodes finished
    is dropped and recorded as `failed` in consumed.jsonl (never trained, never lost). false: the
    failure ends the run (SkyRL's behaviour). Rewards that fail always score 0
    (`environment.reward_timeout_s`). Default true."""
    rate_limit: RateLimitConfig = field(default_factory=RateLimitConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    miniswe_config_path: str | None = example(None, status=_MINISWE)
    """The mini-swe-agent config of SkyRL's mini-swe-agent example. Default null."""
    miniswe_traj_dir: str | None = example(None, status=_MINISWE)
    """Where that example writes its agent trajectories. Default null."""
    enable_child_agents: bool = example(False, status=_CHILD_AGENTS)
    """SkyRL's recursive-LM example: let an episode spawn child agents. Default false."""
    train_child_trajectories: bool = example(False, status=_CHILD_AGENTS)
    """SkyRL's recursive-LM example: train on the child agents' trajectories too. Default false."""


__all__ = [
    "DTYPE_ALIASES", "WEIGHT_SYNC_BACKEND_ALIASES", "AgentConfig", "ChatTemplateConfig",
    "DeltaWeightSyncConfig", "GeneratorConfig", "InferenceEngineConfig", "RateLimitConfig", "SamplingConfig",
    "canonical_weight_sync_backend", "weight_transport",
]
