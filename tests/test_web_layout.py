"""The shipped workflows' layout and the run panel's second round (issue 25) in a real browser against a real
ComfyUI 0.3.75 (frontend 1.32.x; the fixtures and helpers of tests/test_web_extension.py, a server and a
browser of this module's own): nothing lies where the KSampler's panel grows, computed from the workflow
files and measured in the page with the panel at its largest; a graph loaded again under the same workflow
id but changed shows no run of the old one; the Cache-DiT node shows its advanced fields only when
`advanced` is on; no node's source badge lies on another node and every title is whole (issue 49 item 5).
Screenshots go to test-artifacts/."""
from __future__ import annotations

import contextlib
import glob
import json
import os

import pytest
from test_web_extension import (
    DEMO_WORKFLOW,
    KSAMPLER,
    LOAD,
    LONG_ERROR,
    PANEL,
    QUEUE_UI,
    RECORD_EVENTS,
    ROOT,
    close_error_dialog,
    open_page,
    page,
    prompt_id,
    screenshot,
    wait_state,
)

__all__ = ["page"]  # one browser for this module, on tests/conftest.py's comfy


# -- from the workflow files -------------------------------------------------------------------------------------
TITLE = 30  # LiteGraph.NODE_TITLE_HEIGHT: a node's title bar sits above its pos
GAP = 40  # room beside a KSampler's column: the panel may widen the node to what it needs (RunPanel.resize)


def node_rects(wf):
    """{node id: (type, [left, top, right, bottom])} of a UI-format workflow, title bars included."""
    return {n["id"]: (n["type"], [n["pos"][0], n["pos"][1] - TITLE, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1]])
            for n in wf["nodes"]}


def overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json"))), ids=os.path.basename)
def test_shipped_workflows_leave_room_for_the_panel(path):
    """No two nodes overlap, and nothing lies below an SGLDiffusion KSampler in its column: the run panel
    (web/sgldiffusion.js) grows the node downwards to what it shows (every warning, a whole error message:
    no upper bound), so at its largest it covers the column from the node's top down."""
    with open(path) as f:
        rects = node_rects(json.load(f))
    items = sorted(rects.items())
    assert not [(a, b) for i, (a, (_, ra)) in enumerate(items) for b, (_, rb) in items[i + 1:] if overlap(ra, rb)]
    for k, (kind, r) in items:
        if kind != KSAMPLER:
            continue
        column = [r[0] - GAP, r[1], r[2] + GAP, float("inf")]  # the node with its panel at its largest
        covered = [(n, t) for n, (t, rn) in items if n != k and overlap(column, rn)]
        assert covered == [], f"{os.path.basename(path)}: the KSampler's panel would cover {covered}"


# -- in the browser ----------------------------------------------------------------------------------------------

# Load a workflow as the frontend does (its own sizes, grown only where the frontend grows them), optionally put
# the KSampler's panel into its largest state (a long failure), then the live rectangles of every node.
LAYOUT = """async ([wf, name, error]) => {
  const app = window.app;
  await app.loadGraphData(wf, true, true, name);
  await new Promise((r) => setTimeout(r, 400));
  const ks = app.graph._nodes.find((n) => n.comfyClass === "SGLDiffusionKSampler");
  if (error) ks.__sgldPanel.set("failed", null, { error });
  await new Promise((r) => setTimeout(r, 600));  // the panel measures itself once laid out
  const T = window.LiteGraph.NODE_TITLE_HEIGHT;
  app.canvas.ds.scale = 0.55;  // the whole graph on the screenshot
  app.canvas.ds.offset = [120, 220];
  app.graph.setDirtyCanvas(true, true);
  return {ks: ks.id, panel: ks.__sgldPanel.height, nodes: app.graph._nodes.map((n) => ({id: n.id, type: n.comfyClass ?? n.type,
          rect: [n.pos[0], n.pos[1] - T, n.pos[0] + n.size[0], n.pos[1] + n.size[1]]}))};
}"""


