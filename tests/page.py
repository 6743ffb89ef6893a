"""A small HTML reader for the tests: tables, scripts, element ids and outside references."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any


class Page(HTMLParser):
    """Parses a whole document; raises on anything the parser reports as broken."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: dict[str, list[list[str]]] = {}  # class -> rows of cell texts
        self.scripts: list[tuple[dict[str, Any], str]] = []
        self.ids: set[str] = set()
        self.references: list[str] = []  # src / href values
        self.open: list[str] = []
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None
        self._script: tuple[dict[str, Any], list[str]] | None = None
        self.feed(text)
        self.close()
        assert not self.open, f"unclosed elements: {self.open}"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag not in ("meta", "br", "link", "img", "input"):
            self.open.append(tag)
        if "id" in found:
            self.ids.add(str(found["id"]))
        self.references += [str(found[k]) for k in ("src", "href") if k in found]
        if tag == "table":
            self._table = self.tables.setdefault(str(found.get("class")), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "script":
            self._script = (found, [])

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open[-1:]}"
        self.open.pop()
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self._table[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "script" and self._script is not None:
            self.scripts.append((self._script[0], "".join(self._script[1])))
            self._script = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._script is not None:
            self._script[1].append(data)
