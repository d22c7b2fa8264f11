"""Reading and writing weight files; importing the package registers the checkpoint readers of the table
(readers.py: safetensors; gguf.py: GGUF), so every opener sees all of them."""
from . import gguf  # noqa: F401
