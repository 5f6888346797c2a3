"""A checkpoint a real Megatron-LM run wrote converts and continues: megatron-core 0.16.1 saves whose ``args`` are
the namespace Megatron-LM's own parser made (tests/data/megatron_genuine_args/llama_dense, `tests/support/megatron_genuine`),
``exit_signal: signal.Signals.SIGTERM``, megatron's ``AttnBackend`` and the torch dtypes included.

megatron-core builds the model that namespace describes (2 layers, hidden 64, ffn 160, 4 heads in 2 query groups,
q/k layer norms, RMSNorm eps 1e-6, RoPE base 500000, untied, the NullTokenizer's 1001 ids padded to 1024) and trains
it with its own DDP, optimizer and scheduler, every setting read from the namespace (lr 3e-4, min 3e-5, cosine over
100 iterations with 10 warm-up, weight decay 0.01, Adam 0.9 / 0.999, clip 1.0, global batch 8 of micro-batches of
1) on megatron-core's GPTDataset; at iteration K it saves in Megatron-LM's layout (test_megatron_resume's
``_save_like_megatron_lm``) with the genuine args, then trains two more. Two runs:

- bf16 + the distributed optimizer, torch_dist: the namespace as parsed (``--bf16 --use-distributed-optimizer``):
  bf16 weights, fp32 main weights and moments in the optimizer's state;
- fp32, legacy ``mp_rank_00/model_optim_rng.pt``: the namespace Megatron-LM's parser gives for the same command line
  without ``--bf16 --use-distributed-optimizer`` (``bf16`` and ``use_distributed_optimizer`` False, ``params_dtype``
  float32, as validate_args sets it; nothing else differs). Megatron-LM's legacy format keeps a distributed
  optimizer's state in ``distrib_optim.pt``, which the reader declines (megatron_compat/checkpoint/resume.py).

Each checkpoint converts (``tools/convert_checkpoint.py``): transformers' model evaluates megatron-core's eval loss
at iteration K on the same tokens within 1e-6 relative, in fp32 over the saved weights. Each continues
(``pretrain_fsdp2.py`` + the run's own command line from args.json + ``--load``): the iteration, consumed samples and
learning rate Megatron prints at K+1 and K+2, and megatron-core's losses — within 1e-5 in fp32; in bf16 within 5e-5
relative (measured: 3e-6 and 6e-6; the two engines' bf16 kernels round differently). A poisoned copy of the genuine save is still refused.

What is changed from the parsed command line, and why: the dropouts are 0 on both sides (``--hidden-dropout 0
--attention-dropout 0`` appended: the masks of two engines cannot agree), the data path, split and cache are the
test's, and ``--exit-interval`` stops the continuation after K+2 (the schedule stays the 100 iterations parsed).
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.support.launchers import REPO, run_pretrain
from tests.support.megatron_checkpoints import megatron  # noqa: F401  (pytest fixture)
from tests.support.megatron_training import K, CpuForCuda, save_like_megatron_lm
from tests.support.megatron_genuine import genuine_args, listing, megatron_padded_vocab
from tests.support.megatron_reference import IdsTokenizer, write_corpus

NAME = "llama_dense"
LOG_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*? learning rate: (\S+) \|"
                      r".*? lm loss: (\S+) \|")
EVAL_SEQ = 32


def _model(args, bf16: bool):
    """megatron-core's GPTModel (local spec) for the genuine args' architecture."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.layernorm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=torch.nn.functional.silu, add_bias_linear=args.add_bias_linear,
        qk_layernorm=args.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        bf16=bf16, params_dtype=dtype, init_method_std=args.init_method_std)
    torch.manual_seed(31)
    model = GPTModel(cfg, get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization),
                     vocab_size=megatron_padded_vocab(args), max_sequence_length=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    with torch.no_grad():  # norms start at 1: make them differ so a misplaced norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def _stack(model, args):
    """megatron-core's DDP, optimizer and scheduler, every setting from the genuine args (Megatron-LM's
    get_megatron_optimizer / get_optimizer_param_scheduler read the same fields)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        bf16=args.bf16, params_dtype=args.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer),
        [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.train_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style=args.weight_decay_incr_style)
    return ddp, optimizer, scheduler


def _step(ddp, optimizer, scheduler, samples, seq) -> float:
    """One Megatron-LM iteration: every micro-batch of one sample, the loss averaged over the global batch's
    tokens (each sample has `seq` loss tokens), one optimizer step."""
    mask = torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    total = 0.0
    for sample in samples:
        losses = ddp(sample["tokens"][None], sample["position_ids"][None], attention_mask=mask,
                     labels=sample["labels"][None])
        loss = (losses.float() * sample["loss_mask"][None]).sum() / (sample["loss_mask"].sum() * len(samples))
        loss.backward()
        total += loss.item()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]
    scheduler.step(increment=len(samples))
    return total


def _eval_loss(model, args, tokens) -> float:
    """megatron-core's loss over `tokens` in fp32: a float32 copy of the model holding its weights as saved."""
    seq = tokens.shape[1] - 1
    mask = torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]
    fp32 = _model(args, bf16=False).eval()
    fp32.load_state_dict({k: v.float() if isinstance(v, torch.Tensor) and torch.is_floating_point(v) else v
                         for k, v in model.state_dict().items()})
    with torch.no_grad():
        logits = fp32(tokens[:, :-1], torch.arange(seq)[None].expand(len(tokens), seq), attention_mask=mask)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()


