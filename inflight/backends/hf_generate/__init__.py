"""transformers' own `generate` behind our routes (`inflight serve --backend hf_generate`): the
baseline TRL uses, run by the project's interpreter (`server.py`). It proves the backend seam
(docs/design.md, "Adding an inference backend") and serves as a slow, simple reference server.

What it cannot do, said plainly (and refused by its registry entry where a run would ask):
- one request generates at a time (no batching across requests; the others wait their turn);
- no KV cache outlives a request, so nothing is cached between them: `reset_prefix_cache` has
  nothing to clear, and frozen requests cannot be recomputed (`reset_running_requests=true` with a
  frozen request is a 409; `clear_kv_cache_on_weight_sync=true` is refused);
- weight updates arrive by the chunk route only (`inprocess` bodies or `shm` files), never by a
  broadcast group; no LoRA adapters (merged weights);
- `pause(keep)` freezes the running request between two tokens (its KV, computed by the old
  weights, is kept, as the native engine's `keep`); `sleep` frees no memory (it only holds generation).
"""