@pytest.mark.browser
@pytest.mark.parametrize("name", ["ERNIE-Image Base.json",
                                  "ERNIE-Image Turbo.json"])
def test_panel_at_its_largest_covers_no_other_node(comfy, page, name):
    """The shipped ERNIE-Image workflows in the real frontend: with the KSampler's panel showing a long
    multi-line error (it grows the node to all of it), the node covers no other node (the VAE loader's
    vae_name widget was under it)."""
    with open(os.path.join(ROOT, "workflows", name)) as f:
        wf = json.load(f)
    out = page.evaluate(LAYOUT, [wf, name, LONG_ERROR])
    ks = next(n for n in out["nodes"] if n["id"] == out["ks"])
    assert out["panel"] > 300, out  # the long error made it tall
    covered = [n["type"] for n in out["nodes"] if n["id"] != ks["id"] and overlap(ks["rect"], n["rect"])]
    assert covered == [], (covered, out)
    items = [n for n in out["nodes"] if n["id"] != ks["id"]]
    assert not [(a["type"], b["type"]) for i, a in enumerate(items) for b in items[i + 1:] if overlap(a["rect"], b["rect"])]
    close_error_dialog(page)  # ComfyUI's "missing models" (the ERNIE-Image files are not here)
    screenshot(page, f"web_layout_{name.split(' (')[0].replace(' ', '_')}.png")


@contextlib.contextmanager
def viewport(page, width, height):
    """The page at another size for a while (the module's page is shared)."""
    size = page.viewport_size
    page.set_viewport_size({"width": width, "height": height})
    try:
        yield
    finally:
        page.set_viewport_size(size)


def open_shipped(page, path, script, shot):
    """(the workflow, what ``script`` answers) for a shipped workflow opened at 1600x1000; a screenshot named
    ``shot`` and the workflow's name."""
    with open(path) as f:
        wf = json.load(f)
    with viewport(page, 1600, 1000):
        out = page.evaluate(script, [wf, os.path.basename(path)])
        close_error_dialog(page)  # the ERNIE-Image workflows' missing models
        screenshot(page, f"{shot}_{os.path.splitext(os.path.basename(path))[0]}.png")
    return wf, out


# A workflow opened as saved (its extra.ds: the view the frontend restores), at the page's size: every node's
# rectangle on the screen (title bar included, as the frontend draws it) and the frontend's own chrome around the canvas.
SAVED_VIEW = """async ([wf, name]) => {
  const app = window.app, T = window.LiteGraph.NODE_TITLE_HEIGHT;
  await app.loadGraphData(wf, true, true, name);
  await new Promise((r) => setTimeout(r, 600));  // DOM widgets and the panel laid out, the view restored
  const c = app.canvas, box = c.canvas.getBoundingClientRect();
  const screen = (x, y) => { const [cx, cy] = c.ds.convertOffsetToCanvas([x, y]); return [box.left + cx, box.top + cy]; };
  const rect = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const chrome = {};
  for (const sel of [".side-tool-bar-container", ".workflow-tabs-container", ".actionbar-container", ".subgraph-breadcrumb"]) {
    const el = document.querySelector(sel);
    if (el && el.getBoundingClientRect().width > 0) chrome[sel] = rect(el);
  }
  return {view: [c.ds.scale, [...c.ds.offset]], free: rect(document.querySelector(".graph-canvas-panel")), chrome,
          nodes: app.graph._nodes.map((n) => ({id: n.id, type: n.comfyClass ?? n.type,
                 rect: [...screen(n.pos[0], n.pos[1] - T), ...screen(n.pos[0] + n.size[0], n.pos[1] + n.size[1])]}))};
}"""
WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, "workflows", "*.json")))


