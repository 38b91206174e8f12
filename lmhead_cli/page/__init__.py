"""The page of `lmhead serve` and the scored-text view of `score --html`: one HTML file, one stylesheet
and one script, shipped inside the package (nothing is fetched from a CDN or a font service).

`asset(name)` reads one of them. Files only, importing nothing of lmhead: render/html.py inlines them
into `score --html`, and the server's serve/page.py serves them with the JSON routes the page calls."""

from __future__ import annotations

from functools import cache
from importlib import resources

ASSETS = ("index.html", "page.css", "page.js")


@cache
def asset(name: str) -> str:
    """The text of one of the page's files (index.html, page.css, page.js)."""
    if name not in ASSETS:
        raise KeyError(name)
    return (resources.files(__name__) / name).read_text(encoding="utf-8")
