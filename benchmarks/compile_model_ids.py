"""Which model ids' decoder blocks compile, and how: per id of the registry, its tiny test config
(tests/support/tiny_models.py) run one forward and backward eager and with `parallel.compile.apply_compile` (inductor), in
one process: the blocks compiled, dynamo's graphs and graph breaks (with the first reasons), and the loss and
gradient norm of the compiled run against the eager one (relative). A failure is printed, not raised.

    python -m benchmarks.compile_model_ids [ID ...]   (from the repository root; all ids by default)
"""
from __future__ import annotations

import copy
import sys
import time

import torch


def probe(model_id: str) -> None:
    from torch._dynamo.utils import counters

    from fsdp2_backend.config import Config
    from fsdp2_backend.models.registry import model_spec
    from fsdp2_backend.parallel.compile import apply_compile
    from tests.support.tiny_models import TINY_CONFIGS

    torch._dynamo.reset()
    counters.clear()
    hf_config, spec = TINY_CONFIGS[model_id](), model_spec(model_id)
    torch.manual_seed(0)
    model = spec.build(hf_config)
    if spec.configure is not None:
        config = Config()
        config.model.model_id, config.optimization.moe_grouped_gemm = model_id, True
        spec.configure(model, config, "cpu")
    compiled = copy.deepcopy(model)
    ids = torch.randint(0, hf_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(m):
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in m.parameters() if p.grad is not None))
        return out.loss.item(), norm.item()

    loss, norm = step(model)
    blocks = apply_compile(compiled)
    start = time.perf_counter()
    try:
        c_loss, c_norm = step(compiled)
        result = f"loss {abs(c_loss - loss) / abs(loss):.1e}  grad norm {abs(c_norm - norm) / abs(norm):.1e}"
    except Exception as exc:  # noqa: BLE001 - a probe: say what failed and go on
        result = f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    breaks = counters["graph_break"]
    print(f"{model_id:22s} blocks {len(blocks):2d}  graphs {counters['stats'].get('unique_graphs', 0):3d}  "
          f"graph breaks {sum(breaks.values()):3d}  compiled vs eager: {result}  ({time.perf_counter() - start:.0f} s)",
          flush=True)
    for reason, count in list(breaks.items())[:3]:
        print(f"    {count:3d} x {' '.join(reason.split())[:150]}", flush=True)


def main() -> None:
    from tests.support.tiny_models import TINY_CONFIGS

    for model_id in sys.argv[1:] or TINY_CONFIGS:
        probe(model_id)


if __name__ == "__main__":
    main()