@pytest.mark.browser
@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_saved_view_shows_every_node_clear_of_the_header_and_sidebar(comfy, page, path):
    """Issue 33 item 10b: a shipped workflow opened at 1600x1000 with the view it saves (extra.ds) shows every node
    whole inside the canvas panel the frontend leaves free (below its tabs, breadcrumb and run toolbar, right of its
    sidebar), covered by none of them (at offset 0,0 the top row was under the header, the left column under the
    sidebar)."""
    wf, out = open_shipped(page, path, SAVED_VIEW, "web_saved_view")
    ds = wf["extra"]["ds"]
    assert out["view"] == [ds["scale"], ds["offset"]], out["view"]  # the frontend restored the saved view
    free = out["free"]
    assert free[0] >= out["chrome"][".side-tool-bar-container"][2] and free[1] >= out["chrome"][".workflow-tabs-container"][3]
    outside = [(n["type"], [round(v) for v in n["rect"]]) for n in out["nodes"]
               if not (free[0] <= n["rect"][0] and free[1] <= n["rect"][1] and n["rect"][2] <= free[2] and n["rect"][3] <= free[3])]
    assert outside == [], (outside, free)
    covered = [(n["type"], sel) for n in out["nodes"] for sel, r in out["chrome"].items() if overlap(n["rect"], r)]
    assert covered == [], (covered, out["chrome"])


# A workflow opened as saved, at the page's size: every node's rectangle (title bar included), the rectangle of the
# badges the frontend draws above its title bar (the pack's name on each of our nodes: LGraphNode.drawBadges), and
# whether its title is drawn whole (drawTitleText cuts it to the node's width less a title bar's height each side).
BADGES_AND_TITLES = """async ([wf, name]) => {
  const app = window.app, T = window.LiteGraph.NODE_TITLE_HEIGHT, GAP = 2;
  await app.loadGraphData(wf, true, true, name);
  await new Promise((r) => setTimeout(r, 600));
  const ctx = app.canvas.canvas.getContext("2d");
  return app.graph._nodes.map((n) => {
    const badges = (n.badges ?? []).map((b) => (typeof b === "function" ? b() : b)).filter((b) => b && b.visible !== false);
    const widths = badges.map((b) => b.getWidth(ctx) + GAP), total = widths.reduce((a, b) => a + b, 0);
    const left = n.pos[0] + (n.badgePosition === "top-left" ? 0 : n.size[0] - total);
    const top = n.pos[1] - T - GAP - Math.max(0, ...badges.map((b) => b.height));
    ctx.font = n.titleFontStyle;
    const title = String(n.getTitle?.() ?? n.title);
    return {id: n.id, type: n.comfyClass ?? n.type, title, badge: badges.map((b) => b.text).join(" "),
            rect: [n.pos[0], n.pos[1] - T, n.pos[0] + n.size[0], n.pos[1] + n.size[1]],
            badgeRect: total ? [left, top, left + total, n.pos[1] - T - GAP] : null,
            titleWidth: ctx.measureText(title).width, titleRoom: n.size[0] - 2 * T};
  });
}"""


@pytest.mark.browser
@pytest.mark.parametrize("path", WORKFLOWS, ids=os.path.basename)
def test_badges_lie_on_no_node_and_titles_are_whole(comfy, page, path):
    """Issue 49 item 5: in a shipped workflow as the frontend draws it, no node's source badge (the pack's name above
    its title bar) lies on another node (Cache-DiT's and Apply Cache-DiT's were over the loader's cfg_parallel row),
    and every title is drawn whole ("SGLDiffusion Demo Decode" was cut)."""
    _, nodes = open_shipped(page, path, BADGES_AND_TITLES, "web_badges")
    ours = [n for n in nodes if n["badgeRect"]]
    assert ours and all("SGLDiffusion" in n["badge"] for n in ours), nodes  # the badges are there to be checked
    covered = [(n["type"], o["type"]) for n in ours for o in nodes if o["id"] != n["id"] and overlap(n["badgeRect"], o["rect"])]
    assert covered == [], covered
    cut = [(n["title"], round(n["titleWidth"]), n["titleRoom"]) for n in nodes if n["titleWidth"] > n["titleRoom"]]
    assert cut == [], cut


