"""`/metrics`: the shim's state and counters in Prometheus text, followed by vLLM's own metrics
(its `prometheus_client` registry: `vllm:generation_tokens_total` and the rest)."""

from __future__ import annotations

from .state import Lifecycle


def render_metrics(life: Lifecycle) -> str:
    s = life.status()
    lines = [
        "# HELP inflight_weight_version The weight version of the served model.",
        "# TYPE inflight_weight_version gauge",
        f"inflight_weight_version {s['weight_version']}",
        "# HELP inflight_paused 1 while generation is paused.",
        "# TYPE inflight_paused gauge",
        f"inflight_paused {int(s['paused'])}",
        "# HELP inflight_can_run 1 while the engine may run the model.",
        "# TYPE inflight_can_run gauge",
        f"inflight_can_run {int(s['can_run'])}",
        "# HELP inflight_requests_running Token-route requests in flight.",
        "# TYPE inflight_requests_running gauge",
        f"inflight_requests_running {s['num_running']}",
    ]
    for name, value in s["stats"].items():
        lines += [f"# TYPE inflight_{name}_total counter", f"inflight_{name}_total {value}"]
    return "\n".join(lines) + "\n" + _vllm_metrics()


def _vllm_metrics() -> str:
    try:
        from prometheus_client import REGISTRY, generate_latest
    except ImportError:
        return ""
    return generate_latest(REGISTRY).decode()
