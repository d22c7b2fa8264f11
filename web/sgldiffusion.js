// SGLDiffusion web extension: shows on the graph what the engine did.
//
// * SGLDiffusion KSampler: while it runs, "step k of n"; after a run, a panel under the widgets with the step
//   timeline (one cell per model call: filled = computed, hollow = cached by Cache-DiT), computed / total calls, the
//   speedup measured on the wall clock, the sampling time, what ran (web/sgldiffusion_text.js: the weights' format by
//   name, the attention backend, the offload, the CPU threads, the active LoRAs) and the run's warnings. Data: the
//   node's UI output `sgld_stats` (onExecuted) and the `sgldiffusion.run` PromptServer messages (state
//   running / done / failed / interrupted). ComfyUI sends neither for a KSampler whose cached output it
//   reuses, and a reloaded page has none: then the panel asks the pack for the node's last run of this
//   graph (POST /sgldiffusion/last_runs with the graph's id and its API prompt: runs of another graph under
//   the same id are not shown), labelled "last run". A run that fails or is interrupted clears
//   the timeline; results of an earlier prompt are marked as such. The panel grows to what it shows
//   (a whole error message, every warning). Not run yet, it shows what this ComfyUI lacks of what this graph
//   needs, if anything (the same request's `compat`: a CLIPLoader of the Ministral-3 file needs ComfyUI 0.19's
//   text encoder, the demo's graph needs nothing; the nodes' descriptions name all that this ComfyUI lacks).
// * SGLDiffusion Cache-DiT: web/sgldiffusion_cache.js.
//
// Only stable extension APIs: app.registerExtension (beforeRegisterNodeDef, nodeCreated), onExecuted,
// api.addEventListener, node.addDOMWidget. Works in the frontend of ComfyUI 0.3.75 (1.32.x) and later ones.

import { fmtSeconds, h, items, whatRan } from "./sgldiffusion_text.js";

const comfyAPI = window.comfyAPI ?? {};
const app = comfyAPI.app?.app ?? (await import("../../scripts/app.js")).app;
const api = comfyAPI.api?.api ?? (await import("../../scripts/api.js")).api;

const KSAMPLER = "SGLDiffusionKSampler";
const RUN_EVENT = "sgldiffusion.run";
const WIDGET = "sgld_run";
const LAST_RUNS = "/sgldiffusion/last_runs";
const MARGIN = 4; // the DOM widget's margin inside the node
let compatNotice = ""; // what this ComfyUI lacks of what the graph shown needs (POST /sgldiffusion/last_runs), "" when nothing

// -- styles ----------------------------------------------------------------------------------------------------
const STYLE = `
.sgld-run { box-sizing: border-box; width: 100%; padding: 4px 6px; font: 11px/1.35 sans-serif;
  color: var(--input-text, #ddd); background: var(--comfy-input-bg, #222); border-radius: 6px; overflow: hidden; }
.sgld-run .sgld-head { display: flex; flex-wrap: wrap; justify-content: space-between; column-gap: 6px; }
.sgld-run .sgld-state { font-weight: 600; white-space: nowrap; }
.sgld-run .sgld-item { display: inline-block; max-width: 100%; }
.sgld-run .sgld-nb { white-space: nowrap; }
.sgld-run[data-state="done"] .sgld-state { color: #6c6; }
.sgld-run[data-state="running"] .sgld-state { color: #6af; }
.sgld-run[data-state="failed"] .sgld-state, .sgld-run[data-state="interrupted"] .sgld-state { color: #e66; }
.sgld-run[data-state="stale"] { opacity: 0.55; }
.sgld-run .sgld-timeline { display: grid; gap: 1px; margin: 3px 0; }
.sgld-run .sgld-cell { height: 10px; border-radius: 2px; box-sizing: border-box; min-width: 2px; }
.sgld-run .sgld-computed { background: #4a9eff; }
.sgld-run .sgld-cached { background: transparent; border: 1px solid #8a8a8a; }
.sgld-run .sgld-legend i { display: inline-block; width: 8px; height: 8px; margin: 0 3px 0 0; border-radius: 2px; vertical-align: -1px; }
.sgld-run .sgld-warn { color: #e9b44c; white-space: pre-wrap; word-break: break-word; }
.sgld-run .sgld-msg { white-space: pre-wrap; word-break: break-word; }
`;
function addStyle() {
  if (document.getElementById("sgld-run-style")) return;
  const el = document.createElement("style");
  el.id = "sgld-run-style";
  el.textContent = STYLE;
  document.head.appendChild(el);
}

