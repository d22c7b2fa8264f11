// SGLDiffusion template cards. ComfyUI lists a custom-node pack's workflows by file name alone (GET
// /workflow_templates), and its frontend shows that name as a card's title and again, hyphens dropped, as its
// description. This extension puts each workflow's own description (its extra.sgldiffusion.description, served by
// the pack as GET /sgldiffusion/templates) on its card instead. Only a card whose description is the one the frontend
// made from the name is changed (a template of ComfyUI or of another pack keeps its own), and a frontend that draws
// its cards otherwise is left as it is.

const comfyAPI = window.comfyAPI ?? {};
const app = comfyAPI.app?.app ?? (await import("../../scripts/app.js")).app;
const api = comfyAPI.api?.api ?? (await import("../../scripts/api.js")).api;

const CARD = "template-workflow-"; // the frontend's data-testid of a template card, then the template's name
let descriptions = {}; // template name -> its description

// What the frontend shows as a custom-node template's description (its getTemplateDescription).
const fromName = (name) => name.replace(/[-_]/g, " ").trim();

function describeCards() {
  for (const card of document.querySelectorAll(`[data-testid^="${CARD}"]`)) {
    const name = card.dataset.testid.slice(CARD.length);
    const text = descriptions[name];
    const p = text && card.querySelector("p");
    if (p && p.textContent.trim() === fromName(name)) {
      p.textContent = text;
      p.title = text;
    }
  }
}

let pending = false;
function schedule() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    describeCards();
  });
}

app.registerExtension({
  name: "sgldiffusion.templates",

  async setup() {
    try {
      const r = await api.fetchApi("/sgldiffusion/templates", { cache: "no-store" });
      if (r.ok) descriptions = (await r.json()).templates ?? {};
    } catch (e) {
      return; // an older pack or an unreachable server: the cards stay as the frontend made them
    }
    if (!Object.keys(descriptions).length) return;
    // the template browser builds its cards when it opens (and again on each filter): describe them as they come
    new MutationObserver((changes) => {
      if (changes.some((c) => c.addedNodes.length)) schedule();
    }).observe(document.body, { childList: true, subtree: true });
    describeCards();
  },
});
