"""vLLM as the inference engine behind our HTTP API (`inflight serve --backend vllm`).

`launch.py` and `venv.py` run in the project's interpreter: they find vLLM's venv and exec
`main.py` with it. Everything else here is **run by vLLM's own interpreter**, which does not have
this package installed: those modules import only the standard library, vLLM, FastAPI/uvicorn and
torch/safetensors from that venv, and load each other as a private package (see `main.py`); the
route paths come from `inflight/client/routes.py`, loaded by path, so they cannot drift from
the client's.

The server exposes our routes with our semantics over vLLM's `AsyncLLM` (see `state.py` for the
lifecycle, `weights.py` for updates, `generate.py` for the token route). What a user cannot get
from vLLM, said plainly:

- no rollback copy inside vLLM: an update is staged in the server's memory and goes into vLLM in
  one reload at finish; a failed reload is undone by reloading the last complete weights from the
  file they were loaded from (if that fails too the server stays paused and `invalid`);
- no per-block weight versions and no engine-side KV epoch: the only guard against attending to
  discarded KV is the shim's own backstop (`sleep(offload_kv=false)` -> the frozen requests are
  reset before they run again) and the plan's explicit reset;
- on CPU `sleep` frees no memory (vLLM's sleep is CUDA-only; KV and weights live in host memory).
  The shim keeps our contract instead: `offload_kv=true` is the same as keep (said in the log),
  `offload_kv=false` counts as discarding the KV (the backstop above), and the weights count as
  dropped (resume refused until a full update lands). On CUDA with vLLM's sleep mode
  (`-- --enable-sleep-mode`) the same calls also free memory through vLLM's sleep level 1 and
  wake_up (`state.py`); `offload_kv=true` is then refused, since level 1 keeps no copy of the KV;
- the prefix cache is version-blind inside vLLM: the shim salts every request (token route and
  OpenAI routes) with the weight version; on the OpenAI routes a request accepted just before an
  update but not yet started keeps the old salt (the token route restarts such requests), and
  they report no per-token weight versions;
- `/status`: `num_running` counts token-route requests only; `kv_cache_usage` is unknown (null);
- weight updates are full updates only (every parameter of the checkpoint); no LoRA adapters.
  They arrive by the chunk route or a trainer's broadcast group (`broadcast.py`, over the group
  protocol's own files loaded by path: `shared.py`).
"""
