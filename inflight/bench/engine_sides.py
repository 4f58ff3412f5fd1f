"""The sides of `inflight bench engine` that run in a spawned copy of this interpreter: the inflight
engine and `transformers` generate(). `_open`, `_call` and `_close` are what the orchestrator calls
through `Worker`; the loaded side lives in this module's globals in the worker process."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inflight.bench.engine_workload import BenchConfig, Workload

_SIDE: dict[str, Any] = {}  # in a worker process: the loaded side


def setup_process(threads: int) -> None:
    import torch
    from transformers.utils import logging

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    logging.disable_progress_bar()


def build_model(cfg: BenchConfig, model_dir: Path) -> None:
    """The benchmark's random model in `model_dir`, unless one is there already."""
    from inflight.testing import make_tiny_model

    setup_process(cfg.threads)
    if cfg.images:
        from inflight.bench.engine_images import build_vlm

        return build_vlm(cfg, model_dir)
    if not (model_dir / "config.json").is_file():
        make_tiny_model(model_dir, cfg.shape.arch, seed=cfg.seed, **cfg.shape.config_overrides())


def per_step_s(one_token_s: float, steps_s: float, steps: int) -> float:
    """Seconds per decode step from the time of a 1-token and a `steps`-token generation."""
    return (steps_s - one_token_s) / (steps - 1)


def _measure_peak(dtype: str) -> float:
    import torch

    from inflight.bench.common import matmul_peak_flops

    return matmul_peak_flops(getattr(torch, dtype))


class EngineSide:
    """The inflight engine, loaded (timed: load + first step) and warmed up."""

    def __init__(self, model_dir: str, cfg: BenchConfig, work: Workload) -> None:
        from inflight.engine import EngineConfig, LLMEngine

        self.work = work
        block = {} if cfg.block_size is None else {"block_size": cfg.block_size}
        engine_cfg = EngineConfig(
            model=model_dir,
            dtype=cfg.dtype,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            seed=cfg.seed,
            **block,
        )
        self.images = _multimodal(model_dir, work)
        start = time.perf_counter()
        self.engine = LLMEngine(engine_cfg)
        self.engine.generate([work.prompts[0]], self._params(1), multimodal=self.images and self.images[:1])
        self.startup_s = time.perf_counter() - start
        self.all_params = [self._params(n) for n in work.output_lens]
        # a full-size warm-up pass, like vLLM's: oneDNN builds its kernels for each new row count
        # the first time it sees it, and every decode batch size occurs only in a full pass
        self.warmup_s, _ = self.run()
        self.hits_before = self.engine.stats.prefix_cache_hit_tokens

    @staticmethod
    def _params(max_tokens: int) -> Any:
        from inflight.engine import SamplingParams

        # no logprobs, like the vLLM side (asked for none): both compute tokens only
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=False)

    def info(self) -> dict[str, Any]:
        params = sum(p.numel() for p in self.engine.model.parameters())
        return {
            "startup_s": self.startup_s, "warmup_s": self.warmup_s, "params": params,
            "block_size": self.engine.config.block_size,
        }  # fmt: skip

    def run(self) -> tuple[float, list[list[int]]]:
        """One timed pass over the workload: (seconds, output token ids per request)."""
        self.engine.reset_prefix_cache()  # the same prompts again must not hit the cache
        start = time.perf_counter()
        outputs = self.engine.generate(self.work.prompts, self.all_params, multimodal=self.images)
        return time.perf_counter() - start, [o.output_token_ids for o in outputs]

    def latency(self, batch: int, steps: int) -> float:
        """Seconds per decode step of the first `batch` prompts decoding together (see bench.latency)."""
        prompts, images, times = self.work.prompts[:batch], self.images and self.images[:batch], []
        for tokens in (1, steps):
            self.engine.reset_prefix_cache()
            start = time.perf_counter()
            self.engine.generate(prompts, self._params(tokens), multimodal=images)
            times.append(time.perf_counter() - start)
        return per_step_s(times[0], times[1], steps)

    def profile(self) -> dict[str, Any]:
        """One pass under torch.profiler, the native kernels labelled (`labelled_native_kernels`):
        the op table by self CPU time, the pass's wall time and its split (`profile_split`)."""
        from torch.profiler import ProfilerActivity, profile

        with (
            labelled_native_kernels(self.engine.runner.native_lib),
            profile(activities=[ProfilerActivity.CPU]) as prof,
        ):
            wall_s, _ = self.run()
        events = prof.key_averages()
        return {"table": events.table(sort_by="self_cpu_time_total", row_limit=25), "wall_s": wall_s,
                "split_s": profile_split({e.key: e.self_cpu_time_total / 1e6 for e in events}, wall_s)}

    def finish(self) -> dict[str, Any]:
        stats = self.engine.stats
        return {
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens - self.hits_before,
            "preemptions": stats.preemptions,
        }


def _multimodal(model_dir: str, work: Workload) -> list[Any] | None:
    """The engine's image inputs per request (None: a text workload)."""
    from inflight.engine.multimodal import MultimodalInput

    if not work.images:
        return None
    from inflight.bench.engine_images import image_inputs

    return [MultimodalInput(pixels, grid) for pixels, grid in image_inputs(model_dir, work.images)]


NATIVE_KERNELS = ("paged_attention_rows", "fused_rms_norm", "fused_rotary", "fused_silu_mul")
"""The engine's native kernels a profile labels: attention, then the elementwise ones."""


