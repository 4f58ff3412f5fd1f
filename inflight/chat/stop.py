"""Stop strings over token ids: where a response ends when a stop string appears in its text.

The engine samples token ids and knows nothing of strings, so a stop string is looked for in the
decoded response. The turn ends at the first stop string to be completed (as a streaming check
after every token would find it); the tokens kept are those up to and including the token that
completed it: what the model sampled, so what a trainer trains on. The text keeps the stop string
or drops it (`include_stop`, vLLM's `include_stop_str_in_output`, default off), and is cut right
after / before it even when the completing token spells more characters (vLLM does the same).

`single_token_stops` finds the stop strings that one token spells exactly: passed to the engine as
stop token ids, they end generation there instead of running on to EOS or the token budget. What
comes out is the same either way (the first occurrence of the string ends the turn).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class StopMatch:
    """A response cut at a stop string: `num_tokens` tokens kept, its `text`, the `stop` matched."""

    num_tokens: int
    text: str
    stop: str


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(position, stop string) of the stop string in `text[start:]` that is completed first (the
    smallest end; on a tie, the one that starts first), or None."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        pos = text.find(stop, start)
        if pos >= 0 and (best is None or (pos + len(stop), pos) < best[:2]):
            best = (pos + len(stop), pos, stop)
    return None if best is None else (best[1], best[2])


def truncate_at_stop(
    token_ids: Sequence[int], stops: Sequence[str], decode: Decode, include_stop: bool = False
) -> StopMatch | None:
    """Where `token_ids` (decoded with `decode`) end at the first stop string, or None when the text
    holds none. Decodes O(log n) prefixes to find the token that completed the stop string."""
    ids = list(token_ids)
    text = decode(ids)
    hit = first_stop(text, stops)
    if hit is None:
        return None
    pos, stop = hit
    end = pos + len(stop)
    wanted = text[:end]
    lo, hi = 1, len(ids)
    while lo < hi:  # the shortest prefix whose text starts with everything up to the stop's end
        mid = (lo + hi) // 2
        if decode(ids[:mid]).startswith(wanted):
            hi = mid
        else:
            lo = mid + 1
    return StopMatch(lo, wanted if include_stop else text[:pos], stop)


def single_token_stops(stops: Sequence[str], encode: Callable[[str], list[int]], decode: Decode) -> list[int]:
    """The ids of the tokens that spell one of `stops` on their own (`decode` should keep special
    tokens, so that e.g. `<|im_end|>` is found)."""
    out: list[int] = []
    for stop in stops:
        ids = encode(stop) if stop else []
        if len(ids) == 1 and decode(ids) == stop and ids[0] not in out:
            out.append(int(ids[0]))
    return out
