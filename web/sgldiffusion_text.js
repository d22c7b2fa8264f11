// Text of the run panel (web/sgldiffusion.js): the DOM helpers that keep numbers whole on a narrow node, and what a
// run ran on. Imported by that file; ComfyUI also loads it as an extension of its own, which registers nothing.

export function h(tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined) el.textContent = text;
  return el;
}

export function fmtSeconds(s) {
  if (typeof s !== "number" || !isFinite(s)) return "";
  return s < 10 ? `${s.toFixed(2)} s` : s < 120 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

// Text as nodes where each number and the word after it ("11.2 s", "12/36 blocks") are one unbreakable span.
export function glued(text) {
  return text.split(/(\d[\d.,/]*x?\s\S+)/).map((t, i) => (i % 2 ? h("span", "sgld-nb", t) : t)).filter((t) => t !== "");
}

// Items joined by " · ", each an inline block: a line breaks between items, and inside one only when it is longer
// than the line (at a space, never inside a number or between it and its unit), so a narrow node (ComfyUI's own
// KSampler) cuts no text.
export function items(tag, cls, parts) {
  const el = h(tag, cls);
  parts.filter((p) => p !== null && p !== undefined && p !== "").forEach((p, i) => {
    if (i) el.append(" · ");
    const item = h("span", "sgld-item");
    item.append(...(Array.isArray(p) ? p : [p]).flatMap((x) => (typeof x === "string" ? glued(x) : [x])));
    el.append(item);
  });
  return el;
}

// What ran, from the run's statistics (nodes/run_events.py run_stats, what the engine describes): the weights' format
// by name ("gguf q4_k + q6_k", else the dtype) and the compute dtype (why: on hover), the attention backend, the
// offload, the CPU threads (on a CPU), the GPUs; then each active LoRA with its strength. A record without some of them (an older pack's, a remote server's)
// shows what it has.
export function whatRan(s) {
  const offload = `offload ${s.offload ?? "?"}${s.offload_detail ? ` (${s.offload_detail})` : ""}`;
  const onCpu = String(s.device ?? "cpu").startsWith("cpu");
  const threads = s.threads && onCpu ? `${s.threads} CPU thread${s.threads === 1 ? "" : "s"}` : "";
  const compute = s.dtype && s.weights !== s.dtype ? `compute ${s.dtype}` : ""; // plain weights: the dtype already
  const meta = [s.weights ? `weights ${s.weights}` : `quant ${s.quant ?? "?"}`, compute, `attention ${s.attention ?? "?"}`,
                offload, threads, s.parallel ? `${s.parallel} GPUs` : ""].filter(Boolean);
  const loras = (s.loras ?? []).map(([name, strength]) => `LoRA ${name} (strength ${strength})`);
  const why = s.dtype_reason ? `${s.dtype}: ${s.dtype_reason}` : ""; // on hover: why this dtype computed
  return { meta, loras, why };
}
