"""Helpers for tests, docs and benchmarks: tiny locally-built models and tokenizers."""

from inflight.testing.chain_model import make_chain_model
from inflight.testing.configs import LOCAL_CPU, LOCAL_CPU_TRAINER
from inflight.testing.tiny_model import SUPPORTED_ARCHS, make_tiny_model, make_tokenizer

__all__ = [
    "LOCAL_CPU",
    "LOCAL_CPU_TRAINER",
    "SUPPORTED_ARCHS",
    "make_chain_model",
    "make_tiny_model",
    "make_tokenizer",
]
