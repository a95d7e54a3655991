"""Markdown (run reports, NOTES.md entries) to HTML that cannot carry active content.

Reports and notes hold text an agent wrote, so raw HTML in them is shown as text (the markdown
library's HTML passthrough is switched off), and a link or image whose URL is not http(s), a
fragment or a relative path is dropped. Relative image paths are resolved against `base` (a run's
file URL), so a report's `![plot](plots/x.png)` shows the run's plot. The page's
Content-Security-Policy forbids scripts anyway; this keeps the markup itself clean.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit

import markdown
from markdown.extensions import Extension
from markdown.treeprocessors import Treeprocessor
from markupsafe import Markup

SAFE_SCHEMES = ("http", "https")


def _safe_url(url: str) -> bool:
    parts = urlsplit(url.strip())
    if parts.scheme:
        return parts.scheme.lower() in SAFE_SCHEMES
    return not url.strip().startswith("//")


class _Urls(Treeprocessor):
    def __init__(self, md: markdown.Markdown, base: str | None) -> None:
        super().__init__(md)
        self.base = base

    def run(self, root) -> None:
        for el in root.iter():
            for attr in ("href", "src"):
                url = el.get(attr)
                if url is None:
                    continue
                if not _safe_url(url):
                    del el.attrib[attr]
                elif (attr == "src" and self.base and not urlsplit(url).scheme
                      and not url.startswith(("/", "#"))):
                    el.set(attr, f"{self.base}/{quote(url)}")
                elif attr == "src" and urlsplit(url).scheme:
                    del el.attrib[attr]  # the page loads nothing from elsewhere (no CDN, CSP)


class _NoRawHtml(Extension):
    def __init__(self, base: str | None) -> None:
        super().__init__()
        self.base = base

    def extendMarkdown(self, md: markdown.Markdown) -> None:  # noqa: N802 - the library's name
        md.preprocessors.deregister("html_block")
        md.inlinePatterns.deregister("html")
        md.treeprocessors.register(_Urls(md, self.base), "autoopt_urls", 0)


def render(text: str, base: str | None = None) -> Markup:
    """`text` (markdown) as safe HTML; relative image paths resolved against `base`."""
    md = markdown.Markdown(extensions=["tables", "fenced_code", "sane_lists", _NoRawHtml(base)],
                           output_format="html")
    return Markup(md.convert(text))
