"""EngineConfig: the options an engine is opened with. Each field is a declared option (engine/options.py):
the checks here, the CLI's flags and the Model Loader's widgets derive from it. A feature module owns the
tuple of its choices (attention's BACKENDS, offload's MODES, ...); nothing else repeats them."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Optional, Union

from .errors import ParallelConfigError
from .features.attention import BACKENDS
from .features.compile import SHAPES
from .features.offload import MODES
from .features.quant import FORMATS, describe_formats
from .options import checked, option

if TYPE_CHECKING:  # pragma: no cover
    from .features.cache import CacheConfig

DTYPES = ("bf16", "fp16", "fp32")
PARALLEL = "parallel"  # the CLI's argument group of the degrees


@dataclass
class EngineConfig:
    dtype: Optional[str] = option(
        None, str, "compute dtype: bf16, fp16, fp32 (default: the model's fastest safe one on the device: bf16 on a GPU "
                   "or a CPU with AVX-512 BF16 / AMX, else fp32; never the file's storage)", choices=DTYPES,
        optional=True, labels={None: "default"}, aliases={"none": None, "bfloat16": "bf16", "float16": "fp16",
                                                         "float32": "fp32"},
        any_case=True, flag="--dtype", widget="weight_dtype", widget_required=True,
        tooltip="Compute dtype. 'default': the model's fastest safe dtype on this device (bf16 on a GPU, float32 on "
                "most CPUs), whatever the file stores.")
    device: str = option("cpu", str, "torch device (default: cpu)", flag="--device")  # nodes: ComfyUI's device
    # Cache-DiT (engine.features.cache.CacheConfig) of runs given none; None = off. The SGLANG_CACHE_DIT_*
    # environment is read by the entry points (CLI, server start, nodes, pipeline), never by the engine.
    cache: Optional["CacheConfig"] = None
    attention: str = option(
        "auto", str, "attention backend (default auto: sage, then flash, then sdpa; unavailable ones fall back to "
        "sdpa with a warning)", choices=BACKENDS, any_case=True, flag="--attention", widget="attention",
        tooltip="Attention backend. auto: SageAttention, then FlashAttention, then PyTorch SDPA, whichever runs here. "
                "Only backends that work on this machine are listed.")
    # False | True (= "static") | "static" (one graph per resolution) | "dynamic" (one extra graph for new sizes)
    compile: Union[bool, str] = option(
        False, str, "regional torch.compile of the DiT block (--compile = static: one graph per resolution; "
        "dynamic: one extra graph covers all new resolutions)", choices=(False, True) + SHAPES, labels={False: "off"},
        aliases={"false": False, "none": False, "": False, "on": True, "true": True}, any_case=True,
        flag="--compile", flag_const="static", widget="compile",
        tooltip="torch.compile of the transformer block. static: one graph per resolution; dynamic: one extra graph "
                "for all new resolutions. The first run at a size is slower.")
    # Pre-quantized files (sgld quantize, ComfyUI fp8) load quantized whatever this says.
    quant: Optional[str] = option(
        None, str, "quantization of the block linears at load (pre-quantized files load quantized anyway)",
        choices=FORMATS, optional=True, labels={None: "none"}, aliases={"off": None, "": None}, any_case=True,
        flag="--quant", widget="quant",
        tooltip=f"Quantization of the transformer blocks' linear layers. {describe_formats()}. "
                "Pre-quantized files load quantized whatever this says.")  # the format table's own words
    offload: str = option(
        "none", str, "layer-wise offload: block weights in pinned CPU memory, streamed through --resident-layers "
        "device buffers (auto: only when the GPU's free memory is below the model + working memory)",
        choices=MODES, aliases={None: "none", False: "none", "off": "none", "": "none"}, any_case=True,
        flag="--offload", widget="offload", widget_default="auto",
        tooltip="Layer-wise offload: transformer blocks stay in CPU memory and stream through a few GPU buffers. "
                "auto: only when the GPU has too little free memory for the whole model.")
    resident_layers: int = option(
        2, int, "device buffers for layer-wise offload (default 2: one computing, one loading)", low=1,
        flag="--resident-layers", widget="resident_layers", widget_max=64,
        tooltip="GPU layer buffers used by offload; more = faster, more VRAM.")
    # Parallelism (engine/parallel, docs/parallel.md): ranks = tp x ulysses_degree x ring_degree x (2 if
    # cfg_parallel); more than one rank runs the DiT in worker processes (one per GPU; gloo processes on CPU).
    num_gpus: Optional[int] = option(
        None, int, "ranks in all (GPUs; on a CPU machine the number of gloo processes); must equal the product of "
        "the degrees; alone it means Ulysses over that many ranks", optional=True, low=1, flag="--num-gpus",
        group=PARALLEL, widget="num_gpus", widget_default=1, widget_max=64,
        tooltip="GPUs working on one image (one worker process each). 1: this process only. The degrees below must "
                "multiply to it; with all of them at 1, N GPUs means Ulysses over N.")
    ulysses_degree: int = option(
        1, int, "Ulysses sequence parallel degree (all-to-all over heads; --sp: SGLang's name)", low=1,
        flag="--ulysses-degree", flag_aliases=("--sp",),
        group=PARALLEL, widget="ulysses_degree", widget_max=32,
        tooltip="Ulysses sequence parallel: attention heads split over this many GPUs (all-to-all).")
    ring_degree: int = option(
        1, int, "Ring sequence parallel degree (KV passed around, LSE merge)", low=1, flag="--ring-degree",
        group=PARALLEL, widget="ring_degree", widget_max=8,
        tooltip="Ring sequence parallel: keys/values passed around this many GPUs.")
    tp: int = option(
        1, int, "tensor parallel degree (heads and MLP split across ranks)", low=1, flag="--tp", group=PARALLEL,
        widget="tp", widget_max=8, tooltip="Tensor parallel: each block's weights sharded over this many GPUs.")
    cfg_parallel: bool = option(
        False, bool, "cond and uncond on different ranks (needs --cfg > 1)", flag="--cfg-parallel", group=PARALLEL,
        widget="cfg_parallel", tooltip="Run the positive and negative prompt on different GPUs (needs cfg > 1).")

    def __post_init__(self):
        for name, value in checked(self).items():
            setattr(self, name, value)
        product = self.tp * self.ulysses_degree * self.ring_degree * (2 if self.cfg_parallel else 1)
        if self.num_gpus is not None and product != 1 and self.num_gpus != product:
            raise ParallelConfigError(
                f"parallel degrees do not multiply to num_gpus: tp {self.tp} x ulysses_degree {self.ulysses_degree} x "
                f"ring_degree {self.ring_degree} x cfg {2 if self.cfg_parallel else 1} = {product}, but num_gpus = "
                f"{self.num_gpus}. Set num_gpus to {product}, or change the degrees so that their product is "
                f"{self.num_gpus}")

    @property
    def world_size(self) -> int:
        """Ranks the parallel fields ask for (1 = the single-process engine); a GPU count alone = Ulysses."""
        product = self.tp * self.ulysses_degree * self.ring_degree * (2 if self.cfg_parallel else 1)
        return self.num_gpus if product == 1 and self.num_gpus else product

    def key(self) -> tuple:
        """A hashable identity, used to cache loaded engines per (file, options)."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))
