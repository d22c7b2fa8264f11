"""One safetensors file holds the whole demo model.

- ``diffusion_model.*``: the ERNIE-Image DiT (what ``engine.load_model`` reads; it ignores the rest);
- ``text_encoder.*``: the demo text encoder;
- metadata ``ernie_image_config`` (the DiT config, read by the engine's loader) and ``demo_config``
  (JSON: vocabulary, text-encoder config, sampling defaults, training info).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors.torch import save

from ...io.atomic import atomic_write
from ...io.readers import open_file
from ...io.safetensors import CheckpointError

DIT_PREFIX = "diffusion_model."
TE_PREFIX = "text_encoder."
DEMO_METADATA_KEY = "demo_config"


def save_demo(path: str, dit, te, tok, te_cfg, info: Optional[dict] = None, dtype=torch.float16,
              sampling: Optional[dict] = None) -> None:
    """``sampling``: the model's own sampling defaults (steps, cfg, sampler, scheduler: a distilled one's), else
    the demo's."""
    sd = {DIT_PREFIX + k: v.detach().to(dtype).contiguous() for k, v in dit.state_dict().items()}
    sd.update({TE_PREFIX + k: v.detach().to(dtype).contiguous() for k, v in te.state_dict().items()})
    config = {"vocab": tok.vocab, "text_encoder": te_cfg.to_dict(), "train": info or {}}
    if sampling:
        config["sampling"] = dict(sampling)
    meta = {"ernie_image_config": json.dumps(dit.config.to_dict()), DEMO_METADATA_KEY: json.dumps(config)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as f:
        f.write(save(sd, metadata=meta))


def read_demo_parts(path: str):
    """(demo_config dict, text-encoder state dict in float32) from a demo file."""
    f = open_file(path)
    raw = f.metadata.get(DEMO_METADATA_KEY)
    if not raw:
        raise CheckpointError(f"{path}: not a demo model file (no '{DEMO_METADATA_KEY}' metadata)")
    keys = [k for k in f.keys() if k.startswith(TE_PREFIX)]
    state = {k[len(TE_PREFIX):]: t for k, t in f.tensors(keys, dtype=torch.float32)}
    return json.loads(raw), state
