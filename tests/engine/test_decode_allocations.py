"""A decode step of 64 sequences allocates nothing that grows with the context (torch.profiler)."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from inflight.engine import EngineConfig, LLMEngine, SamplingParams, kernels

BATCH = 64


def _decode_step_allocated_bytes(model_dir, backend: str, prompt_len: int) -> int:
    """Bytes allocated by one decode step (all 64 sequences past their prefill, workspace warm)."""
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), block_size=16, num_kv_blocks=BATCH * 40, max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * prompt_len, max_model_len=640, attention_backend=backend,
    ))  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(str(i), [3 + (i + j) % 300 for j in range(prompt_len)], params)
    for _ in range(3):  # the prefill (with the first token), then two decode steps to warm buffers
        engine.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.step()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_decode_allocations_do_not_grow_with_context(backend, tiny_model_factory):
    if backend == "native" and kernels.load() is None:
        pytest.skip("no C compiler: the native kernel cannot be built")
    model_dir = tiny_model_factory("qwen2", max_position_embeddings=1024)
    short = _decode_step_allocated_bytes(model_dir, backend, 16)
    long = _decode_step_allocated_bytes(model_dir, backend, 512)
    grows = long > short * 1.05 + 4096
    if backend == "native":
        assert not grows, f"decode step allocated {short} B at context 16 but {long} B at context 512"
    else:  # the gather+SDPA fallback allocates scores and masks per context: the check sees it
        assert grows, f"torch path: {short} B at context 16 vs {long} B at 512 (expected growth)"
