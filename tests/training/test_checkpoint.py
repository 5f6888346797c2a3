"""Checkpoint save/resume on a real Qwen3 sharded with FSDP2 and a real AdamW.

Two ranks train and save (sync, then async with rotation); one rank loads (DCP resharding) and is compared
with full state dicts the two ranks gathered at save time. The loader-side flags, save_only_model,
asynchrony and a crash before the commit are checked in the same one-rank process to keep the suite short.
"""
from __future__ import annotations

import dataclasses
import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp2_backend.training.loss_scaler import LossScaler
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config, train_bytelevel_tokenizer


@dataclasses.dataclass
class _State:
    """Stands for the trainer's TrainState: a dataclass with iteration and consumed samples."""
    iteration: int = 0
    consumed_samples: int = 0


def _build(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config())
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler, step: int) -> None:
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(step))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _full_state(model, optimizer=None):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optimizer": optim_sd}
    # A copy: unsharded tensors (AdamW's `step`) are the optimizer's own and change with the next step.
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, state)


def _rng_draws():
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def _assert_close(actual, expected, path="state"):
    if isinstance(expected, torch.Tensor):
        assert torch.allclose(actual.float(), expected.float(), atol=1e-6, rtol=0), path
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), path
        for key in expected:
            _assert_close(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_close(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, path


def _save_two_ranks(rank, world_size, root, tokenizer_dir):
    from fsdp2_backend.training.checkpoint import CheckpointManager

    root = Path(root)
    model, optimizer, scheduler = _build(world_size)
    for step in range(2):
        _train_step(model, optimizer, scheduler, step)
    scaler = LossScaler.for_dtype("fp16")
    for _ in range(2):
        scaler.update(found_non_finite=True)  # halves the scale: no longer the fresh value
    manager = CheckpointManager(root / "sync")
    manager.save(2, model, optimizer, scheduler, _State(2, 64), tokenizer=tokenizer_dir,
                 extra_states={"loss_scaler": scaler})
    reference = _full_state(model, optimizer)
    draws = _rng_draws()
    if rank == 0:
        torch.save({"state": reference, "draws": draws}, root / "sync_reference.pt")

    # Async with rotation: params change right after each save returns, while the write may still run.
    manager = CheckpointManager(root / "async", async_save=True, save_total_limit=2)
    for iteration in (3, 4, 5):
        reference = _full_state(model, optimizer)
        manager.save(iteration, model, optimizer, scheduler, _State(iteration, 32 * iteration))
        _train_step(model, optimizer, scheduler, iteration)
    manager.finalize()
    if rank == 0:
        torch.save(reference, root / "async_reference.pt")


def _blocking_writes(release: threading.Event):
    """Holds every DCP file write until `release` is set: shows who waits for the write and who does not."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    original = _FileSystemWriter.write_data

    def write_data(self, plan, planner):
        release.wait(timeout=60)
        return original(self, plan, planner)

    _FileSystemWriter.write_data = write_data


def _load_one_rank(rank, world_size, root):
    from torch.distributed.checkpoint import FileSystemReader

    from fsdp2_backend.checkpoint import dirs
    from fsdp2_backend.checkpoint.resume_point import is_restart, resume_point
    from fsdp2_backend.training import rng_state
    from fsdp2_backend.training.checkpoint import CheckpointManager, checkpoint_meta, load_checkpoint

    root = Path(root)
    saved = torch.load(root / "sync_reference.pt", weights_only=True)
    sync_ckpt = resume_point(str(root / "sync"), None).checkpoint
    assert sync_ckpt == root / "sync" / "iter_0000002"
    assert checkpoint_meta(sync_ckpt)["world_size"] == 2

    # Full resume on one rank: model, optimizer, scheduler, trainer state and rank 0's RNG streams.
    model, optimizer, scheduler = _build(world_size)
    scaler = LossScaler.for_dtype("fp16")
    state = load_checkpoint(sync_ckpt, model, optimizer, scheduler, _State(), extra_states={"loss_scaler": scaler})
    draws = _rng_draws()
    assert scaler.scale == 2.0 ** 31
    _assert_close(_full_state(model, optimizer), saved["state"])
    assert state == _State(2, 64)
    assert scheduler.last_epoch == 2
    assert draws == saved["draws"]

    # --no-load-optim: weights and trainer state, but neither optimizer nor scheduler.
    model, optimizer, scheduler = _build(world_size)
    scaler = LossScaler.for_dtype("fp16")
    state = load_checkpoint(sync_ckpt, model, optimizer, scheduler, _State(), no_load_optim=True,
                            extra_states={"loss_scaler": scaler})
    _assert_close(_full_state(model), {"model": saved["state"]["model"]})
    assert not optimizer.state and scheduler.last_epoch == 0 and state == _State(2, 64)
    assert scaler.scale == 2.0 ** 32

    # --no-load-rng: RNG streams stay as seeded here.
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    fresh_draws = _rng_draws()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    load_checkpoint(sync_ckpt, model, optimizer, scheduler, _State(), no_load_rng=True)
    assert _rng_draws() == fresh_draws

    # --finetune: weights only; iteration and consumed samples stay 0, RNG stays as seeded.
    model, optimizer, scheduler = _build(world_size)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    state = load_checkpoint(sync_ckpt, model, optimizer, scheduler, _State(), finetune=True)
    assert state == _State() and not optimizer.state and scheduler.last_epoch == 0
    assert _rng_draws() == fresh_draws
    _assert_close(_full_state(model), {"model": saved["state"]["model"]})

    # Async + rotation: two newest kept, the marker names the last, contents as at save time.
    async_dir = root / "async"
    assert sorted(p.name for p in async_dir.iterdir()) == [
        "iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"]
    assert dirs.read_latest_marker(async_dir) == 5
    model, optimizer, scheduler = _build(world_size)
    state = load_checkpoint(async_dir / "iter_0000005", model, optimizer, scheduler, _State())
    _assert_close(_full_state(model, optimizer), torch.load(root / "async_reference.pt", weights_only=True))
    assert state == _State(5, 160)

    # save_only_model: the DCP holds model weights only; no scheduler, no RNG; loading warns and goes on.
    only = CheckpointManager(root / "only_model", save_only_model=True)
    only_ckpt = only.save(7, model, optimizer, scheduler, _State(7, 7))
    keys = FileSystemReader(str(only_ckpt)).read_metadata().state_dict_metadata
    assert keys and all(k.startswith("model.") for k in keys)
    assert not (only_ckpt / dirs.SCHEDULER_FILE).exists() and not (only_ckpt / rng_state.RNG_DIR).exists()
    assert (sync_ckpt / rng_state.RNG_DIR).is_dir()  # what save_only_model leaves out is there otherwise
    meta = checkpoint_meta(only_ckpt)
    assert (meta["has_optimizer"], meta["has_scheduler"], meta["has_rng"]) == (False, False, False)
    fresh_model, fresh_optimizer, fresh_scheduler = _build(world_size)
    assert load_checkpoint(only_ckpt, fresh_model, fresh_optimizer, fresh_scheduler, _State()) == _State(7, 7)
    assert not fresh_optimizer.state
    _assert_close(_full_state(fresh_model), _full_state(model))

    # Async really is: save() returns while the write is held; nothing visible until finalize().
    release = threading.Event()
    _blocking_writes(release)
    pending = CheckpointManager(root / "held", async_save=True)
    final = pending.save(8, model, optimizer, scheduler, _State(8, 8))
    assert not final.exists() and resume_point(str(root / "held"), None).checkpoint is None
    release.set()
    pending.finalize()
    assert dirs.is_complete_checkpoint(final) and dirs.read_latest_marker(root / "held") == 8

    # A crash after the write and before the rename: the .tmp copy is never picked, and is cleared.
    import shutil
    shutil.copytree(final, root / "held" / "iter_0000009.tmp")
    assert resume_point(str(root / "held"), str(root / "sync")).checkpoint == final
    CheckpointManager(root / "held")
    assert not (root / "held" / "iter_0000009.tmp").exists()


def test_two_ranks_save_one_rank_resumes(tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    train_bytelevel_tokenizer(tokenizer_dir, vocab_size=300, texts=["def f(x):\n    return x + 1\n"] * 20)
    run_distributed(_save_two_ranks, 2, str(tmp_path), str(tokenizer_dir))
    run_distributed(_load_one_rank, 1, str(tmp_path))
    # Self-describing: config and tokenizer travel with the checkpoint.
    hf_meta = tmp_path / "sync" / "iter_0000002" / "hf_meta"
    assert json.loads((hf_meta / "config.json").read_text())["model_type"] == "qwen3"
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(hf_meta)).encode("def f") == \
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).encode("def f")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_discovery_prefers_save_dir_and_skips_partials(tmp_path, capsys):
    """Real single-process DCP saves of a plain module: rotation, marker, resume order, restarts."""
    from fsdp2_backend.usage_errors import UsageError
    from fsdp2_backend.checkpoint import dirs
    from fsdp2_backend.checkpoint.resume_point import is_restart, resume_point
    from fsdp2_backend.training.checkpoint import CheckpointManager, load_checkpoint

    model = torch.nn.Linear(4, 4)
    load_manager = CheckpointManager(tmp_path / "pretrained")
    load_manager.save(100, model, train_state=_State(100, 1000))
    save_dir = tmp_path / "run"
    pretrained = str(tmp_path / "pretrained")
    # --load of a save directory (resume_from_checkpoint), or our checkpoint given as the model directory
    assert resume_point(str(save_dir), pretrained).checkpoint == tmp_path / "pretrained" / "iter_0000100"
    assert resume_point(str(save_dir), None, pretrained).checkpoint == tmp_path / "pretrained" / "iter_0000100"

    manager = CheckpointManager(save_dir, save_total_limit=2)
    for iteration in (10, 20, 30):
        manager.save(iteration, model, train_state=_State(iteration, iteration))
    assert manager.save(30, model) is None  # the exit save right after an interval save
    printed = capsys.readouterr().out  # Megatron's lines, which log watchers match
    assert f"saving checkpoint at iteration      10 to {save_dir} in " in printed
    assert f"\n  successfully saved checkpoint from iteration      30 to {save_dir}\n" in printed
    assert [i for i, _ in dirs.complete_checkpoints(save_dir)] == [20, 30]
    # A restart of the same command continues its own run, whatever --load says.
    assert resume_point(str(save_dir), None, pretrained).checkpoint == save_dir / "iter_0000030"
    found = resume_point(str(save_dir), pretrained).checkpoint
    assert found == save_dir / "iter_0000030" and is_restart(found, str(save_dir))
    assert not is_restart(tmp_path / "pretrained" / "iter_0000100", str(save_dir))
    # A --load that names an iter_* directory directly (it wins over the save directory's newest), and a model
    # directory with no checkpoint (HF weights).
    assert resume_point(None, str(save_dir / "iter_0000020")).checkpoint == save_dir / "iter_0000020"
    assert resume_point(str(save_dir), str(save_dir / "iter_0000020")).checkpoint == save_dir / "iter_0000020"
    assert resume_point(None, None, str(tmp_path)) == (None, False, "")

    # As in Megatron the marker decides (a kill between rename and marker resumes from the one before)...
    (save_dir / dirs.LATEST_FILE).write_text("20")
    assert dirs.newest_checkpoint(save_dir) == save_dir / "iter_0000020"
    # ... unless it names no complete checkpoint: then the highest complete iteration. A directory with a
    # final name but without metadata is not a checkpoint.
    (save_dir / dirs.LATEST_FILE).write_text("40")
    (save_dir / "iter_0000040").mkdir()
    assert dirs.newest_checkpoint(save_dir) == save_dir / "iter_0000030"
    (save_dir / dirs.LATEST_FILE).unlink()
    assert dirs.newest_checkpoint(save_dir) == save_dir / "iter_0000030"

    restored = torch.nn.Linear(4, 4)
    assert load_checkpoint(found, restored, train_state=_State()) == _State(30, 30)
    assert torch.equal(restored.weight, model.weight)
    assert f"\n  successfully loaded checkpoint from {save_dir} at iteration 30\n" in capsys.readouterr().out

    # A --finetune run saving into its --load directory: iteration restarts below the loaded one. Its own
    # checkpoints are kept by rotation, a re-save of an existing iteration replaces it, and a restart
    # resumes from its newest save (the marker), not from the higher-numbered pretrained one.
    shared = tmp_path / "pretrained"
    CheckpointManager(shared).save(200, model, train_state=_State(200, 2000))
    finetuned = torch.nn.Linear(4, 4)
    manager = CheckpointManager(shared, save_total_limit=2)
    for iteration in (50, 100):
        manager.save(iteration, finetuned, train_state=_State(iteration, iteration))
    assert [i for i, _ in dirs.complete_checkpoints(shared)] == [100, 200]
    assert dirs.newest_checkpoint(shared) == shared / "iter_0000100"
    replaced = torch.nn.Linear(4, 4)
    assert load_checkpoint(shared / "iter_0000100", replaced, train_state=_State()) == _State(100, 100)
    assert torch.equal(replaced.weight, finetuned.weight)

    # A Megatron-LM checkpoint where ours would be (Megatron scripts often --load and --save the same dir).
    megatron = tmp_path / "megatron"
    (megatron / "iter_0000500" / "mp_rank_00").mkdir(parents=True)
    (megatron / dirs.LATEST_FILE).write_text("500")
    megatron_kind = r"a Megatron-LM legacy \(mp_rank_\*\) checkpoint"
    with pytest.raises(UsageError, match=rf"training.output_dir \(--save\): .* holds {megatron_kind}"):
        resume_point(str(megatron), str(megatron))
    with pytest.raises(UsageError, match=rf"training.resume_from_checkpoint \(--load\): .* holds {megatron_kind}"):
        resume_point(str(tmp_path / "fresh"), str(megatron))
    with pytest.raises(UsageError, match=rf"training.resume_from_checkpoint \(--load\): .* holds {megatron_kind}"):
        resume_point(None, str(megatron / "iter_0000500"))
    with pytest.raises(UsageError, match=rf"model.model_name_or_path \(--load\): .* holds {megatron_kind}"):
        resume_point(str(tmp_path / "fresh"), None, str(megatron))

    meta_file = shared / "iter_0000100" / dirs.META_FILE
    meta_file.write_text(meta_file.read_text().replace(dirs.FORMAT, "some-other-format"))
    with pytest.raises(UsageError, match="checkpoint format 'some-other-format'"):
        load_checkpoint(shared / "iter_0000100", replaced)

    # build's one call: --finetune resets a checkpoint from --load (or the model directory), never a restart
    # of this run.
    def plan(*args, **kwargs):
        point = resume_point(*args, **kwargs)
        return point.checkpoint, point.finetune

    assert plan(str(tmp_path / "fresh"), pretrained, finetune=True) == (tmp_path / "pretrained" / "iter_0000100", True)
    assert plan(str(tmp_path / "fresh"), None, pretrained, finetune=True) == \
        (tmp_path / "pretrained" / "iter_0000100", True)
    assert plan(str(save_dir), pretrained, finetune=True) == (save_dir / "iter_0000030", False)
    assert plan(str(save_dir), None, pretrained, finetune=True) == (save_dir / "iter_0000030", False)
    assert plan(str(save_dir), str(save_dir / "iter_0000020"), pretrained) == (save_dir / "iter_0000020", False)
    assert plan(str(save_dir), str(save_dir / "iter_0000020"), finetune=True) == (save_dir / "iter_0000020", False)
    assert plan(None, None, str(tmp_path)) == (None, False)
    # An iter_* directory that is not a complete checkpoint is an error; a --load directory holding no
    # checkpoint (yet), or not existing yet, starts the run from scratch, as Megatron's --load does.
    # (a final-named directory without our metadata was never written by our atomic saves: refused as foreign)
    with pytest.raises(UsageError, match=r"training.resume_from_checkpoint \(--load\): .*iter_0000040 holds a "
                                         r"checkpoint this backend did not write"):
        resume_point(None, str(save_dir / "iter_0000040"))
    with pytest.raises(UsageError, match="resume_from_checkpoint .*is not a complete checkpoint"):
        resume_point(None, str(tmp_path / "fresh" / "iter_0000001"))
    (tmp_path / "empty").mkdir()
    for load in (tmp_path / "fresh", tmp_path / "empty"):
        point = resume_point(None, str(load))
        assert (point.checkpoint, point.finetune) == (None, False) and "from scratch" in point.reason


def test_manager_from_training_args(tmp_path):
    from fsdp2_backend.config import TrainingArguments
    from fsdp2_backend.training.checkpoint import CheckpointManager

    training = TrainingArguments(output_dir=str(tmp_path / "out"), save_total_limit=1, save_only_model=True)
    manager = CheckpointManager.from_training_args(training)
    assert manager.save_dir == tmp_path / "out" and manager.save_total_limit == 1
    assert (manager.save_optim, manager.save_rng, manager.async_save) == (False, False, False)
    training = TrainingArguments(output_dir=str(tmp_path / "out"), no_save_optim=True)
    manager = CheckpointManager.from_training_args(training)
    assert (manager.save_optim, manager.save_scheduler, manager.save_rng) == (False, False, True)


def test_convert_rejects_a_directory_without_checkpoint(tmp_path):
    from fsdp2_backend.usage_errors import UsageError
    from fsdp2_backend.checkpoint.hf_export import convert_checkpoint

    with pytest.raises(UsageError, match="no complete checkpoint"):
        convert_checkpoint(tmp_path, tmp_path / "out")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_carries_model_config_and_megatron_tokenizer(tmp_path):
    """The tokenizer a Megatron script builds (an HF tokenizer behind Megatron's surface) travels with the
    checkpoint; a tokenizer directory that is also an HF model directory does not clobber the config."""
    from transformers import AutoConfig, AutoTokenizer

    from fsdp2_backend.training.checkpoint import CheckpointManager, checkpoint_hf_dir
    from megatron_compat.data.tokenizer import HuggingFaceTokenizer

    tokenizer_dir = tmp_path / "tok"
    train_bytelevel_tokenizer(tokenizer_dir, vocab_size=300, texts=["x = [1, 2, 3]\n"] * 20)
    tiny_qwen3_config(vocab_size=999).save_pretrained(str(tokenizer_dir))  # another model's config.json
    for tokenizer in (HuggingFaceTokenizer(str(tokenizer_dir)), str(tokenizer_dir)):
        manager = CheckpointManager(tmp_path / "ckpt")
        path = manager.save(len(list((tmp_path / "ckpt").glob("iter_*"))) + 1, torch.nn.Linear(2, 2),
                            tokenizer=tokenizer, model_config=tiny_qwen3_config())
        hf_meta = checkpoint_hf_dir(path)
        assert AutoConfig.from_pretrained(str(hf_meta)).vocab_size == 512
        assert AutoTokenizer.from_pretrained(str(hf_meta)).encode("x = [1]") == \
            AutoTokenizer.from_pretrained(str(tokenizer_dir)).encode("x = [1]")
