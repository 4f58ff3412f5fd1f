"""The HTTP route paths of the inference server's API, standard library only.

One source for every server that speaks our API: `inflight.client.wire` re-exports them for the
client and the native server, and the vLLM backend (`inflight.vllm_backend`, run by vLLM's own
interpreter, which does not have this package installed) loads this file by path.
"""

GENERATE = "/inflight/v1/generate"
PAUSE = "/pause"
RESUME = "/resume"
SLEEP = "/sleep"
WAKE_UP = "/wake_up"
RESET_PREFIX_CACHE = "/reset_prefix_cache"
WEIGHTS_BEGIN = "/weight_update/begin"
WEIGHTS_CHUNK = "/weight_update/chunk"
WEIGHTS_FINISH = "/weight_update/finish"
WEIGHTS_ABORT = "/weight_update/abort"
WEIGHTS_BROADCAST = "/weight_update/broadcast"
INIT_WEIGHT_TRANSFER = "/init_weight_update_communicator"  # SkyRL's name for joining the group
INIT_WEIGHT_TRANSFER_ALIAS = "/init_weight_transfer"
DESTROY_WEIGHT_TRANSFER = "/destroy_weights_update_group"
WEIGHT_VERSION = "/weight_version"
STATUS = "/status"
HEALTH = "/health"
METRICS = "/metrics"
