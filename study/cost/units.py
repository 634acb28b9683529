"""Decimal byte units and bytes per element of the dtypes the cost model knows.

Units are decimal: GB = 1e9 bytes, MB = 1e6 bytes, TB = 1e12 bytes (TB/s = 1e12 bytes/s); TERA = 1e12
(TFLOP/s = 1e12 FLOP/s).
"""

GB = 1e9
MB = 1e6
TB = 1e12
TERA = 1e12

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