function timelineOf(stats) {
  if (Array.isArray(stats.timeline)) return stats.timeline.map(Boolean);
  if (typeof stats.step_mask === "string") return [...stats.step_mask].map((c) => c === "x");
  return [];
}

// A node by the id the server uses: "5", or "12:5" for a node inside a subgraph (newer frontends).
function findNode(id) {
  if (id === null || id === undefined) return null;
  const graph = app.graph;
  if (!graph) return null;
  let node = graph.getNodeById?.(id) ?? graph.getNodeById?.(Number(id));
  if (node) return node;
  const parts = String(id).split(":");
  let g = graph;
  for (let i = 0; i < parts.length && g; i++) {
    node = g.getNodeById?.(parts[i]) ?? g.getNodeById?.(Number(parts[i]));
    if (!node) return null;
    if (i < parts.length - 1) g = node.subgraph;
  }
  return node ?? null;
}

function allNodes() {
  const out = [];
  const walk = (g) => {
    for (const n of g?._nodes ?? g?.nodes ?? []) {
      out.push(n);
      if (n.subgraph) walk(n.subgraph);
    }
  };
  walk(app.graph);
  return out;
}

// SGLDiffusion KSamplers, and any other sampler that ran on our comfy_model output (it has a panel by then)
function ourNodes() {
  return allNodes().filter((n) => (n.comfyClass ?? n.type) === KSAMPLER || n.__sgldPanel);
}

// -- the run panel ---------------------------------------------------------------------------------------------
class RunPanel {
  constructor(node) {
    this.node = node;
    this.el = h("div", "sgld-run");
    this.body = h("div", "sgld-body"); // its height is what the panel needs
    this.el.append(this.body);
    this.el.dataset.state = "idle";
    this.stats = null;
    this.state = "idle";
    this.prompt = null; // prompt id of what is shown
    this.height = 24;
    this.widget = node.addDOMWidget(WIDGET, "sgld_run", this.el, {
      serialize: false,
      hideOnZoom: false,
      getValue: () => undefined,
      setValue: () => {},
      getMinHeight: () => this.height,
      getMaxHeight: () => this.height,
      margin: MARGIN,
    });
    this.widget.serialize = false; // never in widgets_values nor in the API prompt
    // wrapped text (an error, warnings) is as tall as the node is narrow: measure it once laid out
    if (typeof ResizeObserver === "function") new ResizeObserver(() => this.fit()).observe(this.body);
    this.render();
  }

  // The panel's height from what it shows (once the browser has laid it out; else the estimate).
  fit() {
    const content = this.body.offsetHeight;
    if (!content) return;
    const want = Math.ceil(content) + 8 + 2 * MARGIN; // + the panel's padding and the widget's margin
    if (Math.abs(want - this.height) > 1) {
      this.height = want;
      this.resize();
    }
  }

  // a running run's progress, from ComfyUI's progress messages for this node: "step k of n"
  showProgress(value, max) {
    this.progress = { value, max };
    const steps = this.body.querySelector(".sgld-steps");
    if (steps) steps.textContent = `step ${value} of ${max}`;
  }

  set(state, stats, extra = {}) {
    this.state = state;
    if (stats !== undefined) this.stats = stats;
    this.extra = extra;
    this.render();
  }