# The longest realistic run record: 50 steps with CFG (100 calls), every field at its widest.
LONGEST_RUN = {"state": "done", "model_calls": 100, "calls_computed": 57, "speedup": 12.34, "sampling_seconds": 3599.4,
               "timeline": [i % 7 not in (1, 3, 5) for i in range(100)], "cache": {"preset": "balanced"}, "attention": "sageattention",
               "offload": "layerwise", "offload_detail": "12/36 blocks resident", "quant": "mixed", "parallel": 8,
               "weights": "gguf q4_k + q6_k", "device": "cpu", "threads": 16,
               "loras": [["a-long-style-name_v2.safetensors", 0.85], ["detail.safetensors", 1]],
               "warnings": ["steps_mask has 2 entries for a run of 100 model calls: padded with 1 (computed) to 100"]}

# A sampler node (ComfyUI's own KSampler or ours) at its default width, in the graph, its panel showing `record` as the
# server's run message would bring it (the page's api dispatches it); then every piece of text in the panel: whether it
# lies whole inside the panel, and every number in it (with its unit) on one line.
PANEL_TEXT = """async ([type, record]) => {
  const app = window.app, LG = window.LiteGraph, api = window.comfyAPI.api.api;
  const node = LG.createNode(type);
  node.pos = [-2000, -2000];  // away from the graph's nodes
  app.graph.add(node);
  app.canvas.ds.scale = 1;
  app.canvas.ds.offset = [2150, 2180];  // on the screenshot, clear of the side bar and the tabs
  app.graph.setDirtyCanvas(true, true);
  const width = node.size[0];
  api.dispatchEvent(new CustomEvent("sgldiffusion.run", {detail: {...record, node: String(node.id)}}));
  await new Promise((r) => setTimeout(r, 800));  // laid out, measured (the panel fits itself)
  const el = document.querySelector(`.sgld-run[data-node-id="${node.id}"]`);
  const box = el.getBoundingClientRect();
  const inside = (r) => r.left >= box.left - 0.5 && r.right <= box.right + 0.5 && r.top >= box.top - 0.5 && r.bottom <= box.bottom + 0.5;
  const cut = [], split = [];
  const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  for (let t = walk.nextNode(); t; t = walk.nextNode()) {
    const range = document.createRange();
    range.selectNodeContents(t);
    if (![...range.getClientRects()].every(inside)) cut.push(t.textContent);
    for (const m of t.textContent.matchAll(/\\d+(?:[./]\\d+)*x?(?:\\s(?:s|min|GPUs|computed|cached))?/g)) {
      range.setStart(t, m.index);
      range.setEnd(t, m.index + m[0].length);
      const lines = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
      if (lines.size > 1) split.push(m[0]);
    }
  }
  return {id: node.id, width, panelWidth: box.width, text: el.innerText, cut, split};
}"""


@pytest.mark.browser
@pytest.mark.parametrize("node_type", ["KSampler", KSAMPLER])
def test_run_panel_cuts_no_text_on_a_narrow_sampler(comfy, page, node_type):
    """Issue 33 item 10c: on ComfyUI's own KSampler (narrower than ours) the panel cut its text mid-number ("wall
    clock · 11."): with the longest realistic record every piece of text lies whole inside the panel, no number is
    split from itself or its unit across lines, and all of it is there (the panel wraps at the separators), what ran
    included (issue 49 item 2: the weights' format by name, the CPU threads, the LoRAs with their strengths)."""
    out = page.evaluate(PANEL_TEXT, [node_type, LONGEST_RUN])
    screenshot(page, f"web_panel_narrow_{node_type}.png")
    page.evaluate("(id) => window.app.graph.remove(window.app.graph.getNodeById(id))", out["id"])
    assert out["width"] < 400, out  # a narrow node: the default width
    assert out["cut"] == [] and out["split"] == [], out
    text = " ".join(out["text"].split())
    for part in ("57/100 computed", "12.34x wall clock", "59 min 59 s", "57 computed", "43 cached", "Cache-DiT balanced",
                 "attention sageattention", "offload layerwise (12/36 blocks resident)", "8 GPUs",
                 "weights gguf q4_k + q6_k", "16 CPU threads", "LoRA a-long-style-name_v2.safetensors (strength 0.85)",
                 "LoRA detail.safetensors (strength 1)", LONGEST_RUN["warnings"][0]):
        assert part in text, (part, out["text"])


