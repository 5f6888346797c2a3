"""MoE router losses under TP 2 x EP 2 with sequence parallel (expert tensor-parallel size 1: each tp rank routes
its own sequence shard): a tiny Megatron MoE with all three load-balancing losses, the z-loss and the expert-bias
update prints the one-rank lm loss and MoE losses for 4 steps — the routers' token counts are summed over the tp ranks, the
z-loss and aux-loss gradients scaled for the tp split (`parallel/router_groups.py`), or the later steps drift."""
import pytest

from tests.support.launchers import run_pretrain
from tests.support.router_runs import ROUTER_LOSS_NAMES, logged_losses, router_cp_flags

pytestmark = pytest.mark.e2e


def test_tp2_ep2_sequence_parallel_prints_the_one_rank_lm_loss(tmp_path):
    _, log1 = run_pretrain(router_cp_flags(), tmp_path / "one")
    _, log2 = run_pretrain(router_cp_flags(), tmp_path / "tp2ep2", "--tensor-model-parallel-size", "2",
                           "--expert-model-parallel-size", "2", "--sequence-parallel", ranks=2)
    one, tp2 = logged_losses(log1), logged_losses(log2)
    assert sorted(one) == [1, 2, 3, 4] and sorted(tp2) == [1, 2, 3, 4], (log1[-1500:], log2[-1500:])
    for it in one:
        assert set(one[it]) == set(ROUTER_LOSS_NAMES), one[it]
        for name in ROUTER_LOSS_NAMES:
            assert tp2[it][name] == pytest.approx(one[it][name], rel=1e-4, abs=1e-6), (it, name, one[it], tp2[it])
