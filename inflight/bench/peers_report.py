"""What `inflight bench peers` reports from its runs: times to fixed accuracy gains with their spread,
samples/s and accuracy after against TRL's, as the issue's table (markdown, the CPU named), and the
plot of held-out accuracy against wall-clock time, one line per run.

A run's row (`peers_bench.run_side`) holds `curve` ([time s, held-out accuracy] pairs, the
evaluation before training at 0 s and the one after at the end of training), `before`, `after`,
`samples_per_s`, `steps`, `cores_busy` and `eval_problems`.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

QUIET_OTHER_SHARE = 0.05
"""Other processes' share of the CPUs above which a run's figures are flagged as from a busy machine."""

SIDE_NAMES = {"trl": "TRL GRPOTrainer", "sync": "inflight synchronous", "fully_async": "inflight fully async"}


def gain_key(points: float) -> str:
    """How a gain names its entries: `10`, `2.5`."""
    return f"{points:g}"


def time_to_gain(curve: list[list[float]], before: float, points: float) -> float | None:
    """The first time the held-out accuracy reached `before` + `points` percentage points (None: never)."""
    for t, accuracy in curve:
        if accuracy >= before + points / 100 - 1e-9:
            return t
    return None


def spread(values: list[float | None]) -> dict[str, Any]:
    """Mean, min and max of the values reached, and how many of them were (None: not reached)."""
    reached = [v for v in values if v is not None]
    if not reached:
        return {"mean": None, "min": None, "max": None, "reached": 0, "runs": len(values)}
    return {"mean": statistics.fmean(reached), "min": min(reached), "max": max(reached),
            "reached": len(reached), "runs": len(values)}


def pooled_accuracy(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The held-out accuracy after the runs pooled over their answers, and its binomial standard error."""
    n = sum(r["eval_problems"] for r in rows)
    p = sum(r["after"] * r["eval_problems"] for r in rows) / max(n, 1)
    return p, math.sqrt(p * (1 - p) / max(n, 1))


def summarize(results: dict[str, list[dict[str, Any]]], gains: list[float]) -> dict[str, Any]:
    """Per side: samples/s, times to each gain (per run and their spread), accuracy after (pooled,
    with its standard error), cores busy; and each inflight side's ratios against TRL's: how many
    times faster to each gain (TRL's mean time over the side's, both over the runs that reached it),
    samples/s over TRL's, and accuracy after minus TRL's with the standard error of that difference."""
    out: dict[str, Any] = {}
    for side, rows in results.items():
        times = {gain_key(g): [time_to_gain(r["curve"], r["before"], g) for r in rows] for g in gains}
        after, se = pooled_accuracy(rows)
        out[side] = {"samples_per_s": [r["samples_per_s"] for r in rows],
                     "samples_per_s_mean": statistics.fmean(r["samples_per_s"] for r in rows),
                     "time_to_gain": times, "time_to_gain_spread": {g: spread(v) for g, v in times.items()},
                     "after": after, "after_standard_error": se, "before": [r["before"] for r in rows],
                     "cores_busy": [r["cores_busy"] for r in rows]}
    if "trl" in out:
        trl = out["trl"]
        for side in (s for s in out if s != "trl"):
            mine = out[side]
            faster = {}
            for g in map(gain_key, gains):
                a, b = trl["time_to_gain_spread"][g]["mean"], mine["time_to_gain_spread"][g]["mean"]
                faster[g] = a / b if a is not None and b else None
            mine["vs_trl"] = {
                "times_faster_to_gain": faster,
                "samples_per_s": mine["samples_per_s_mean"] / max(trl["samples_per_s_mean"], 1e-9),
                "after_minus_trl": mine["after"] - trl["after"],
                "after_difference_standard_error": math.hypot(mine["after_standard_error"],
                                                              trl["after_standard_error"]),
            }
    return out


def _runs(values: list[float | None], fmt: str = "{:.0f}", missing: str = "not reached") -> str:
    return " / ".join(missing if v is None else fmt.format(v) for v in values)


