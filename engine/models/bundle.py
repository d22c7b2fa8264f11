"""A model whose text encoder and picture codec ship inside its DiT's own file (the embedded demo), described for the
generic layers: its package registers a ``Bundle`` and threads, sampling defaults, release resolution and the
wrong-latent message ask the registry instead of naming it (issue 47)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

from ..errors import CheckpointError
from ..io.checkpoint import Checkpoint, check_architecture, open_checkpoint


@dataclass(frozen=True)
class Bundle:
    """What the generic layers ask of a bundled model (its DiT is of a registered family)."""

    name: str  # its id: a Release's kind, ``model_kind``'s answer ("demo")
    title: str  # for messages: "the demo model"
    image_size: int  # the one picture side it makes, in pixels
    named: Mapping[str, str]  # names that stand for its files ("demo", "demo-turbo" -> the shipped files)
    # (path, or None for a copy of its DiT in another format: the shipped file's text encoder; dtype=, cached=) ->
    # the model: ``encode(prompts)``, ``decode`` /
    # ``decode_float(latent)``, ``latent_shape(width, height, batch)``, ``warnings(prompts, negatives)``,
    # ``image_size``, ``dit`` (engine/image_parts.py's BundledParts wraps it)
    load: Callable[..., object]
    owns_config: Callable[[object], bool]  # a DiT configuration of its shapes (a GGUF or quantized copy of its DiT)
    owns_metadata: Callable[[str], bool]  # a file carrying its text encoder (its own metadata)
    file_defaults: Callable[[str], dict]  # a file's {"steps", "cfg", "sampler", "scheduler"}
    defaults: Mapping[str, float]  # {"steps", "cfg"} of its shipped file (what the help texts list)
    threads: int  # CPU threads its DiT runs on (its matrices are too small to share between cores)
    latent_channels: int  # the latent it denoises, for the wrong-latent message
    latent_hint: str  # that message's words: the one size it makes and the ComfyUI node that makes its latent
    # [latent_channels][3] weights taking a latent pixel to RGB in [-1, 1]: ComfyUI's previews of its own latent
    preview_rgb_factors: Callable[[], list] = list

    def model_for(self, dit: str, **options):
        """The bundled model that runs with DiT file ``dit``: that file's own parts when it carries them, else the
        shipped file's (``dit`` a copy of its DiT in another format); ``options``: ``load``'s (dtype=, cached=)."""
        return self.load(dit if self.owns_metadata(dit) else None, **options)


_BUNDLES: Dict[str, Bundle] = {}


def register_bundle(bundle: Bundle) -> Bundle:
    _BUNDLES[bundle.name] = bundle
    return bundle


def bundles() -> List[Bundle]:
    return list(_BUNDLES.values())


def bundle_named(name) -> Optional[Bundle]:
    """The bundle ``name`` stands for: its own name ("demo", a Release's kind) or one of its files' ("demo-turbo")."""
    return next((b for b in _BUNDLES.values() if isinstance(name, str) and (name == b.name or name in b.named)), None)


def named_file(source):
    """``source`` with a bundled model's file name ("demo", "demo-turbo") as its file."""
    bundle = bundle_named(source)
    return bundle.named[source] if bundle is not None and source in bundle.named else source


def bundle_of_config(config) -> Optional[Bundle]:
    """The bundle whose DiT has ``config`` (the shapes of one of its files), or None."""
    return next((b for b in _BUNDLES.values() if config is not None and b.owns_config(config)), None)


def bundle_of_file(path: str, checkpoint: Optional[Checkpoint] = None) -> Optional[Bundle]:
    """The bundle a file belongs to: one carrying its parts, or a copy of its DiT in another format (its header's
    shapes; ``checkpoint``: the file already opened); None for any other file (an unreadable one too: its loading
    says what is wrong)."""
    path = os.fspath(path)
    for bundle in _BUNDLES.values():
        if bundle.owns_metadata(path):
            return bundle
    if not os.path.isfile(path):
        return None
    try:
        return bundle_of_config(check_architecture(checkpoint or open_checkpoint(path)))
    except (CheckpointError, OSError, ValueError):
        return None
