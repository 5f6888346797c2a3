"""The quantisation recipe and converter names the config accepts (torch-free: validation reads them)."""

FLOAT8_RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")  # kernels/float8.py (delayed: float8_delayed)
RECIPES = ("mxfp8",) + FLOAT8_RECIPES
LINEAR_CONVERTER = "quantize.linear.mx"          # nn.Linear weights → MXFP8 linears
EXPERTS_CONVERTER = "quantize.moe.mx"  # stacked MoE experts (GroupedExperts) → MXFP8 grouped GEMM
FLOAT8_LINEAR_CONVERTER = "quantize.linear.float8"  # nn.Linear → FP8 linears (the float8 recipes)
CONVERTERS = (LINEAR_CONVERTER, EXPERTS_CONVERTER, FLOAT8_LINEAR_CONVERTER)
MX_CONVERTERS = (LINEAR_CONVERTER, EXPERTS_CONVERTER)
