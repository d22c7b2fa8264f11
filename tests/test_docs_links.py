"""README.md and docs/*.md: every relative link names a file of the repository and, with a #fragment, a
heading of that file (GitHub's anchors); the README stays a short entry page whose reference lives in docs/."""
import glob
import importlib
import inspect
import os
import re

import pytest

import engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: str) -> set:
    """GitHub's heading anchors: lower case, punctuation but '-' dropped, spaces to '-' (code blocks skipped)."""
    out, fenced = set(), False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(open(page, encoding="utf-8").read()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, frag = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(dest):
            broken.append(target)
        elif frag and dest.endswith(".md") and frag not in anchors(dest):
            broken.append(target)
    assert broken == [], f"{os.path.relpath(page, ROOT)}: broken links {broken}"


def test_readme_is_an_entry_page():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert text.splitlines()[2:6] == [
        "```bash",
        'bash scripts/setup.sh && .venv/bin/sgld generate --prompt "a large red circle on the left, on a blue background" '
        "--out out.png",
        "bash scripts/test.sh",
        "```"]
    assert len(text.splitlines()) <= 300
    for section in ("## ComfyUI", "## Command line", "## Image server (`sgld serve`)", "## Python"):
        assert f"\n{section}\n" in text, section
    # the Cache-DiT reference is generated into docs/cache_dit.md, not copied by hand into the README
    assert "SGLANG_CACHE_DIT_MAX_CACHED_STEPS" not in text and "docs/cache_dit.md" in text


def test_the_engine_api_the_pages_name_exists():
    """`Engine.x` and `from engine... import x` on the pages name what the package has (docs drift when a name
    moves: `Engine.from_file` outlived its removal)."""
    missing = []
    for page in PAGES:
        text = open(page, encoding="utf-8").read()
        for attr in set(re.findall(r"\bEngine\.(\w+)", text)):
            if not hasattr(engine.Engine, attr) and f"self.{attr} =" not in inspect.getsource(engine.Engine.__init__):
                missing.append(f"{os.path.basename(page)}: Engine.{attr}")
        for mod, names in re.findall(r"^\s*from (engine(?:\.\w+)*) import ([\w, ]+)$", text, re.M):
            m = importlib.import_module(mod)
            missing += [f"{os.path.basename(page)}: {mod}.{n.strip()}" for n in names.split(",") if not hasattr(m, n.strip())]
        for attr in set(re.findall(r"\bengine\.(\w+)\(", text)):  # the package's function or an Engine's method
            if not hasattr(engine, attr) and not hasattr(engine.Engine, attr):
                missing.append(f"{os.path.basename(page)}: engine.{attr}")
    assert missing == []
