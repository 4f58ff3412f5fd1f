"""The vLLM side of `inflight bench engine`, run as a script by the interpreter of vLLM's own venv.

It imports nothing from `inflight` (that venv does not have it): only the standard library, and
vLLM and torch once asked to load. Protocol: one JSON object per line on stdin, one answer per line
on stdout, `{"ok": true, ...}` or `{"ok": false, "error": ..., "traceback": ...}`; EOF ends it.
Everything else the process or vLLM's subprocesses print goes to stderr, so logs cannot corrupt the
protocol. Requests (`op`):

- `hello`: the interpreter, and vLLM's version and import time (none of vLLM with `--dry`).
- `open`: load the model (`startup_s`: `LLM(...)` plus a one-token request), run one full-size
  warm-up pass (`warmup_s`), measure the matmul peak; takes the workload and engine settings.
- `run`: one timed pass over the opened workload, prefix cache emptied first: `seconds`, `outputs`.
- `latency`: seconds per decode step of the first `batch` opened prompts decoding `steps` tokens
  together (`inflight bench engine --latency`).
- `close`: a second matmul peak, peak RSS of this process tree (MiB, summed over processes).

`--dry` answers `hello` without importing vLLM and refuses the rest: the protocol can be tested with
any Python.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

_STATE: dict[str, Any] = {}


def _open_protocol() -> TextIO:
    """Keep the real stdout for answers; point fd 1 (inherited by vLLM's processes) at stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


def _hello(request: dict[str, Any], dry: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable, "dry": dry}
    if not dry:
        start = time.perf_counter()
        import vllm

        info.update(vllm=vllm.__version__, import_s=time.perf_counter() - start)
    return info


def _params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def _generate(prompts: list[list[int]], output_lens: list[int]) -> tuple[float, list[list[int]]]:
    from vllm.inputs import TokensPrompt

    llm = _STATE["llm"]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [_params(n) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def _matmul_peak(dtype: str) -> float:
    """The project's matmul peak for a dtype name: `matmul_peak.py` beside this script (torch only),
    loaded from its file (this folder is off sys.path, see the end of this file)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location(
        "inflight_matmul_peak", Path(__file__).with_name("matmul_peak.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.matmul_peak_flops(getattr(torch, dtype))


def _open(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm import LLM

    torch.set_num_threads(request["threads"])
    prompts, lens = request["prompts"], request["output_lens"]
    _STATE["work"] = (prompts, lens)
    start = time.perf_counter()
    _STATE["llm"] = LLM(
        model=request["model_dir"],
        dtype=request["dtype"],
        seed=request["seed"],
        max_num_seqs=request["max_num_seqs"],
        max_num_batched_tokens=request["max_num_batched_tokens"],
        skip_tokenizer_init=True,  # token-id prompts and outputs: no tokenizer needed
        **request.get("kwargs", {}),
    )
    _generate(prompts[:1], [1])
    startup_s = time.perf_counter() - start
    warmup_s, _ = _generate(prompts, lens)
    return {
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "peak_flops": [_matmul_peak(request["dtype"])],
        "dtype": request["dtype"],
    }


def _run(request: dict[str, Any]) -> dict[str, Any]:
    _STATE["llm"].reset_prefix_cache()  # the same prompts again must not hit the cache
    seconds, outputs = _generate(*_STATE["work"])
    return {"seconds": seconds, "outputs": outputs}


def _latency(request: dict[str, Any]) -> dict[str, Any]:
    """Seconds per decode step of the first `batch` opened prompts decoding `steps` tokens together:
    (time of `steps` tokens - time of 1) / (steps - 1), the prefix cache emptied before each."""
    prompts, steps = _STATE["work"][0][: request["batch"]], request["steps"]
    times = []
    for tokens in (1, steps):
        _STATE["llm"].reset_prefix_cache()
        times.append(_generate(prompts, [tokens] * len(prompts))[0])
    return {"per_step_s": (times[1] - times[0]) / (steps - 1)}


def _tree_peak_rss_mib() -> dict[str, float]:
    """VmHWM of this process and every live descendant, in MiB, by pid."""
    peaks = {str(os.getpid()): resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for pid in _descendants(os.getpid()):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks[str(pid)] = int(line.split()[1]) / 1024
    return peaks


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat:
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, frontier = [], [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _close(request: dict[str, Any]) -> dict[str, Any]:
    peaks = _tree_peak_rss_mib()
    return {
        "peak_flops_after": _matmul_peak(request["dtype"]),
        "peak_rss_mib": sum(peaks.values()),
        "peak_rss_mib_by_pid": peaks,
    }


_OPS = {"open": _open, "run": _run, "latency": _latency, "close": _close}


def _answer(request: dict[str, Any], dry: bool) -> dict[str, Any]:
    op = request.get("op")
    if op == "hello":
        return _hello(request, dry)
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; known: hello, {', '.join(_OPS)}")
    if dry:
        raise RuntimeError(f"op {op!r} needs vLLM; this worker runs with --dry")
    return _OPS[op](request)


def serve(requests: TextIO, answers: TextIO, dry: bool = False) -> None:
    """Answer each request line until EOF."""
    for line in requests:
        if not line.strip():
            continue
        try:
            reply = {"ok": True, **_answer(json.loads(line), dry)}
        except Exception as exc:  # the client shows it, with vLLM's log
            reply = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


def main() -> None:
    """Serve stdin until EOF (`--dry`: without vLLM)."""
    # run as a script, its folder leads sys.path: our `common.py` & co. must not shadow vLLM's imports
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    answers = _open_protocol()
    serve(sys.stdin, answers, dry="--dry" in sys.argv[1:])
    _STATE.clear()  # vLLM's shutdown runs while the interpreter is still whole


if __name__ == "__main__":
    main()
