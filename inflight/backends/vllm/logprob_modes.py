"""Which of vLLM's `--logprobs-mode`s gives the logprobs we promise, per request and per run: THE
rule, read by the shim (`generate.check_sampling`, in vLLM's interpreter) and by a run that starts vLLM
servers (`inflight.orchestration.servers`, which picks the mode its sampling needs).

We promise the sampled token's logprob under `log_softmax(logits / T)` before any top-k/top-p filter
(T = 1 for greedy): what a policy-gradient trainer recomputes (docs/design.md, "Logprobs"). vLLM 0.32
(v1/sample/sampler.py) returns, per server, either
- `raw_logprobs`: `log_softmax(logits)` before temperature and filters: ours at T = 1 and for greedy,
  whatever top-k/top-p (SkyRL's recipes sample at T = 1: DAPO's eval top_p=0.7 needs this one), or
- `processed_logprobs`: after temperature and after the top-k/top-p filter, renormalized over what it
  kept: ours at any T when nothing is filtered.
No mode gives ours for T not in {0, 1} with a filter; the logits modes give no logprobs at all.

Standard library only: this module runs in both interpreters.
"""

from __future__ import annotations

from collections.abc import Iterable

GREEDY_BELOW = 1e-5  # as inflight.engine.request: below it, greedy
RAW, PROCESSED = "raw_logprobs", "processed_logprobs"
DEFAULT = PROCESSED  # the shim's, unless vLLM's own --logprobs-mode is given after `--`
WHAT = {RAW: "log_softmax(logits), before temperature and top-k/top-p: ours at temperature 1 or 0 only",
        PROCESSED: "taken after the top-k/top-p filter and renormalized: ours only without a filter"}


def serves(mode: str, temperature: float, top_p: float, top_k: int) -> bool:
    """Whether vLLM in `mode` returns our logprobs for a request sampled at these settings."""
    if mode == RAW:
        return temperature < GREEDY_BELOW or temperature == 1.0
    if mode == PROCESSED:
        return top_p >= 1.0 and top_k <= 0
    return False  # raw_logits / processed_logits: logits, not logprobs


def run_mode(samplings: Iterable[tuple[float, float, int]]) -> str | None:
    """The mode a server must run in for every (temperature, top_p, top_k) a run samples with and
    asks logprobs of: the default when it serves them all, else raw_logprobs when that does, else
    None (no mode does)."""
    wanted = list(samplings)
    return next((m for m in (DEFAULT, RAW) if all(serves(m, *s) for s in wanted)), None)


def refusal(mode: str, temperature: float, top_p: float, top_k: int) -> str:
    """Why a request with logprobs=True is refused by a server in `mode`, and the fixes."""
    other = next((m for m in (RAW, PROCESSED) if m != mode and serves(m, temperature, top_p, top_k)), None)
    restart = (f"start the server with vLLM's `--logprobs-mode {other}` (after `--`; {WHAT[other]}), or "
               if other else "")
    got = WHAT.get(mode, "logits, not logprobs")
    return (
        f"logprobs=True with temperature={temperature}, top_k={top_k}, top_p={top_p}: this server runs vLLM "
        f"with --logprobs-mode {mode} ({got}), not the logprob this API promises "
        f"(log_softmax(logits / temperature) before the top-k/top-p filter); {restart}set logprobs=false, "
        "or use the native backend"
    )


__all__ = ["DEFAULT", "GREEDY_BELOW", "PROCESSED", "RAW", "refusal", "run_mode", "serves"]
