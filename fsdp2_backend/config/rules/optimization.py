"""Rules of the `optimization.*` switches: what regional compilation does for the model. Torch-free; called once from
`validation`; its parts, in order:

What `optimization.torch_compile` (regional compilation, parallel/compile.py) cannot run with (MXFP8 weights), and
what it does for the chosen model, said once.

Every model id's decoder blocks compile (each block once, in place, before FSDP). Measured per model id on the
tiny configs (dynamo's graph-break counters, one forward and backward): the dense blocks (qwen3, mamba3, a
transformers causal LM without experts) are one graph each; every block with routed experts compiles in pieces,
because what a MoE layer does next depends on values, not shapes — the tokens each expert receives are counted
with `torch.bincount` (its output size is data to dynamo), the experts' grouped GEMM splits its rows by those
counts on the host (kernels/grouped_gemm.py runs eager for that reason), and transformers' router-logits recorder
reads a `ContextVar` dynamo cannot trace. Those breaks are not ours to remove without changing the dispatch; the
attention, norms, router and shared-expert pieces around them are compiled.
"""
from __future__ import annotations

from typing import List

from fsdp2_backend.config.model_facts import ModelFacts
from fsdp2_backend.config.quant_names import EXPERTS_CONVERTER, FLOAT8_LINEAR_CONVERTER, LINEAR_CONVERTER
from fsdp2_backend.config.schema import Config


# --- compile ---------------------------------------------------------------------------------------

def compile_errors(config: Config) -> List[str]:
    """What `optimization.torch_compile` cannot run with: the MXFP8 converters. MXFP8 linear weights
    (`quantize.linear.mx`) are a tensor subclass holding its cached quantisations, which dynamo cannot trace ("mixing
    fake modes" at the first compiled block); the MXFP8 grouped experts (`quantize.moe.mx`) size their blocks by
    the tokens each expert got, data dynamo cannot guard on. The float8 recipes (`quantize.linear.float8`) compile."""
    m = config.model
    mx = [c for c in (LINEAR_CONVERTER, EXPERTS_CONVERTER) if c in m.quant_converters]
    if config.optimization.torch_compile and m.quant_recipe_name and mx:
        return [f"optimization.torch_compile: model.quant_converters {', '.join(mx)} (MXFP8, which dynamo cannot "
                f"trace here) does not compile — turn torch_compile off for MXFP8, or use a float8 recipe "
                f"({FLOAT8_LINEAR_CONVERTER}), which compiles"]
    return []


def compile_notices(config: Config, facts: ModelFacts) -> List[str]:
    """The notice for a model whose blocks compile in pieces (routed experts); nothing otherwise."""
    if not config.optimization.torch_compile or not facts or not facts.num_experts:
        return []
    what = config.model.model_id or facts.model_type or "the model"
    return [f"optimization.torch_compile: {what}'s MoE decoder blocks compile in pieces — the token dispatch and the "
            f"experts' grouped GEMM run eager between the compiled attention, norm and router graphs (the tokens per "
            f"expert are data: torch.bincount's output size and the GEMM's group sizes; transformers' router-logits "
            f"recorder reads a ContextVar); dense blocks compile whole"]
