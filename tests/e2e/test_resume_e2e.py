"""Resume through the real entry point: a run stopped by --exit-interval and restarted with the very same
command prints the same losses as a straight run, and a 2-rank checkpoint resumes on 1 rank."""
from tests.support.launchers import run_pretrain
from tests.support.megatron_lines import RESUME_RUN_FLAGS


def train(save_dir, *extra, ranks=1):
    return run_pretrain(RESUME_RUN_FLAGS, save_dir, *extra, ranks=ranks)


def test_exit_and_restart_prints_the_straight_runs_losses(tmp_path):
    straight, _ = train(tmp_path / "straight")
    assert sorted(straight) == list(range(1, 13))
    assert (tmp_path / "straight" / "hf" / "config.json").is_file()  # HF export once training has finished
    first, _ = train(tmp_path / "stopped", "--exit-interval", "6")
    assert sorted(first) == list(range(1, 7))
    assert not (tmp_path / "stopped" / "hf").exists()  # stopped early: no export yet
    assert (tmp_path / "stopped" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    second, log = train(tmp_path / "stopped", "--exit-interval", "6")
    assert "resuming from the newest complete checkpoint" in log
    assert sorted(second) == list(range(7, 13))
    assert (tmp_path / "stopped" / "hf" / "config.json").is_file()
    for it in range(1, 13):
        assert (first if it <= 6 else second)[it] == straight[it], it   # same consumed samples and printed loss


def test_two_ranks_save_one_rank_resumes(tmp_path):
    straight, _ = train(tmp_path / "straight")
    first, _ = train(tmp_path / "run", "--exit-interval", "6", ranks=2)
    second, _ = train(tmp_path / "run", "--exit-interval", "6", ranks=1)
    assert sorted(second) == list(range(7, 13))
    for it in range(1, 13):
        consumed, loss = (first if it <= 6 else second)[it]
        assert consumed == straight[it][0]
        assert abs(float(loss) - float(straight[it][1])) <= 1e-5 * abs(float(straight[it][1])), it
