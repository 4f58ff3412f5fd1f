"""Inference backends behind our HTTP API: the registry (`registry.py`: one entry per backend, asked
instead of comparing names) and each external backend's own package (`vllm/`, `hf_generate/`).

Imports nothing itself: `inflight.backends.registry` sits below the config layer, the backends'
packages above it (tests/test_layers.py ranks them apart).
"""
