"""Files the package ships as copies of the project's docs stay equal to them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_agents_numerics_notes_are_docs_numerics():
    from autoopt.agents.base import numerics_notes

    shipped = numerics_notes()
    header, _, body = shipped.partition("\n\n")
    assert header.startswith("<!-- A copy of docs/numerics.md")
    assert body == (ROOT / "docs" / "numerics.md").read_text()
