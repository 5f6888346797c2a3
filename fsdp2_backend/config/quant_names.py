"""The quantisation recipe and converter names the config accepts (torch-free: validation reads them)."""

RECIPES = ("mxfp8",)
LINEAR_CONVERTER = "quantize.linear.mx"          # nn.Linear weights → MXFP8 linears
EXPERTS_CONVERTER = "quantize.moe.mx"  # stacked MoE experts (GroupedExperts) → MXFP8 grouped GEMM
CONVERTERS = (LINEAR_CONVERTER, EXPERTS_CONVERTER)
