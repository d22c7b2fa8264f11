// SGLDiffusion template cards. ComfyUI lists a custom-node pack's workflows by file name alone (GET
// /workflow_templates), and its frontend shows that name as a card's title and again, hyphens dropped, as its
// description; its template browser searches a card's name, title, description and tags, so the pack's name found
// only the one workflow whose file is named after it. This extension, with what the pack serves as GET
// /sgldiffusion/templates (each workflow's own extra.sgldiffusion.description, the module ComfyUI lists them under,
// the pack's name):
// * gives the frontend's entries of the pack's workflows their description and the pack's name as a tag (shown on
//   the card's picture), so the search finds every one by the pack's name or by what its description says. The
//   entries are the frontend's workflowTemplates store, reached through the extension manager (a Pinia store);
//   a frontend that keeps them elsewhere is left as it is.
// * puts each workflow's own description on its card, where the frontend drew the one it made from a name
//   (hyphens dropped). A template of ComfyUI or of another pack keeps its own.

const comfyAPI = window.comfyAPI ?? {};
const app = comfyAPI.app?.app ?? (await import("../../scripts/app.js")).app;
const api = comfyAPI.api?.api ?? (await import("../../scripts/api.js")).api;

const CARD = "template-workflow-"; // the frontend's data-testid of a template card, then the template's name
let descriptions = {}; // template name -> its description
let pack = { module: null, name: null }; // where ComfyUI lists the templates, and the pack's name

// What the frontend shows as a custom-node template's description (its getTemplateDescription).
const shown = (text) => text.replace(/[-_]/g, " ").trim();

function describeCards() {
  for (const card of document.querySelectorAll(`[data-testid^="${CARD}"]`)) {
    const name = card.dataset.testid.slice(CARD.length);
    const text = descriptions[name];
    const p = text && card.querySelector("p");
    if (p && p.textContent !== text && [shown(name), shown(text)].includes(p.textContent.trim())) {
      p.textContent = text;
      p.title = text;
    }
  }
}

// The frontend's entries of this pack's templates: its description and the pack's name as a tag (once each).
function tagTemplates() {
  const store = app.extensionManager?._p?._s?.get?.("workflowTemplates");
  const entries = store?.enhancedTemplates;
  if (!pack.module || !Array.isArray(entries)) return;
  for (const t of entries) {
    if (t?.sourceModule !== pack.module || !(t.name in descriptions)) continue;
    t.description = descriptions[t.name];
    if (pack.name && !(t.tags ?? []).includes(pack.name)) t.tags = [...(t.tags ?? []), pack.name];
  }
}

let pending = false;
function schedule() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    tagTemplates();
    describeCards();
  });
}

app.registerExtension({
  name: "sgldiffusion.templates",

  async setup() {
    try {
      const r = await api.fetchApi("/sgldiffusion/templates", { cache: "no-store" });
      if (r.ok) {
        const body = await r.json();
        descriptions = body.templates ?? {};
        pack = { module: body.module ?? null, name: body.pack ?? null };
      }
    } catch (e) {
      return; // an older pack or an unreachable server: the cards stay as the frontend made them
    }
    if (!Object.keys(descriptions).length) return;
    // the template browser loads its entries and builds its cards when it opens (and again on each filter): tag and
    // describe them as they come, before a search reads them
    new MutationObserver((changes) => {
      if (changes.some((c) => c.addedNodes.length)) schedule();
    }).observe(document.body, { childList: true, subtree: true });
    tagTemplates();
    describeCards();
  },
});
