"""Source as a reviewer reads it: highlighted lines, and a side-by-side diff of two files.

Lines are highlighted by pygments token by token (a token spanning lines, a docstring say, is
split at each newline) so every line is a complete, escaped HTML fragment; the diff is difflib's
opcodes over those lines, long unchanged stretches folded to their context.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache

from markupsafe import Markup, escape
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer
from pygments.token import STANDARD_TYPES

CONTEXT = 6
CSS_SCOPE = ".hl"
STYLE = "friendly"


@lru_cache(maxsize=1)
def pygments_css() -> str:
    return HtmlFormatter(style=STYLE).get_style_defs(CSS_SCOPE)


def _css_class(ttype) -> str:
    while ttype not in STANDARD_TYPES:
        ttype = ttype.parent
    return STANDARD_TYPES[ttype]


def highlight_lines(text: str) -> list[Markup]:
    """One escaped, highlighted HTML fragment per line of `text` (Python)."""
    lines: list[list[str]] = [[]]
    for ttype, value in PythonLexer(stripnl=False, ensurenl=False).get_tokens(text):
        cls = _css_class(ttype)
        for i, piece in enumerate(value.split("\n")):
            if i:
                lines.append([])
            if piece:
                lines[-1].append(f'<span class="{cls}">{escape(piece)}</span>' if cls
                                 else str(escape(piece)))
    if text.endswith("\n") and lines and not lines[-1]:
        lines.pop()
    return [Markup("".join(parts)) for parts in lines]


@dataclass(frozen=True)
class DiffRow:
    """One row of the side-by-side table; `kind` is equal, replace, delete, insert or fold."""

    kind: str
    left_no: int | None = None
    left: Markup = Markup("")
    right_no: int | None = None
    right: Markup = Markup("")
    folded: int = 0


@dataclass(frozen=True)
class SideBySide:
    left_label: str
    right_label: str
    rows: tuple[DiffRow, ...]
    added: int
    removed: int

    @property
    def identical(self) -> bool:
        return not self.added and not self.removed


def side_by_side(old: str, new: str, left_label: str, right_label: str,
                 context: int = CONTEXT) -> SideBySide:
    a, b = old.splitlines(), new.splitlines()
    ha, hb = highlight_lines(old), highlight_lines(new)
    ha += [Markup("")] * (len(a) - len(ha))
    hb += [Markup("")] * (len(b) - len(hb))
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    rows: list[DiffRow] = []
    added = removed = 0
    shown_to = 0  # first old line not yet shown or folded
    for group in matcher.get_grouped_opcodes(context):
        start = group[0][1]
        if start > shown_to:
            rows.append(DiffRow("fold", folded=start - shown_to))
        for tag, i1, i2, j1, j2 in group:
            removed += i2 - i1 if tag in ("replace", "delete") else 0
            added += j2 - j1 if tag in ("replace", "insert") else 0
            rows += _rows(tag, range(i1, i2), range(j1, j2), ha, hb)
        shown_to = group[-1][2]
    if a and shown_to < len(a) and rows:
        rows.append(DiffRow("fold", folded=len(a) - shown_to))
    return SideBySide(left_label, right_label, tuple(rows), added, removed)


def _rows(tag: str, left: range, right: range, ha: list[Markup], hb: list[Markup]
          ) -> list[DiffRow]:
    out = []
    for k in range(max(len(left), len(right))):
        i = left[k] if k < len(left) else None
        j = right[k] if k < len(right) else None
        kind = tag if tag != "replace" else ("replace" if i is not None and j is not None
                                             else ("delete" if j is None else "insert"))
        out.append(DiffRow(kind, i + 1 if i is not None else None,
                           ha[i] if i is not None else Markup(""),
                           j + 1 if j is not None else None,
                           hb[j] if j is not None else Markup("")))
    return out
