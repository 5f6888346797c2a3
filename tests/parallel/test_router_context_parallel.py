"""MoE load-balancing losses under context parallel, as megatron-core computes them: the token counts of
`aux_loss` / `seq_aux_loss` summed over the cp group and those of `global_aux_loss` over dp x cp
(`parallel/router_groups.py`, `models/moe/router.py`). A tiny qwen3_moe with all three losses and the z-loss
prints, at cp 2 (Ulysses), the one-rank lm loss and every MoE loss of the log line for 4 steps; the gradients
agree too, or the later steps' losses would drift. With the counts of each rank's own tokens instead (the old
behaviour), the printed `load_balancing_loss` differs from the one-rank value.
"""

import pytest

from tests.support.launchers import run_pretrain
from tests.support.router_runs import ROUTER_LOSS_NAMES, logged_losses, router_cp_flags


def test_context_parallel_2_prints_the_one_rank_moe_losses(tmp_path):
    _, log1 = run_pretrain(router_cp_flags(), tmp_path / "one")
    _, log2 = run_pretrain(router_cp_flags(), tmp_path / "cp2", "--context-parallel-size", "2",
                           "--context-parallel-algo", "ulysses_cp_algo", ranks=2)
    one, cp2 = logged_losses(log1), logged_losses(log2)
    assert sorted(one) == [1, 2, 3, 4] and sorted(cp2) == [1, 2, 3, 4], (log1[-1500:], log2[-1500:])
    for it in one:
        assert set(one[it]) == set(ROUTER_LOSS_NAMES), one[it]
        for name in ROUTER_LOSS_NAMES:
            assert cp2[it][name] == pytest.approx(one[it][name], rel=1e-4, abs=1e-6), (it, name, one[it], cp2[it])