  render() {
    const el = this.body;
    const s = this.stats;
    const state = this.state;
    el.replaceChildren();
    this.el.dataset.state = state;
    this.el.dataset.nodeId = String(this.node.id);
    this.el.dataset.prompt = this.prompt ?? "";  // whose run it shows (a restored last run has an older prompt)
    delete this.el.dataset.computed;
    delete this.el.dataset.cached;
    const head = h("div", "sgld-head");
    const label = {
      idle: "SGLDiffusion: not run yet",
      running: "running…",
      done: this.extra?.reused ? "done · reused" : this.extra?.restored ? "last run" : "done",
      failed: this.extra?.restored ? "last run: failed" : "failed",
      interrupted: this.extra?.restored ? "last run: interrupted" : "interrupted",
      stale: "earlier prompt's run",
    }[state] ?? state;
    const lab = h("span", "sgld-state", label);
    if (state === "done" && this.extra?.reused) lab.title = "ComfyUI reused this node's cached output: the run shown is the one that made it";
    if (this.extra?.restored && !this.extra?.reused) lab.title = "this node's last run of this graph, as the server recorded it (before the graph was loaded)";
    head.append(lab);
    let height = 24;
    if (state === "running") {
      this.progress = null;
      head.append(h("span", "sgld-steps", this.extra?.steps ? `${this.extra.steps} steps` : ""));
    }
    el.append(head);
    if (state === "idle" && compatNotice) {
      el.append(h("div", "sgld-warn sgld-compat", `⚠ ${compatNotice}`));
      height += 15 * Math.max(1, Math.ceil(compatNotice.length / 45));
    }
    if (state === "failed" || state === "interrupted") {
      // nothing of an earlier run stays on screen: only what happened now
      const p = this.progress;
      const stopped = p ? `stopped at step ${p.value} of ${p.max}` : "stopped before the last step";
      const msg = state === "failed" ? this.extra?.error || "the run raised an error" : `${stopped}; no timeline`;
      el.append(h("div", "sgld-msg", msg));
      height += 15 * Math.max(1, Math.ceil(msg.length / 45) + (msg.match(/\n/g) ?? []).length);
    }
    if ((state === "done" || state === "stale") && s) {
      const cells = timelineOf(s);
      const computed = cells.filter(Boolean).length;
      const cached = cells.length - computed;
      this.el.dataset.computed = String(computed);
      this.el.dataset.cached = String(cached);
      // what the cache did (calls computed of the total) first; the speedup is measured on the wall clock of
      // this machine's model calls, so another program on the same CPU/GPU lowers it: said so
      const speed = typeof s.speedup === "number" ? `${s.speedup.toFixed(2)}x wall clock` : "";
      const sp = items("span", "sgld-speed", [`${computed}/${cells.length} computed`, speed, fmtSeconds(s.sampling_seconds)]);
      sp.title = "computed / total model calls (Cache-DiT reused the rest); the speedup is measured on the wall " +
        "clock of this run's model calls against pricing every call as a computed one, so other work on the machine lowers it";
      head.append(sp);
      const perRow = cells.length <= 64 ? Math.max(cells.length, 1) : 50;
      const rows = Math.ceil(cells.length / perRow) || 0;
      const tl = h("div", "sgld-timeline");
      tl.style.gridTemplateColumns = `repeat(${perRow}, minmax(0, 1fr))`;
      cells.forEach((c, i) => {
        const cell = h("div", `sgld-cell ${c ? "sgld-computed" : "sgld-cached"}`);
        cell.title = `model call ${i + 1}: ${c ? "computed" : "cached"}`;
        tl.append(cell);
      });
      el.append(tl);
      height += rows * 11 + 6;
      const sw = (cls) => {
        const i = h("i", `sgld-cell ${cls}`);
        i.style.height = "8px";
        return i;
      };
      el.append(items("div", "sgld-legend", [[sw("sgld-computed"), `${computed} computed`],
        [sw("sgld-cached"), `${cached} cached`], s.cache ? `Cache-DiT ${s.cache.preset ?? s.cache.config ?? "on"}` : "Cache-DiT off"]));
      const ran = whatRan(s);
      const m = items("div", "sgld-meta", ran.meta);
      m.title = [...ran.meta, ran.why].filter(Boolean).join("\n");
      el.append(m);
      height += 36;
      if (ran.loras.length) el.append(items("div", "sgld-loras", ran.loras));
      height += 15 * ran.loras.length;
      for (const w of s.warnings ?? []) {
        el.append(h("div", "sgld-warn", `⚠ ${w}`));
        height += 15 * Math.max(1, Math.ceil(w.length / 45));
      }
    }
    this.height = height + 2 * MARGIN; // an estimate until fit() measures the laid-out panel
    this.resize();
    this.fit();
  }