@contextlib.contextmanager
def labelled_native_kernels(lib: ctypes.CDLL | None) -> Iterator[None]:
    """While active, each call of a native kernel in `lib` shows in torch.profiler as
    `inflight::<name>`: a ctypes call is no torch op, so its time would otherwise count as no op's
    (in a table of ops it looked as if the matmuls took the whole step). Nothing without `lib`."""
    from torch.profiler import record_function

    saved = {} if lib is None else {name: getattr(lib, name) for name in NATIVE_KERNELS}

    def labelled(name: str, kernel: Callable[..., int]) -> Callable[..., int]:
        def call(*args: Any) -> int:
            with record_function(f"inflight::{name}"):
                return kernel(*args)
        return call

    try:
        for name, kernel in saved.items():
            setattr(lib, name, labelled(name, kernel))
        yield
    finally:
        for name, kernel in saved.items():
            setattr(lib, name, kernel)


def profile_split(self_s: dict[str, float], wall_s: float) -> dict[str, float]:
    """Seconds of a profiled pass by kind, from each op's self CPU seconds: the matmuls (oneDNN's
    packed linears and aten's matmuls), native attention, native elementwise kernels, every other
    op, and the host's Python and waits outside any op (the wall time left over; with several
    threads an op's CPU time can exceed its wall share, so this is a floor of 0)."""
    matmul = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")
    split = {"matmul": sum(self_s.get(k, 0.0) for k in matmul),
             "attention (native)": self_s.get("inflight::paged_attention_rows", 0.0),
             "elementwise (native)": sum(self_s.get(f"inflight::{k}", 0.0) for k in NATIVE_KERNELS[1:])}
    split["other ops"] = sum(self_s.values()) - sum(split.values())
    split["outside ops"] = max(0.0, wall_s - sum(self_s.values()))
    return split


class TransformersSide:
    """`transformers` generate() with static, length-sorted, left-padded batches."""

    def __init__(self, model_dir: str, cfg: BenchConfig, work: Workload) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from inflight.bench.engine_images import image_inputs

        self.work = work
        # the batch's images: each request's (pixel_values, image_grid_thw), as the engine's
        self.images = work.images and image_inputs(model_dir, work.images)
        auto = AutoModelForImageTextToText if work.images else AutoModelForCausalLM
        start = time.perf_counter()
        self.model = auto.from_pretrained(
            model_dir, dtype=getattr(torch, cfg.dtype), attn_implementation="sdpa"
        ).eval()
        self.load_s = time.perf_counter() - start
        self.pad = self.model.generation_config.pad_token_id or 0
        # like the engine's ignore_eos: no stop token (min_new_tokens would instead forbid EOS,
        # changing greedy picks whenever EOS is the top token)
        self.model.generation_config.eos_token_id = None
        self.warm: set[int] = set()

    def info(self) -> dict[str, Any]:
        return {"load_s": self.load_s}

    def batches(self, batch_size: int) -> list[list[int]]:
        work = self.work
        order = sorted(range(len(work.prompts)), key=lambda i: (work.output_lens[i], len(work.prompts[i])))
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def run(self, batch_size: int) -> tuple[float, int, list[list[int]]]:
        """One timed pass: (seconds, tokens decoded including the cut-off ones, outputs per request)."""
        batches = self.batches(batch_size)
        if batch_size not in self.warm:
            self._generate(batches[-1:], cap=2)  # warm-up on the widest batch
            self.warm.add(batch_size)
        start = time.perf_counter()
        outputs, generated = self._generate(batches)
        return time.perf_counter() - start, generated, [outputs[i] for i in range(len(self.work.prompts))]

    def _generate(self, batches: list[list[int]], cap: int | None = None) -> tuple[dict[int, list[int]], int]:
        import torch

        work, outputs, generated = self.work, {}, 0
        for batch in batches:
            width = max(len(work.prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                prompt = work.prompts[i]
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            steps = min(cap or 1 << 30, max(work.output_lens[i] for i in batch))
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=steps,
                    do_sample=False,
                    pad_token_id=self.pad,
                    **self._image_kwargs(batch, ids),
                )
            new = out[:, width:]
            assert new.shape[1] == steps, f"transformers stopped after {new.shape[1]} of {steps} tokens"
            generated += new.numel()
            for row, i in enumerate(batch):
                outputs[i] = new[row, : work.output_lens[i]].tolist()
        return outputs, generated

    def _image_kwargs(self, batch: list[int], ids: Any) -> dict[str, Any]:
        """generate()'s image inputs for `batch` (rows `ids`): its images in row order, and which
        tokens are image tokens (M-RoPE's positions); none for a text workload."""
        import torch

        if not self.images:
            return {}
        image_token = self.model.config.image_token_id
        return {"pixel_values": torch.cat([self.images[i][0] for i in batch]),
                "image_grid_thw": torch.cat([self.images[i][1] for i in batch]),
                "mm_token_type_ids": (ids == image_token).long()}

    def finish(self) -> dict[str, Any]:
        return {}


_SIDES = {"engine": EngineSide, "transformers": TransformersSide}


def open_side(kind: str, model_dir: str, cfg: BenchConfig, work: Workload) -> dict[str, Any]:
    """In a worker: load the side, then measure the matmul peak there."""
    setup_process(cfg.threads)
    _SIDE["side"] = _SIDES[kind](model_dir, cfg, work)
    _SIDE["dtype"] = cfg.dtype
    return {**_SIDE["side"].info(), "peak_flops": [_measure_peak(cfg.dtype)]}


def call_side(method: str, *args: Any) -> Any:
    """In a worker: call a method of the loaded side."""
    return getattr(_SIDE["side"], method)(*args)


def close_side() -> dict[str, Any]:
    """In a worker: the side's counters, a second peak measurement, the process's peak RSS."""
    from inflight.bench.common import peak_rss_mib

    return {
        **_SIDE["side"].finish(),
        "peak_flops_after": _measure_peak(_SIDE["dtype"]),
        "peak_rss_mib": peak_rss_mib(),
    }
