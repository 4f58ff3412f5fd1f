"""A stop-string case shared by the server's stop-string tests (imported explicitly)."""

from __future__ import annotations

MODEL_NAME = "tiny"  # as served by the conftest fixture


STOP_CASE = dict(model=MODEL_NAME, prompt="make a good day", max_tokens=40, temperature=0,
                 extra_body={"ignore_eos": True})  # fmt: skip


def greedy_text_and_a_stop_string(client) -> tuple[str, str]:
    """The greedy completion of STOP_CASE (openai client) and a two-character stop string taken from
    inside it (clear of partial UTF-8 characters), for tests of stop strings."""
    full = client.completions.create(**STOP_CASE).choices[0].text
    clean = [i for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert clean, f"no usable stop string in {full!r}"
    return full, full[clean[0] : clean[0] + 2]
