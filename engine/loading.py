"""The one public load module: ``load_model`` (``engine.load_model``, the bare DiT), ``plan_load`` (what a load
decides from the header), ``estimate_bytes``, ``checkpoint_shapes`` (a configuration's tensors), and what the
tables allow (``weight_file_suffixes``: the readers'; ``shardable_formats``: the weight formats a tensor-parallel
load splits). It composes the one load loop (io/load.py) with the weight formats' transform
(features/quant/transform.py), so it sits above both and not inside the quant feature."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

from .errors import CheckpointError
from .features.quant import FORMAT_TABLE, QuantPlan, QuantTransform
from .io.checkpoint import open_checkpoint
from .io.load import LoadPlan, build_model, checkpoint_shapes
from .io.readers import shard_suffixes
from .models.family import families, family_of

__all__ = ["checkpoint_shapes", "estimate_bytes", "load_model", "plan_load", "shardable_formats", "weight_file_suffixes"]


def plan_load(checkpoint, dtype=None, quant: Optional[str] = None,
              shard: Optional[Tuple[int, int]] = None) -> LoadPlan:
    """Everything a load decides from the header (``config``, ``dtype``, ``bytes_at_rest()``), with
    quantization; ``.read(device)`` then loads. ``checkpoint``: a path or an opened Checkpoint."""
    ckpt = open_checkpoint(checkpoint)
    plan = QuantPlan(ckpt)
    if shard is not None and shard[0] > 1 and plan.unshardable():  # a format with a ``split`` (GGUF's rows) shards
        raise CheckpointError(f"{ckpt.describe()}: tensor parallel needs a dense (bf16/fp16/fp32) checkpoint or one whose "
                              f"formats split ({', '.join(shardable_formats()) or 'none'}); this one is pre-quantized. "
                              "Use ulysses_degree / ring_degree / cfg_parallel, or the dense file with quant=...")
    return LoadPlan(ckpt, dtype, shard, QuantTransform(plan, quant))


def weight_file_suffixes() -> tuple:
    """The file names a model loads from (".safetensors", ".gguf": every registered checkpoint reader's)."""
    return shard_suffixes()


def shardable_formats() -> tuple:
    """The weight formats whose pre-quantized files load under tensor parallel (their entry has a ``split``)."""
    return tuple(f.name for f in FORMAT_TABLE.values() if f.split is not None)


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
