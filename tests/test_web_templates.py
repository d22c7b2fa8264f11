"""The pack's templates in ComfyUI's template browser (issue 49 item 4), in a real chromium against a real ComfyUI
0.3.75 (frontend 1.32.x; the fixtures and helpers of tests/test_web_extension.py): the pack's name typed into the
browser's search finds all of its workflows (it found the one named after the pack), and each card's picture is its
own (the any-sampler card was headed "ERNIE-Image Turbo", the ERNIE-Image cards said "(no sample image)")."""
from __future__ import annotations

import glob
import json
import os
import sys

import comfy_server as cs
import numpy as np
import pytest
from PIL import Image
from test_web_extension import ROOT, page, screenshot
from test_web_layout import close_template_browser, viewport

__all__ = ["page"]  # one browser for this module, on tests/conftest.py's comfy

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import workflow_thumbnails  # noqa: E402

WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json")))
NAMES = sorted(os.path.splitext(os.path.basename(p))[0] for p in WORKFLOWS)
PACK = "SGLDiffusion"  # the pack's name, as its nodes' category says it

OPEN = """async () => {
  await window.app.extensionManager.command.execute("Comfy.BrowseTemplates");
  for (let i = 0; i < 100 && !document.querySelector('[data-testid^="template-workflow-"]'); i++) await new Promise((r) => setTimeout(r, 100));
}"""
CARDS = """() => [...document.querySelectorAll('[data-testid^="template-workflow-"]')].map((card) => ({
  name: card.dataset.testid.slice("template-workflow-".length), text: card.innerText}))"""


def search(page, text):
    """The template browser opened and ``text`` typed into its search box as a user does; the cards it shows then."""
    page.evaluate(OPEN)
    unfiltered = len(page.evaluate(CARDS))
    box = page.locator("[role=dialog] input[placeholder='Search...']").first
    box.click()
    box.press_sequentially(text, delay=30)
    count = '[data-testid^="template-workflow-"]'
    page.wait_for_function(f"() => document.querySelectorAll('{count}').length < {unfiltered}", timeout=20_000)
    page.wait_for_timeout(500)  # the search is debounced: the last keystroke's result
    return page.evaluate(CARDS)


@pytest.mark.browser
def test_the_packs_name_finds_all_of_its_templates(comfy, page):
    with viewport(page, 1600, 1000):
        try:
            cards = search(page, PACK)
            screenshot(page, "web_templates_search.png")
        finally:
            close_template_browser(page)
    assert sorted(c["name"] for c in cards) == NAMES, cards
    for card in cards:
        with open(os.path.join(ROOT, "workflows", card["name"] + ".json")) as f:
            own = json.load(f)["extra"]["sgldiffusion"]["description"]
        assert own in card["text"] and PACK in card["text"].split("\n"), card  # its description, the pack's tag
    with viewport(page, 1600, 1000):
        try:
            by_description = search(page, "Cache-DiT")  # in the any-sampler workflow's description only, of ours
        finally:
            close_template_browser(page)
    assert "ERNIE-Image any sampler" in [c["name"] for c in by_description], by_description


# The pack's own entry in the browser's list (its folder name): each card's picture once loaded, as the page decoded it,
# scaled to 32x32 RGB, and the address it came from.
PICTURES = """async (module) => {
  await window.app.extensionManager.command.execute("Comfy.BrowseTemplates");
  const wait = async (f) => { for (let i = 0; i < 150 && !f(); i++) await new Promise((r) => setTimeout(r, 100)); return f(); };
  const nav = await wait(() => [...document.querySelectorAll("[role=dialog] *")].find((e) => e.children.length === 0
                                                                                          && e.textContent.trim() === module));
  nav.click();
  const cards = () => [...document.querySelectorAll('[data-testid^="template-workflow-"]')];
  await wait(() => cards().length && cards().every((c) => c.querySelector("img")?.naturalWidth > 0));
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = 32;
  const ctx = canvas.getContext("2d", {willReadFrequently: true});
  return cards().map((card) => {
    const img = card.querySelector("img");
    if (!img?.naturalWidth) return {name: card.dataset.testid.slice("template-workflow-".length), pixels: null};
    ctx.drawImage(img, 0, 0, 32, 32);
    return {name: card.dataset.testid.slice("template-workflow-".length), pixels: [...ctx.getImageData(0, 0, 32, 32).data]};
  });
}"""


@pytest.mark.browser
def test_each_template_card_shows_its_own_picture(comfy, page):
    requested = []
    page.on("request", lambda r: requested.append(r.url) if "/workflow_templates/" in r.url else None)
    with viewport(page, 1600, 1000):
        try:
            cards = page.evaluate(PICTURES, cs.PACK_NAME)
            screenshot(page, "web_templates_pictures.png")
        finally:
            close_template_browser(page)
    assert sorted(c["name"] for c in cards) == NAMES and all(c["pixels"] for c in cards), [c["name"] for c in cards]
    for name in NAMES:  # each card asked for the picture beside its own workflow
        assert any(url.endswith("/" + name.replace(" ", "%20") + ".jpg") for url in requested), (name, requested)
    pictures = {c["name"]: np.array(c["pixels"], dtype=np.float32).reshape(32, 32, 4)[..., :3] for c in cards}
    for i, a in enumerate(NAMES):
        for b in NAMES[i + 1:]:
            assert np.abs(pictures[a] - pictures[b]).mean() > 1.0, (a, b)  # no two cards alike


@pytest.mark.parametrize("path", [p for p in WORKFLOWS if "demo" not in p], ids=os.path.basename)
def test_an_ernie_card_is_headed_by_its_own_name(path):
    """The text card of an ERNIE-Image workflow (no weights here to draw a picture) is headed by the workflow's own
    name and claims no missing picture; the shipped JPEG is what scripts/workflow_thumbnails.py draws for it now."""
    name = os.path.splitext(os.path.basename(path))[0]
    with open(path) as f:
        title, lines = workflow_thumbnails.card_text(name, json.load(f))
    assert title.replace("\n", " ") == name and not any("no sample" in line for line in lines), (title, lines)
    drawn = np.asarray(workflow_thumbnails.thumbnail(path).convert("RGB"), dtype=np.float32)
    with Image.open(os.path.splitext(path)[0] + ".jpg") as im:
        shipped = np.asarray(im.convert("RGB"), dtype=np.float32)
    assert shipped.shape == drawn.shape and np.abs(shipped - drawn).mean() < 2.0, "run scripts/workflow_thumbnails.py"
