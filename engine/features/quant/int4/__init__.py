"""int4, one weight-format package: ``numerics`` (group-wise 4-bit quantize / pack / dequantize) and ``linear``
(``Int4Linear``, the file layout's reader, the "int4" entry). Importing it registers "int4"."""
from .linear import INT4, Int4Linear, read_int4_layers
from .numerics import INT4_GROUPS, dequantize_int4, int4_group, parse_int4, quantize_int4, unpack_int4

__all__ = ["INT4", "INT4_GROUPS", "Int4Linear", "dequantize_int4", "int4_group", "parse_int4", "quantize_int4",
           "read_int4_layers", "unpack_int4"]
