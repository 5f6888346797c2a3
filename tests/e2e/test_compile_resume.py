"""Compiled decoder blocks through the real entry point (Megatron flags + `--optimization.torch_compile True`): a run
stopped by --exit-interval and restarted with the same command prints the straight compiled run's losses bit for
bit (resume stays exact under compile). That compiled equals eager (1e-5) is tests/parallel/test_compile_parity.py's;
each process here compiles (tens of seconds on CPU), so there are only the three runs resume needs."""
from tests.support.launchers import run_pretrain

FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 32 --max-position-embeddings 64 --micro-batch-size 2 "
         "--global-batch-size 4 --train-iters 6 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --swiglu "
         "--normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --log-interval 1 "
         "--save-interval 3 --eval-iters 0").split()
COMPILE = ("--optimization.torch_compile", "True")


def test_compiled_run_resumes_bit_exactly(tmp_path):
    straight, _ = run_pretrain(FLAGS, tmp_path / "straight", *COMPILE)
    assert sorted(straight) == list(range(1, 7))
    first, _ = run_pretrain(FLAGS, tmp_path / "stopped", "--exit-interval", "3", *COMPILE)
    second, log = run_pretrain(FLAGS, tmp_path / "stopped", "--exit-interval", "3", *COMPILE)
    assert "resuming from the newest complete checkpoint" in log
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    for it in range(1, 7):
        assert (first if it <= 3 else second)[it] == straight[it], it  # same consumed samples, same loss text
