// SGLDiffusion web extension, the Cache-DiT node (SGLDiffusionCacheDiT); the KSampler's run panel is in
// sgldiffusion.js.
//
// * Its advanced fields (Fn, Bn, ..., steps_mask) are shown only while `advanced` is on: a preset needs three
//   widgets, not fourteen. Frontends that know `widget.hidden` (1.32 and later) leave a hidden widget out of
//   drawing and clicks; in older ones the fields stay visible. A field fed by a link stays visible.
// * Hovering the preset widget shows a line per preset to use (its measured speedup and how close the picture stays,
//   from engine/features/cache/measured.json, put into the tooltip by the node), the selected preset marked.
//
// Only stable extension APIs: app.registerExtension (beforeRegisterNodeDef), onNodeCreated, onConfigure and
// a widget's callback.

const comfyAPI = window.comfyAPI ?? {};
const app = comfyAPI.app?.app ?? (await import("../../scripts/app.js")).app;

const CACHE_NODE = "SGLDiffusionCacheDiT";

// -- the advanced fields ---------------------------------------------------------------------------------------
const CACHE_BASIC = new Set(["enabled", "preset", "advanced"]);
// Frontend 1.32 leaves hidden widgets out of computeSize but not out of its widget layout (arrange): a hidden
// widget also measures 0 there (its own computeSize, if it had one, comes back when it is shown).
function hideSize(w, hide) {
  if (hide) {
    if (!("__sgldSize" in w)) w.__sgldSize = Object.getOwnPropertyDescriptor(w, "computeSize") ?? null;
    w.computeSize = () => [0, -4];
  } else if ("__sgldSize" in w) {
    if (w.__sgldSize) Object.defineProperty(w, "computeSize", w.__sgldSize);
    else delete w.computeSize;
    delete w.__sgldSize;
  }
}

// `fit`: also when nothing changed (a loaded workflow's size may be from when the fields were shown).
function showAdvancedFields(node, fit = false) {
  const on = !!node.widgets?.find((w) => w.name === "advanced")?.value;
  let changed = false;
  for (const w of node.widgets ?? []) {
    if (CACHE_BASIC.has(w.name)) continue;
    const linked = node.inputs?.some((i) => i.widget?.name === w.name && i.link != null);
    const hide = !on && !linked;
    if (!!w.hidden !== hide) {
      w.hidden = hide;
      hideSize(w, hide);
      changed = true;
    }
  }
  if (!changed && !fit) return;
  try {
    const want = node.computeSize?.();
    if (want && node.size) node.setSize?.([Math.max(node.size[0], want[0]), want[1]]);
  } catch (e) {
    /* a size we cannot compute is not worth an error */
  }
  node.setDirtyCanvas?.(true, true);
  app.graph?.setDirtyCanvas?.(true, true);
}

// -- the preset's tooltip --------------------------------------------------------------------------------------
// nodes/cache_dit.py writes a few lines, one per preset to use ("balanced: ..."): the selected preset's is marked.
function presetTooltip(base, value) {
  return String(base ?? "").split("\n").map((line) => (line.startsWith(`${value}:`) ? `▶ ${line}` : line)).join("\n");
}

// -- extension -------------------------------------------------------------------------------------------------
app.registerExtension({
  name: "sgldiffusion.cache",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== CACHE_NODE) return;
    const base = nodeData.input?.required?.preset?.[1]?.tooltip;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      const r = onConfigure?.apply(this, arguments);
      showAdvancedFields(this, true); // a loaded workflow sets the values without the widgets' callbacks
      return r;
    };
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      const node = this;
      const adv = this.widgets?.find((x) => x.name === "advanced");
      if (adv) {
        const callback = adv.callback;
        adv.callback = function () {
          const out = callback?.apply(this, arguments);
          showAdvancedFields(node);
          return out;
        };
        showAdvancedFields(this);
      }
      const w = this.widgets?.find((x) => x.name === "preset");
      if (w && base) {
        Object.defineProperty(w, "tooltip", {
          configurable: true,
          enumerable: true,
          get: () => presetTooltip(base, w.value),
          set: () => {},
        });
      }
      return r;
    };
  },
});
