"""bench/RESULTS.md's generated sections: a benchmark's table between its two markers, replaced in place (written,
then renamed: never a half-written file), or appended under its heading the first time."""
from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def _markers(name: str):
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def write_section(name: str, block: str, heading: str, path: str = RESULTS) -> None:
    """Put ``block`` between ``<!-- name: begin -->`` and ``<!-- name: end -->``; ``heading`` (a title and an
    introduction, markdown) comes before the markers when the section is new."""
    begin, end = _markers(name)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    marked = f"{begin}\n{block}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + marked + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n{heading.strip()}\n\n{marked}\n"
    tmp = f"{path}.part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def section(name: str, path: str = RESULTS) -> str:
    """The block between ``name``'s markers in ``path`` ('' when the page has none)."""
    begin, end = _markers(name)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if begin not in text or end not in text:
        return ""
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")
