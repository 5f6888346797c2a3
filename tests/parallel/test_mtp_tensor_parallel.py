"""MTP under tensor parallel: the qwen3 model id with one MTP depth, on 2 gloo ranks at TP 2 with sequence parallel
(the engine's `build._with_mtp` + `apply_parallelism`: the MTP layer's attention and MLP get the tp plan, its
norms and eh_proj run on sequence shards), gives one process's losses (lm loss + factor x MTP loss) over 3 steps."""
import torch

from tests.support.launchers import run_distributed
from tests.support.mtp_parallel_runs import FACTOR, train_steps


def _config(tp_size):
    from fsdp2_backend.config import Config

    config = Config()
    config.model.model_id, config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor = "qwen3", 1, FACTOR
    config.parallel.param_dtype, config.parallel.tp_size = "fp32", tp_size
    config.parallel.sequence_parallel = tp_size > 1
    return config


def _model(config):
    from transformers import Qwen3Config

    from fsdp2_backend.build import _with_mtp
    from fsdp2_backend.models.registry import model_spec

    torch.manual_seed(0)
    hf_config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                            tie_word_embeddings=False)
    hf_config._attn_implementation = "sdpa"
    return _with_mtp(model_spec("qwen3").build(hf_config), config)


def _ranks(rank, world_size, out_dir):
    import json

    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.apply import apply_parallelism

    model, config = _model(_config(2))
    model = apply_parallelism(model, config, ParallelContext.create(config.parallel))
    assert model.mtp.layers[0].transformer_layer.self_attn.q_proj.weight.to_local().shape[0] == 32  # half the rows
    losses = train_steps(model)  # both tp ranks read the same batch (dp 1)
    if rank == 0:
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(losses, f)


def test_mtp_with_tp2_sequence_parallel_equals_one_process(tmp_path):
    import json

    run_distributed(_ranks, 2, str(tmp_path))
    got = json.loads((tmp_path / "losses.json").read_text())
    want = train_steps(_model(_config(1))[0])
    assert want[-1] < want[0]  # it trains
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
