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
            assigned = re.search(rf"self\.{attr}\b[^=\n]*=", inspect.getsource(engine.Engine.__init__))  # annotated too
            if not hasattr(engine.Engine, attr) and not assigned:
                missing.append(f"{os.path.basename(page)}: Engine.{attr}")
        for mod, names in re.findall(r"^\s*from (engine(?:\.\w+)*) import ([\w, ]+)$", text, re.M):
            m = importlib.import_module(mod)
            missing += [f"{os.path.basename(page)}: {mod}.{n.strip()}" for n in names.split(",") if not hasattr(m, n.strip())]
        for attr in set(re.findall(r"\bengine\.(\w+)\(", text)):  # the package's function or an Engine's method
            if not hasattr(engine, attr) and not hasattr(engine.Engine, attr):
                missing.append(f"{os.path.basename(page)}: engine.{attr}")
    assert missing == []


def readme_section(title: str) -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    start = text.index(title)
    return text[start:text.index("\n#", start + len(title))]


def test_readme_tells_a_newcomer_what_to_set_and_which_comfyui_is_tested():
    """Issue 33 item 12: loader options per card size, the tested ComfyUI version, and what torch's CUDA wheel costs."""
    gpu = readme_section("### GPU quick start")
    rows = {r.split("|")[1].strip(): r for r in gpu.splitlines() if r.startswith("| ") and "GB" in r.split("|")[1]}
    assert list(rows) == ["8 GB", "12 GB", "16 GB", "24 GB"]
    from engine.config import EngineConfig
    from engine.features.offload.auto import MODES
    from engine.features.quant import FORMATS
    for row in rows.values():  # every value named in the table is one the loader and sgld take
        loader, flags = row.split("|")[2], row.split("|")[4]
        for widget, value in re.findall(r"`(\w+)` ([\w-]+)", loader):
            assert widget in EngineConfig.__dataclass_fields__, row
            assert value in {"quant": set(FORMATS) | {"none"}, "offload": set(MODES)}.get(widget, {value}), row
        for flag, value in re.findall(r"--(quant|offload) ([\w-]+)", flags):
            assert value in (FORMATS if flag == "quant" else MODES), row
    which = readme_section("### Which ComfyUI")
    assert "0.3.75" in which and "0.19" in which and "0.3.64" in which
    assert "SGLD_TORCH_INDEX_URL" in open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    assert "SGLD_TORCH_INDEX_URL" in open(os.path.join(ROOT, "README.md")).read()


def test_readmes_offline_accelerate_example_runs(capsys):
    """The README's offline `engine.accelerate` example runs as printed (in this process: diffusers is loaded)
    and shows the engine's DiT giving diffusers' picture."""
    block = readme_section("**Trying `accelerate` offline**")
    code = block[block.index("```python\n") + 10:block.index("```", block.index("```python\n") + 10)]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        import tqdm  # noqa: F401  (diffusers' progress bars go to stderr)
        exec(compile(code, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    diff = float(capsys.readouterr().out.split("largest difference:")[1])
    assert diff < 1e-4


def test_readme_lists_the_demos_vocabulary():
    """Issue 33 item 12: the README names exactly the words the demo knows, and its example caption is all known."""
    from engine.models.demo import load_demo

    tok = load_demo().tokenizer
    section = readme_section("## The demo model")
    listed = set(re.findall(r"`([a-z]+)`", section.split("Its vocabulary")[0]))
    assert listed == {w for w in tok.vocab if re.fullmatch(r"[a-z]+", w)}
    example = re.search(r'\("(a small [^"]+)"\)', section).group(1)
    assert tok.unknown_words(example) == [] and tok.unknown_words("a small red circle at the top right") != []