  resize() {
    const node = this.node;
    try {
      const want = node.computeSize?.();
      if (want && node.size && (want[1] > node.size[1] || want[0] > node.size[0])) {
        node.setSize?.([Math.max(node.size[0], want[0]), Math.max(node.size[1], want[1])]);
      }
    } catch (e) {
      /* a size we cannot compute is not worth an error */
    }
    node.setDirtyCanvas?.(true, true);
    app.graph?.setDirtyCanvas?.(true, true);
  }
}

function panelOf(node, create = true) {
  if (!node) return null;
  if (!node.__sgldPanel && create && typeof node.addDOMWidget === "function") node.__sgldPanel = new RunPanel(node);
  return node.__sgldPanel ?? null;
}

// -- the last runs kept by the server ---------------------------------------------------------------------------
// A KSampler whose panel has nothing to show (a fresh page) or whose output ComfyUI reuses (no run, no
// message): its last run as the server recorded it. `reusedFor`: the prompt that reused the output.
async function restoreRuns(nodeIds = null, reusedFor = null) {
  const workflow = app.graph?.id;
  if (!workflow) return;
  let runs;
  try {
    // the graph as it is now (its API form): the pack returns only the runs of this content, so a graph
    // with the same id but other nodes or values (a template loaded again and changed) shows none of them
    const prompt = (await app.graphToPrompt())?.output ?? {};
    const r = await api.fetchApi(LAST_RUNS, {
      method: "POST",
      cache: "no-store",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ workflow, prompt }),
    });
    if (!r.ok) return;
    const body = await r.json();
    runs = body.runs ?? {};
    if (typeof body.compat === "string" && body.compat !== compatNotice) {
      compatNotice = body.compat;
      for (const node of ourNodes()) if (panelOf(node, false)?.state === "idle") panelOf(node).render();
    }
  } catch (e) {
    return; // an older pack or an unreachable server: the panel stays as it is
  }
  // the server keeps runs of SGLDiffusion KSamplers and of ComfyUI's samplers on comfy_model alike
  for (const node of allNodes()) {
    const id = String(node.id);
    const rec = runs[id];
    if (!rec && (node.comfyClass ?? node.type) !== KSAMPLER) continue;
    const panel = panelOf(node);
    if (!rec || !panel || (nodeIds && !nodeIds.includes(id))) continue;
    if (reusedFor) {
      // ComfyUI reused this node's output for `reusedFor`; what the panel shows of this page stays
      if (panel.stats && (panel.state === "done" || panel.state === "stale")) continue;
      if (rec.state !== "done") continue; // a failed run leaves no output to reuse
      panel.prompt = reusedFor;
      panel.set("done", rec, { reused: true });
    } else if (panel.state === "idle") {
      panel.prompt = rec.prompt_id ?? null;
      if (rec.state === "done") panel.set("done", rec, { restored: true });
      else if (rec.state === "failed") panel.set("failed", null, { error: rec.error, restored: true });
      else if (rec.state === "interrupted") panel.set("interrupted", null, { restored: true });
    }
  }
}

let restoreTimer = null;
function scheduleRestore() {
  // one request for all the nodes of a graph being configured
  clearTimeout(restoreTimer);
  restoreTimer = setTimeout(() => restoreRuns(), 50);
}

// -- server messages -------------------------------------------------------------------------------------------
let currentPrompt = null;

// A run of another workflow than the one shown (queued before this graph was loaded into the tab): not ours.
function otherWorkflow(record) {
  const shown = app.graph?.id;
  return !!(record?.workflow && shown && String(record.workflow) !== String(shown));
}

function onRunEvent(detail) {
  if (!detail || otherWorkflow(detail)) return;
  // from SGLDiffusion KSampler, or from any sampler on the Model Loader's comfy_model output
  const node = findNode(detail.node);
  const panel = panelOf(node);
  if (!panel) return;
  panel.prompt = detail.prompt_id ?? currentPrompt;
  if (detail.state === "running") panel.set("running", null, { steps: detail.steps });
  else if (detail.state === "done") panel.set("done", detail);
  else if (detail.state === "failed") panel.set("failed", null, { error: detail.error });
  else if (detail.state === "interrupted") panel.set("interrupted", null);
}

