"""The HTTP route paths of the inference server's API, standard library only.

One source for every server that speaks our API: `inflight.client.wire` re-exports them for the
client and the native server, and the vLLM backend (`inflight.backends.vllm`, run by vLLM's own
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

# `WEIGHTS_CHUNK?shm=NAME`: the chunk's safetensors bytes are in the file NAME of SHM_DIR, written
# by a client on the server's host, instead of in the request body (one copy instead of a socket)
CHUNK_FILE_PARAM = "shm"
SHM_DIR = "/dev/shm"
CHUNK_FILE_PREFIX = "inflight-chunk-"


def read_chunk_file(name: str) -> bytes:
    """The bytes of the chunk file `name` (a `WEIGHTS_CHUNK?shm=` value). ValueError unless `name`
    is a plain `CHUNK_FILE_PREFIX*` file name (a control route reads no other file) that exists."""
    if not name.startswith(CHUNK_FILE_PREFIX) or "/" in name:
        raise ValueError(f"shm={name!r} is not a chunk file: expected a file name {CHUNK_FILE_PREFIX}* in "
                         f"{SHM_DIR}, written there by a client on this host")
    try:
        with open(f"{SHM_DIR}/{name}", "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"shm={name!r}: no such chunk file in {SHM_DIR}; a client on another host must send "
                         "the chunk in the request body") from None