# The pack's cards in ComfyUI's template browser: each card's title and description, and whether either is cut
# (the title is one clamped line, the description two).
TEMPLATE_CARDS = """async (pack) => {
  await window.app.extensionManager.command.execute("Comfy.BrowseTemplates");
  const wait = async (f) => { for (let i = 0; i < 100 && !f(); i++) await new Promise((r) => setTimeout(r, 100)); return f(); };
  const nav = await wait(() => [...document.querySelectorAll("[role=dialog] *")].find((e) => e.children.length === 0
                                                                                          && e.textContent.trim() === pack));
  nav.click();
  await wait(() => document.querySelector('[data-testid^="template-workflow-"]'));
  await new Promise((r) => setTimeout(r, 500));  // the web extension's descriptions (next frame)
  const cut = (e) => e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > e.clientHeight + 1;
  return [...document.querySelectorAll('[data-testid^="template-workflow-"]')].map((card) => {
    const title = card.querySelector("h3"), text = card.querySelector("p");
    return {name: card.dataset.testid.slice("template-workflow-".length), title: title.textContent, description: text.textContent,
            titleCut: cut(title), descriptionCut: cut(text)};
  });
}"""


def close_template_browser(page):
    """Its close button, the one at the dialog's top right (Escape does not close it)."""
    dialog = page.locator(".p-dialog[role=dialog]").first
    point = page.evaluate("""() => {
      const d = document.querySelector(".p-dialog[role=dialog]");
      if (!d) return null;
      const top = d.getBoundingClientRect().top;
      const b = [...d.querySelectorAll("button")].map((e) => e.getBoundingClientRect()).filter((r) => r.width && r.top < top + 80)
        .sort((a, c) => c.right - a.right)[0];
      return b ? [b.left + b.width / 2, b.top + b.height / 2] : null;
    }""")
    if point:
        page.mouse.click(*point)
        dialog.wait_for(state="hidden", timeout=5_000)


@pytest.mark.browser
def test_template_cards_show_whole_titles_and_their_own_descriptions(comfy, page):
    """Issue 33 item 10d: the pack's template cards in the real template browser: every title whole on its one line
    (the long file names were cut), and a description of the workflow's own, whole, that is not the title again (the
    frontend makes a custom template's description from its name, hyphens dropped)."""
    import comfy_server as cs

    with viewport(page, 1600, 1000):  # four cards a row, each at the grid's narrowest (15rem)
        try:
            cards = page.evaluate(TEMPLATE_CARDS, cs.PACK_NAME)
            screenshot(page, "web_template_cards.png")
        finally:
            close_template_browser(page)
    names = sorted(os.path.splitext(os.path.basename(p))[0] for p in WORKFLOWS)
    assert sorted(c["name"] for c in cards) == names, cards
    for card in cards:
        with open(os.path.join(ROOT, "workflows", card["name"] + ".json")) as f:
            own = json.load(f)["extra"]["sgldiffusion"].get("description")
        assert card["title"] == card["name"] and not card["titleCut"], card
        assert card["description"] == own and not card["descriptionCut"], card
        squeeze = lambda t: "".join(ch for ch in t.lower() if ch.isalnum())  # noqa: E731
        assert squeeze(card["name"]) not in squeeze(card["description"]), card