// The prompt stopped (error or interrupt): the node where it stopped shows that; the others keep what
// they show only if it belongs to this prompt, else it is marked as an earlier run.
function onPromptStopped(kind, detail) {
  const pid = detail?.prompt_id ?? currentPrompt;
  const where = detail?.node_id ?? detail?.node ?? null;
  for (const node of ourNodes()) {
    const panel = panelOf(node, false);
    if (!panel) continue;
    const here = where !== null && String(where) === String(node.id);
    if (here || (panel.state === "running")) {
      if (kind === "interrupted") panel.set("interrupted", null);
      else panel.set("failed", null, { error: (here && detail?.exception_message) || panel.extra?.error || "the run raised an error" });
      panel.prompt = pid;
    } else if (panel.stats && panel.prompt !== pid && panel.state === "done") {
      panel.set("stale");
    }
  }
}

// -- extension -------------------------------------------------------------------------------------------------
app.registerExtension({
  name: "sgldiffusion.web",

  async setup() {
    addStyle();
    api.addEventListener(RUN_EVENT, (e) => onRunEvent(e.detail));
    api.addEventListener("progress", (e) => {
      const panel = panelOf(findNode(e.detail?.node), false);
      if (panel && panel.state === "running") panel.showProgress(e.detail.value, e.detail.max);
    });
    api.addEventListener("execution_start", (e) => {
      currentPrompt = e.detail?.prompt_id ?? null;
    });
    api.addEventListener("execution_cached", (e) => {
      const pid = e.detail?.prompt_id ?? currentPrompt;
      const ours = [];
      for (const id of e.detail?.nodes ?? []) {
        const node = findNode(id);
        const panel = panelOf(node, false);
        if (panel) panel.reusedFor = pid;
        if (node && ((node.comfyClass ?? node.type) === KSAMPLER || node.__sgldPanel)) ours.push(String(id));
      }
      // reused without a run and without a message: a panel with nothing of this page gets the server's record
      if (ours.length) restoreRuns(ours, pid);
    });
    api.addEventListener("execution_success", (e) => {
      // ComfyUI reused the node's cached output (it may not even re-send it): what it shows is this prompt's result
      const pid = e.detail?.prompt_id ?? currentPrompt;
      for (const node of ourNodes()) {
        const panel = panelOf(node, false);
        if (panel && panel.reusedFor === pid && (panel.state === "done" || panel.state === "stale") && panel.stats && panel.prompt !== pid) {
          panel.prompt = pid;
          panel.set("done", undefined, { reused: true });
        }
      }
    });
    api.addEventListener("execution_error", (e) => onPromptStopped("failed", e.detail));
    api.addEventListener("execution_interrupted", (e) => onPromptStopped("interrupted", e.detail));
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name === KSAMPLER) {
      const onExecuted = nodeType.prototype.onExecuted;
      nodeType.prototype.onExecuted = function (output) {
        const r = onExecuted?.apply(this, arguments);
        const stats = output?.sgld_stats?.[0];
        if (stats && !otherWorkflow(stats)) {
          const panel = panelOf(this);
          if (!panel) return r;
          const reused = panel.reusedFor !== undefined && panel.reusedFor === currentPrompt;
          panel.prompt = currentPrompt;
          panel.set("done", stats, { reused });
        }
        return r;
      };
    }
  },

  // a workflow was loaded (page load, tab switch, template): its KSamplers show their last runs
  async afterConfigureGraph() {
    scheduleRestore();
  },

  nodeCreated(node) {
    if ((node.comfyClass ?? node.type) !== KSAMPLER) return;
    const panel = panelOf(node);
    if (!panel) return;
    // the id is known only once the node is in a graph (added, or configured from a workflow)
    for (const hook of ["onAdded", "onConfigure"]) {
      const orig = node[hook];
      node[hook] = function () {
        const r = orig?.apply(this, arguments);
        panel.el.dataset.nodeId = String(this.id);
        if (hook === "onConfigure") scheduleRestore();
        return r;
      };
    }
  },
});
