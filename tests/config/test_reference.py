"""The configuration reference page is generated from the schema and kept current."""

from __future__ import annotations

from pathlib import Path

from inflight.config.keys import schema_keys
from inflight.config.reference import field_docs, reference
from inflight.config.schema import TrainerConfig
from inflight.config.status import IMPLEMENTED
from inflight.train.main import config_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"


def test_the_docs_page_is_the_generated_reference():
    assert PAGE.read_text() == config_reference(), (
        "docs/reference/config.md is out of date: run `inflight train --reference > docs/reference/config.md`"
    )


def test_every_key_is_in_the_reference_with_a_meaning_or_a_reason():
    rows = {row.key: row for row in reference()}
    assert set(rows) == set(schema_keys()[0])
    for key, row in rows.items():
        assert row.text, f"{key} has no meaning (docstring) or reason in the reference"
    page = PAGE.read_text()
    assert "| `ray_address` |" in page and "## `job`" in page


def test_field_docs_are_the_strings_after_each_field():
    docs = field_docs(TrainerConfig)
    assert docs["epochs"].startswith("Passes over the training data")
    assert all(row.state != IMPLEMENTED or row.text for row in reference())
