"""What the two-rank megatron tests share: a small padded batch and a free port for the ranks' group."""

from __future__ import annotations

import socket

import torch

from inflight.train.batch import TrainBatch


def small_batch(vocab: int, seed: int, width: int, padded_row: int, pad_from: int) -> TrainBatch:
    """Three rows of `width` random tokens, `padded_row` right-padded from `pad_from`, the first three
    tokens of each untrained."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (3, width), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[padded_row, pad_from:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return TrainBatch(input_ids=input_ids, loss_mask=loss_mask, attention_mask=attention_mask)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
