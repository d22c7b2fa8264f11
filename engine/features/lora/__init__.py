"""LoRA for a family's DiT (ERNIE-Image, Z-Image): the published key formats, several LoRAs at once, merged in
place with a bit-exact restore, or a side path on FP8 / INT4 layers; attached to the model as the "lora" Patch.

formats: key formats, matching and reading a file (``read_lora``); lycoris: LyCORIS LoKr / LoHa factors;
peft: alpha from PEFT configs;
records: the restore records and the merge / restore arithmetic; state: ``LoRAState`` and the model-level
API (``apply_loras``, ``active_loras``, ``remove_loras``); files: specs and ``LoRAFileCache``; shard: a
tensor-parallel rank's slice of each update (read against the whole layers' shapes); rows: per-request LoRAs on
their own rows of a batched forward (``RowLoRAs``, ``row_route``, ``routed``: the server's batcher).
"""
from ...errors import LoRAError
from .files import LoRAFileCache, normalize, parse_spec
from .formats import LoRAEntry, LoRAFile, LoRATensors, key_map, read_lora, target_modules
from .records import UlpDiff, restore_mode
from .rows import RowLoRAs, attach_row_loras, net, remove_row_loras, row_route
from .state import LoRAState, RowRoute, active_loras, apply_loras, remove_loras, routed

__all__ = ["LoRAError", "LoRAEntry", "LoRAFile", "LoRAFileCache", "LoRAState", "LoRATensors", "RowLoRAs", "RowRoute", "UlpDiff",
           "active_loras", "apply_loras", "attach_row_loras", "key_map", "net", "normalize", "parse_spec", "read_lora",
           "remove_loras", "remove_row_loras", "restore_mode", "routed", "row_route", "target_modules"]
