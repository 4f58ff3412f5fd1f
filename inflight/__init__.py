"""inflight: fully-asynchronous RL post-training with in-flight weight updates."""

__version__ = "0.1.0"