@pytest.mark.browser
def test_a_changed_graph_under_the_same_id_shows_no_old_run(comfy, page):
    """A template loaded again under the same workflow id but changed (another prompt here) is another graph:
    its KSampler shows none of the recorded run; the graph that ran shows it, labelled "last run", also with
    another seed (the frontend changes it after each queue)."""
    with open(DEMO_WORKFLOW) as f:
        wf = json.load(f)
    name = os.path.basename(DEMO_WORKFLOW)
    page.evaluate(RECORD_EVENTS)
    ks = page.evaluate(LOAD, [wf, name])["ksampler"]
    close_error_dialog(page)
    page.evaluate(QUEUE_UI)
    assert comfy.wait(prompt_id(page), 120)["status"]["status_str"] == "success"
    wait_state(page, ks, "done", 30_000)
    saved = page.evaluate("() => JSON.parse(JSON.stringify(window.app.graph.serialize()))")

    def load(graph):
        open_page(page, comfy)
        page.evaluate(LOAD, [graph, name])

    load(saved)
    assert "last run" in wait_state(page, ks, "done", 30_000)["text"]
    changed = json.loads(json.dumps(saved))
    text = next(n for n in changed["nodes"] if n["type"] == "SGLDiffusionDemoTextEncode" and n["widgets_values"][0])
    text["widgets_values"][0] = "a small green square at the top, on a white background"
    load(changed)
    page.wait_for_timeout(2000)  # the panel asked the server, and got nothing
    panel = page.evaluate(PANEL, ks)
    assert panel["state"] == "idle" and "not run yet" in panel["text"] and panel["mask"] == "", panel
    reseeded = json.loads(json.dumps(saved))
    next(n for n in reseeded["nodes"] if n["type"] == KSAMPLER)["widgets_values"][0] += 1
    load(reseeded)
    assert "last run" in wait_state(page, ks, "done", 30_000)["text"]


CACHE_FIELDS = """(id) => {
  const n = window.app.graph.getNodeById(Number(id)) ?? window.app.graph.getNodeById(id);
  return {height: n.size[1], shown: n.widgets.filter((w) => !w.hidden).map((w) => w.name),
          hidden: n.widgets.filter((w) => w.hidden).map((w) => w.name)};
}"""
SET_ADVANCED = """([id, on]) => {
  const n = window.app.graph.getNodeById(Number(id)) ?? window.app.graph.getNodeById(id);
  const w = n.widgets.find((x) => x.name === "advanced");
  w.value = on;
  w.callback?.(on, window.app.canvas, n);
}"""


@pytest.mark.browser
def test_cache_node_shows_its_advanced_fields_only_when_advanced_is_on(comfy, page):
    """The Cache-DiT node of the demo workflow (advanced off): only enabled / preset / advanced; switched
    on, every field, and the node grows to hold them; off again, it shrinks back."""
    with open(DEMO_WORKFLOW) as f:
        wf = json.load(f)
    page.evaluate(LAYOUT, [wf, os.path.basename(DEMO_WORKFLOW), None])
    cache = str(next(n["id"] for n in wf["nodes"] if n["type"] == "SGLDiffusionCacheDiT"))
    close_error_dialog(page)
    off = page.evaluate(CACHE_FIELDS, cache)
    screenshot(page, "web_cache_basic.png")
    assert off["shown"] == ["enabled", "preset", "advanced"] and "taylorseer_order" in off["hidden"], off
    page.evaluate(SET_ADVANCED, [cache, True])
    on = page.evaluate(CACHE_FIELDS, cache)
    assert on["hidden"] == [] and {"Fn", "Bn", "residual_diff_threshold", "taylorseer_order"} <= set(on["shown"]), on
    assert on["height"] > off["height"] + 150, (on, off)
    screenshot(page, "web_cache_advanced.png")
    page.evaluate(SET_ADVANCED, [cache, False])
    assert page.evaluate(CACHE_FIELDS, cache) == off
