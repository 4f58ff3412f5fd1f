"""Helpers for tests, docs and benchmarks: tiny locally-built models and tokenizers."""

from inflight.testing.tiny_model import SUPPORTED_ARCHS, make_tiny_model, make_tokenizer

__all__ = ["SUPPORTED_ARCHS", "make_tiny_model", "make_tokenizer"]