def _run(root, fmt: str, bf16: bool):
    """megatron-core trains K iterations, saves with the genuine args, trains two more: the reference."""
    from megatron.core import dist_checkpointing
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    args = genuine_args(NAME)
    if not bf16:  # the parser's namespace for the same command line without --bf16 --use-distributed-optimizer
        args.bf16, args.params_dtype, args.use_distributed_optimizer = False, torch.float32, False
    gbs, seq = args.global_batch_size, args.seq_length
    prefix = write_corpus(str(root / "data" / "text_document"), 200, seed=9, max_len=120, vocab_size=args.vocab_size)
    data = BlendedMegatronDatasetBuilder(GPTDataset, [args.train_iters * gbs, 0, 0], lambda: True, GPTDatasetConfig(
        random_seed=args.seed, sequence_length=seq, blend=([prefix], None), split="100,0,0",
        tokenizer=IdsTokenizer(vocab_size=args.vocab_size + 1, eod=args.vocab_size), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(root / "mcore_cache"))).build()[0]
    model = _model(args, bf16).train()
    tokens = torch.randint(0, args.vocab_size, (2, EVAL_SEQ + 1), generator=torch.Generator().manual_seed(4))
    reference = {"loss": {}, "lr": {}, "tokens": tokens}
    with CpuForCuda():
        ddp, optimizer, scheduler = _stack(model, args)
        for iteration in range(1, K + 3):
            samples = [data[(iteration - 1) * gbs + j] for j in range(gbs)]
            reference["loss"][iteration] = _step(ddp, optimizer, scheduler, samples, seq)
            reference["lr"][iteration] = next(g["lr"] for g in optimizer.param_groups if g["default_config"])
            if iteration == K:
                args.padded_vocab_size = megatron_padded_vocab(args)  # what the run set on its args
                args.consumed_train_samples, args.consumed_valid_samples = K * gbs, 0
                save_like_megatron_lm(root / "mg", fmt, model, optimizer, scheduler, args, dist_checkpointing,
                                       ShardedObject)
                reference["eval_loss"] = _eval_loss(model, args, tokens)
    return prefix, reference


_RUNS: dict = {}

CASES = [("torch_dist", True), ("torch", False)]


@pytest.fixture(params=CASES, ids=[f"{fmt}-{'bf16_distopt' if bf16 else 'fp32'}" for fmt, bf16 in CASES])
def genuine_run(megatron, tmp_path_factory, request):  # noqa: F811 (the fixture imported above)
    if request.param not in _RUNS:
        root = tmp_path_factory.mktemp("genuine")
        _RUNS[request.param] = (root, *_run(root, *request.param))
    return (*request.param, *_RUNS[request.param])


