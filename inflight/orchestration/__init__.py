"""Process orchestration of a run, apart from the training step: the engines started in this
process tree (`engines`: in process, child processes or HTTP servers), the servers a run starts or
reaches (`servers`, `server_fleet`), policy rank 0's weight sender (`sender`), engine restarts
(`engine_restarts`), the engines' settings and memory (`engine_settings`, `engine_memory`), the
split of the CPU threads between trainer and engines (`thread_lending`) and the GPU counts
(`device_counts`).

Below `inflight.train` (the trainers and the policy run on what this package starts) and above the
engine, client, weight-sync and backend layers it starts and connects. Ray placement of the same
(`inflight.cluster`) sits above `train`: its actors hold the policy.
"""
