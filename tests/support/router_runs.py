"""The router training runs' flags under context parallelism (`router_cp_flags`) and the router losses each logged
iteration prints (`logged_losses`, `ROUTER_LOSS_NAMES`)."""
from __future__ import annotations

import re

from tests.support.megatron_lines import ROUTER_RUN_FLAGS

LOSSES = ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "global_aux_loss",
          "--moe-aux-loss-coeff", "0.01", "0.02", "0.03"]


ROUTER_LOSS_NAMES = ("lm loss", "z_loss", "load_balancing_loss", "seq_load_balancing_loss",
                     "global_load_balancing_loss")


def router_cp_flags():
    flags = list(ROUTER_RUN_FLAGS)
    i = flags.index("--train-iters")
    flags[i + 1] = "4"
    i = flags.index("--moe-aux-loss-coeff")
    del flags[i:i + 2]
    i = flags.index("--save-interval")
    flags[i + 1] = "100"
    return flags + LOSSES


def logged_losses(log):
    out = {}
    for line in log.splitlines():
        found = re.search(r" iteration\s+(\d+)/", line)
        if found:
            out[int(found.group(1))] = {name: float(v) for name, v in re.findall(r"\| ([a-z_ ]+): ([0-9.E+-]+)", line)
                                        if name in ROUTER_LOSS_NAMES}
    return out
