"""Layer-wise offload of the DiT blocks to CPU memory (layerwise, buffers) and the ``offload="auto"``
decision with the size estimate it needs (auto)."""
from .auto import MODES, GiB, choose_call_offload, choose_offload, working_bytes
from .buffers import ALIGN
from .layerwise import LayerwiseOffload, apply_layerwise_offload, empty_host_cache, get_offload, plan_blocks, remove_offload

__all__ = ["ALIGN", "GiB", "MODES", "LayerwiseOffload", "apply_layerwise_offload", "choose_call_offload", "choose_offload", "empty_host_cache",
           "get_offload", "plan_blocks", "remove_offload", "working_bytes"]
