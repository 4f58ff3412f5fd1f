"""BlockPool: ref-counted KV blocks and the prefix cache keyed by tokens, salt, images and weight version.

A block's prefix hash chains its parent's hash, its token ids, the request's cache salt (first block
only), the keys (content hash, grid) of the images whose placeholders it holds and the weight
version of the block's KV, so KV computed by old weights is never found by a
request that looks up with the current version. A block whose ref count drops to 0 goes to the end of
the free queue but keeps its hash: it can still be reused until it is evicted (reallocated, LRU).
Every block records the KV epoch it was written in; discarding the KV memory starts a new epoch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from inflight.engine.request import Request


def chain_hash(parent: int | None, token_ids: tuple[int, ...], salt: str | None, version: int,
               images: tuple = ()) -> int:
    """Hash of one full block given its parent block's hash (None for the first block); `images`:
    the keys (content hash, grid) of the images with placeholders in the block."""
    key = (parent, salt if parent is None else None, version, token_ids)
    return hash(key + (images,) if images else key)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    weight_version: int = 0  # the oldest weight version that computed any entry of this block
    epoch: int = 0  # the KV epoch in which the entries were written


class BlockPool:
    """Fixed set of KV blocks: a request's block table, ref counting, prefix cache, LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # prefix hash -> block id
        self.epoch = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free / max(1, self.num_blocks)

    # ---- a request's blocks -------------------------------------------------------------------
    def match_prefix(self, request: Request, weight_version: int) -> int:
        """Give a request holding no blocks the cached blocks of its longest prefix computed by
        `weight_version`; returns the tokens they cover (now its computed tokens)."""
        assert not request.block_ids, f"{request.request_id} already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        parent = None
        for j in range((request.num_tokens - 1) // self.block_size):  # keep at least one token to compute
            tokens = self._tokens_of(request, j)
            block_hash = chain_hash(
                parent, tokens, request.cache_salt, weight_version, self._images_of(request, j)
            )
            block_id = self.lookup(block_hash, tokens)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_ids[block_id]
            block.ref_count += 1
            request.block_ids.append(block_id)
            request.block_hashes.append(block_hash)
            parent = block_hash
        request.num_computed_tokens = len(request.block_ids) * self.block_size
        return request.num_computed_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, weight_version: int) -> bool:
        """Give a request the blocks for `num_new_tokens` more tokens; False, taking nothing, when
        too few are free."""
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(
            request.block_ids
        )
        if needed > self.num_free:
            return False
        request.block_ids.extend(self.allocate(weight_version) for _ in range(needed))
        return True

    def publish(self, request: Request) -> None:
        """Register the request's newly full, computed blocks under their prefix hashes."""
        if not self.enable_prefix_caching:
            return
        while len(request.block_hashes) < request.num_computed_tokens // self.block_size:
            j = len(request.block_hashes)
            tokens = self._tokens_of(request, j)
            parent = request.block_hashes[-1] if request.block_hashes else None
            block = self.blocks[request.block_ids[j]]
            block_hash = chain_hash(parent, tokens, request.cache_salt, block.weight_version,
                                    self._images_of(request, j))
            self.register(block.block_id, block_hash, tokens)
            request.block_hashes.append(block_hash)

    def release(self, request: Request) -> None:
        """Free a request's blocks (its KV is gone: computed tokens 0, tokens kept)."""
        for block_id in reversed(request.block_ids):  # the tail is evicted before the more shareable head
            self.free(block_id)
        request.block_ids = []
        request.block_hashes = []
        request.num_computed_tokens = 0

    def holds_stale_kv(self, request: Request) -> bool:
        """Whether the request holds a block written before the last KV discard."""
        return any(self.blocks[b].epoch != self.epoch for b in request.block_ids)

    def _tokens_of(self, request: Request, j: int) -> tuple[int, ...]:
        return tuple(request.token_ids[j * self.block_size : (j + 1) * self.block_size])

    def _images_of(self, request: Request, j: int) -> tuple:
        if request.images is None:
            return ()
        return request.images.block_key(j * self.block_size, (j + 1) * self.block_size)

    # ---- single blocks ------------------------------------------------------------------------
    def allocate(self, weight_version: int) -> int:
        """Take the least recently freed block, evicting its cached hash."""
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        self._uncache(block)
        block.ref_count = 1
        block.weight_version = weight_version
        block.epoch = self.epoch
        return block_id

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly these tokens under this hash, if any."""
        if not self.enable_prefix_caching:
            return None
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Publish a full, computed block under its prefix hash (first writer wins)."""
        if not self.enable_prefix_caching or block_hash in self.cached:
            return
        block = self.blocks[block_id]
        self._uncache(block)
        block.hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Drop the hash of every unreferenced block; True iff no cached hash is left."""
        for block_id in self.free_ids:
            self._uncache(self.blocks[block_id])
        return not self.cached

    def invalidate_all(self) -> None:
        """The KV memory was discarded: forget every hash and start a new epoch."""
        for block in self.blocks:
            self._uncache(block)
        self.epoch += 1

    def _uncache(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) == block.block_id:
                del self.cached[block.hash]
            block.hash = None
            block.token_ids = ()
