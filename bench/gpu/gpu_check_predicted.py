"""The measured peak (``torch.cuda.max_memory_allocated``, from each row's window) beside the predicted one of
docs/memory.md (bench/memory/: the fake-CUDA rehearsal) for the rows both have: 8B, 1024², a Base step (CFG
batch 2). The GPU check's rows time a DiT forward, the table an ``Engine.sample`` run: the same weights and
activations, the sampler's few latents apart."""
import os
import re

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "memory.md")
# (row, words its "what" holds) -> the table's configuration
SHARED = {("off-bf16", "resident, Base step"): "Base bf16",
          ("off-bf16", "offload, 2 buffers"): "Base bf16, offload 2 buffers",
          ("off-bf16-8buf", "offload, 8 buffers"): "Base bf16, offload 8 buffers",
          ("off-fp8", "resident, Base step"): "Base fp8",
          ("off-fp8", "offload, 2 buffers"): "Base fp8, offload 2 buffers"}


def predicted(page: str = PAGE, pixels: int = 1024) -> dict:
    """configuration -> predicted peak GiB at ``pixels``² (the table of docs/memory.md)."""
    out = {}
    with open(page, encoding="utf-8") as f:
        for line in f:
            m = re.match(rf"\| ([^|]+?) \| {pixels}² \| ([0-9.]+) \|", line)
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def beside(records, page: str = PAGE) -> str:
    """One line per shared row measured in ``records`` (the report's jsonl records): measured / predicted GiB."""
    pred = predicted(page)
    lines = []
    for (row, words), label in SHARED.items():
        for rec in records:
            if rec.get("row") == row and words in rec.get("what", "") and "Base step" in rec.get("what", "") \
                    and rec.get("peak_gib") is not None and label in pred:
                lines.append(f"{label}: measured {rec['peak_gib']:.2f} GiB, predicted {pred[label]:.2f} GiB "
                             f"({rec['peak_gib'] / pred[label]:.2f}x)")
    return "peak memory, measured beside predicted (docs/memory.md): " + ("; ".join(lines) if lines else "no shared row measured")