def table(result: dict[str, Any]) -> str:
    """The markdown table of a bench result (one column per side run), the machine and settings above it."""
    summary, sides = result["summary"], [s for s in SIDE_NAMES if s in result["summary"]]
    rows = [
        ("samples/s", lambda s: _runs(summary[s]["samples_per_s"]) + _ratio(summary[s], "samples_per_s")),
        ("cores busy (whole run)", lambda s: _runs(summary[s]["cores_busy"], "{:.2f}")),
        *[(f"time to +{key} points (s)",
           lambda s, key=key: _runs(summary[s]["time_to_gain"][key]) + _faster(summary[s], key))
          for key in map(gain_key, result["gains"])],
        (f"accuracy after {budget(result)}",
         lambda s: _runs([r["after"] * 100 for r in result["results"][s]], "{:.1f}") + _gap(summary[s])),
        ("accuracy before", lambda s: _runs([b * 100 for b in summary[s]["before"]], "{:.1f}")),
        ("held-out evaluation (s each, inside the clock)",
         lambda s: _runs([r["eval_seconds"] for r in result["results"][s]], "{:.2f}", "-")),
        ("other processes (share of the CPUs)",
         lambda s: _runs([100 * r["other_cpu_share"] for r in result["results"][s]], "{:.0f}%")),
    ]
    lines = [f"| {result['workload']} | " + " | ".join(SIDE_NAMES[s] for s in sides) + " |",
             "| --- |" + " --- |" * len(sides)]
    lines += [f"| {name} | " + " | ".join(cell(s) for s in sides) + " |" for name, cell in rows]
    head = (
        f"{result['cpu']}; workload {result['workload']} ({result['describe']}); {budget(result)} of "
        f"training per run, {result['repeats']} rounds alternated "
        f"(seeds {', '.join(map(str, result['seeds']))}); "
        f"held-out evaluations every {result['eval_interval']} steps inside each side's clock "
        f"({result['eval_problems']} problems, greedy: one evaluation's standard error is about "
        f"{_one_se(result):.1f} points)"
    )
    busiest = max(r["other_cpu_share"] for rows in result["results"].values() for r in rows)
    if busiest > QUIET_OTHER_SHARE:
        head += (
            f". NOT A QUIET MACHINE: other processes used up to {busiest:.0%} of the CPUs during a run "
            "(TRL's two OpenMP threads slow down most when a core is taken)"
        )
    notes = "\n".join(f"- {n}" for n in result["not_aligned"])
    return f"{head}\n\n" + "\n".join(lines) + f"\n\nNot aligned:\n{notes}\n"


def budget(result: dict[str, Any]) -> str:
    """Each run's budget: `--steps` steps (`--seconds` the cap), else `--seconds`."""
    if result.get("steps"):
        return f"{result['steps']} steps (at most {result['seconds']:g} s)"
    return f"{result['seconds']:g} s"


def _ratio(side: dict[str, Any], key: str) -> str:
    vs = side.get("vs_trl")
    return f" ({vs[key]:.2f}x TRL)" if vs else ""


def _faster(side: dict[str, Any], gain: str) -> str:
    vs = side.get("vs_trl")
    if not vs or vs["times_faster_to_gain"][gain] is None:
        return ""
    return f" ({vs['times_faster_to_gain'][gain]:.2f}x faster than TRL)"


def _gap(side: dict[str, Any]) -> str:
    vs = side.get("vs_trl")
    if not vs:
        return ""
    se = vs["after_difference_standard_error"]
    return f" ({vs['after_minus_trl'] * 100:+.1f} vs TRL, s.e. {se * 100:.1f})"


def _one_se(result: dict[str, Any], p: float = 0.5) -> float:
    return 100 * math.sqrt(p * (1 - p) / max(result["eval_problems"], 1))


def plot(result: dict[str, Any], png: Path) -> Path:
    """Held-out accuracy against wall-clock training time, one line per run, one colour per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"trl": "tab:red", "sync": "tab:blue", "fully_async": "tab:green"}
    fig, ax = plt.subplots(figsize=(8, 5))
    for side, rows in result["results"].items():
        for i, row in enumerate(rows):
            t, acc = zip(*row["curve"], strict=True) if row["curve"] else ((), ())
            ax.plot(t, [100 * a for a in acc], color=colours[side], marker=".", alpha=0.8,
                    label=SIDE_NAMES[side] if i == 0 else None)
    ax.set_xlabel("wall-clock training time (s)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title(f"{result['workload']}: {result['cpu']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
