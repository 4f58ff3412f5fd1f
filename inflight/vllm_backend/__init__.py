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
- on CPU vLLM's sleep is a no-op (KV and weights live in host memory): `sleep` frees nothing,
  `offload_kv=true` is the same as keep, `offload_kv=false` is treated as discarding the KV;
- the prefix cache is version-blind inside vLLM: the shim salts every request (token route and
  OpenAI routes) with the weight version;
- weight updates are full updates only (every parameter of the checkpoint); no LoRA adapters, no
  broadcast group (`/weight_update/broadcast` and the init routes are not served).
"""
