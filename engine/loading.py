"""The public loader: ``load_model`` (``engine.load_model``, the bare DiT), ``plan_load`` (what a load decides
from the header) and ``estimate_bytes``. It composes the one load loop (io/load.py) with the weight formats'
transform (features/quant/loading.py), so it sits above both and not inside the quant feature."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

from .errors import CheckpointError
from .features.quant import QuantPlan, QuantTransform
from .features.quant.gguf_linear import GGUF_MODULES
from .io.checkpoint import open_checkpoint
from .io.load import LoadPlan, build_model
from .models.family import families, family_of


def plan_load(checkpoint, dtype=None, quant: Optional[str] = None,
              shard: Optional[Tuple[int, int]] = None) -> LoadPlan:
    """Everything a load decides from the header (``config``, ``dtype``, ``bytes_at_rest()``), with
    quantization; ``.read(device)`` then loads. ``checkpoint``: a path or an opened Checkpoint."""
    ckpt = open_checkpoint(checkpoint)
    plan = QuantPlan(ckpt)
    gguf_only = bool(plan.layers) and all(v["kind"] in GGUF_MODULES for v in plan.layers.values()) and plan.sources == {"gguf"}
    if shard is not None and shard[0] > 1 and plan.quantized and not gguf_only:  # GGUF bytes split by rows (gguf_linear)
        raise CheckpointError(f"{ckpt.describe()}: tensor parallel needs a dense (bf16/fp16/fp32) or GGUF checkpoint; this one is "
                              "pre-quantized. Use ulysses_degree / ring_degree / cfg_parallel, or the dense file with quant=...")
    return LoadPlan(ckpt, dtype, shard, QuantTransform(plan, quant))


def load_model(checkpoint, dtype=None, device="cpu", quant: Optional[str] = None,
               shard: Optional[Tuple[int, int]] = None) -> nn.Module:
    """Load a DiT (of a family of engine/models/, ERNIE-Image's for the release) from a .safetensors file or a diffusers folder (or an opened Checkpoint), in eval mode.

    ``dtype``: bf16 | fp16 | fp32 | None (as stored). ``quant`` (a name of the format table: "fp8", "int4",
    "int4-g64", ...): quantize the
    blocks' linear layers while loading; pre-quantized files always load quantized. ``shard`` =
    (tp_degree, tp_index): keep this tensor-parallel rank's slices only."""
    return plan_load(checkpoint, dtype, quant, shard).read(device)


def estimate_bytes(source, dtype=None, quant: Optional[str] = None) -> int:
    """Bytes of the model at rest once loaded, nothing read: ``source`` a checkpoint (a path or an opened
    Checkpoint; ``dtype`` None = as stored), or a family's config (a model built in ``dtype``, as
    ``sgld bench`` builds one)."""
    if not any(isinstance(source, f.config_class) for f in families()):
        return plan_load(source, dtype, quant).bytes_at_rest()
    transform = QuantTransform(None, quant, family_of(source))
    return sum(transform.bytes_at_rest(name, p.dtype, tuple(p.shape), dtype)
               for name, p in build_model(source).named_parameters())
