"""LoRA for the ERNIE-Image DiT: the published key formats, several LoRAs at once, merged in place with a
bit-exact restore, or a side path on FP8 / INT4 layers; attached to the model as the "lora" Patch.

formats: key formats, matching and reading a file (``read_lora``); lycoris: LyCORIS LoKr / LoHa factors;
peft: alpha from PEFT configs;
records: the restore records and the merge / restore arithmetic; state: ``LoRAState`` and the model-level
API (``apply_loras``, ``active_loras``, ``remove_loras``); files: specs and ``LoRAFileCache``; shard: a
tensor-parallel rank's slice of each update (read against the whole layers' shapes).
"""
from ...errors import LoRAError
from .files import LoRAFileCache, normalize, parse_spec
from .formats import LoRAEntry, LoRAFile, LoRATensors, key_map, read_lora, target_modules
from .records import UlpDiff, restore_mode
from .state import LoRAState, active_loras, apply_loras, remove_loras

__all__ = ["LoRAError", "LoRAEntry", "LoRAFile", "LoRAFileCache", "LoRAState", "LoRATensors", "UlpDiff", "active_loras", "apply_loras",
           "key_map", "normalize", "parse_spec", "read_lora", "remove_loras", "restore_mode", "target_modules"]
