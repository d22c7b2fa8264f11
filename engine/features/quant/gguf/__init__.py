"""GGUF, one weight-format package: ``numerics`` (bytes <-> values of the 13 block types ERNIE-Image files use),
``linear`` (``GGUFLinear`` and the ten block types' entries in the format table, ../registry.py) and ``convert``
(``sgld quantize --format q4_k``: the .gguf writer of the writer table). Importing the package registers both.

The file reader stays in engine/io/gguf.py with the other readers: io sits below features (the checkpoint
opener and the architecture check read a .gguf header with no feature imported), and what it knows of the
format is the byte layout the `gguf` package tables (GGML_QUANT_SIZES); it reports each tensor's kind (its
block type's name, ``kind(key)``), which this package's entries claim. Why and how: docs/quantization.md."""
from . import convert, linear  # noqa: F401  (registers the block types, then the .gguf writer)