def test_the_genuine_namespace_holds_what_the_allow_list_must_admit():
    """The fixture is what Megatron-LM's parser wrote: its non-builtin fields, read by the package's loader."""
    from megatron_compat.checkpoint.safe_pickle import load_torch_file

    for name in ("llama_dense", "deepseek_mla"):
        expected = listing(name)["non_builtin_fields"]
        args = load_torch_file(f"tests/data/megatron_genuine_args/{name}/args.pt")["args"]
        assert len(vars(args)) == listing(name)["fields"]
        assert {k: f"{type(getattr(args, k)).__module__}.{type(getattr(args, k)).__qualname__}" for k in expected} \
            == {k: ("torch.dtype" if v == "torch.dtype" else v) for k, v in expected.items()}
        assert args.exit_signal.name == "SIGTERM" and args.params_dtype == torch.bfloat16


def test_a_genuine_checkpoint_converts_with_megatron_cores_eval_loss(genuine_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.cli.convert_checkpoint import main as convert

    fmt, bf16, root, _, reference = genuine_run
    convert([str(root / "mg"), str(tmp_path / "hf")])
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    args = genuine_args(NAME)
    assert (model.config.model_type, model.config.vocab_size, model.config.rms_norm_eps, model.config.head_dim,
            model.config.intermediate_size, model.config.tie_word_embeddings) == \
        ("qwen3", megatron_padded_vocab(args), args.layernorm_epsilon, args.kv_channels, args.ffn_hidden_size, False)
    assert model.config.rope_parameters["rope_theta"] == args.rotary_base
    tokens = reference["tokens"]
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    got = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()
    assert got == pytest.approx(reference["eval_loss"], rel=1e-6, abs=0)


def test_a_genuine_checkpoint_continues_as_megatron_core_continues_it(genuine_run, tmp_path):
    fmt, bf16, root, prefix, reference = genuine_run
    line = list(listing(NAME)["command_line"])
    if not bf16:
        line.remove("--bf16")
        line.remove("--use-distributed-optimizer")
    flags = [*line, "--load", str(root / "mg"), "--data-path", prefix, "--split", "100,0,0", "--data-cache-path",
             str(tmp_path / "cache"), "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
             "--eval-iters", "0", "--exit-interval", str(K + 2)]
    _, log = run_pretrain(flags, tmp_path / "out", ranks=1)
    got = {int(it): (int(c), float(lr), float(loss)) for it, c, lr, loss in LOG_LINE.findall(log)}
    assert sorted(got) == [K + 1, K + 2], log[-3000:]
    gbs = genuine_args(NAME).global_batch_size
    for iteration in (K + 1, K + 2):
        consumed, lr, loss = got[iteration]
        assert consumed == iteration * gbs
        assert f"{lr:.6E}" == f"{reference['lr'][iteration]:.6E}"
        if bf16:
            assert loss == pytest.approx(reference["loss"][iteration], rel=5e-5), iteration
        else:
            assert loss == pytest.approx(reference["loss"][iteration], abs=1e-5), iteration
    print(f"\n{fmt} bf16={bf16}: |loss - megatron-core| at K+1, K+2 = "
          f"{[abs(got[i][2] - reference['loss'][i]) for i in (K + 1, K + 2)]}")


class _Payload:
    def __init__(self, marker):
        self.command = f"touch {marker}"

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_poisoned_copy_of_a_genuine_checkpoint_is_still_refused(genuine_run, tmp_path):
    """The genuine save's args gain one object whose unpickling would run a command: one error line naming the
    file and the global, exit 2, the command never run."""
    fmt, _, root, _, _ = genuine_run
    shutil.copytree(root / "mg", tmp_path / "mg")
    marker = tmp_path / "code_ran"
    it_dir = tmp_path / "mg" / f"iter_{K:07d}"
    path = it_dir / ("common.pt" if fmt == "torch_dist" else "mp_rank_00/model_optim_rng.pt")
    saved = torch.load(path, weights_only=False)
    saved["args"].exit_signal_payload = _Payload(marker)
    torch.save(saved, path, pickle_module=pickle)
    result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
                             str(tmp_path / "mg"), str(tmp_path / "hf")], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("error: ") == 1 and "posix.system" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not marker.exists()
