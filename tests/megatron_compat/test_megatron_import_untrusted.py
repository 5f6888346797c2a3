"""A Megatron-LM checkpoint from elsewhere cannot run code: poisoned copies of genuine megatron-core 0.16.1 saves,
one per kind of pickle the readers open — torch_dist's ``common.pt``, DCP's ``.metadata``, a pickled DCP entry
(the RNG's ShardedObject; the distributed optimizer's objects are read through the same door), the legacy
``mp_rank_00/model_optim_rng.pt`` — each holding one object whose unpickling would create a marker file
(``posix.system``). Under ``tools/convert_checkpoint.py`` and ``pretrain_fsdp2.py --load``: the marker never
appears, one ``error:`` line names the file and the global, exit code 2, no traceback. (Genuine saves convert and
resume: test_megatron_import.py, test_megatron_resume*.py.)
"""
import io
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from tests.support.launchers import REPO
from tests.support.megatron_checkpoints import megatron_enums, megatron_gpt, save_megatron_checkpoint  # noqa: F401
from tests.support.megatron_checkpoints import megatron  # noqa: F401  (pytest fixture)
from tests.support.megatron_reference import write_corpus


class _Payload:
    """Unpickling runs os.system(command): what a hostile checkpoint would do."""

    def __init__(self, marker):
        self.command = f"touch {marker}"

    def __reduce__(self):
        return os.system, (self.command,)


def _trusted_load(path):  # the test's own genuine file (megatron classes are in this test environment)
    import argparse
    import signal

    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    with torch.serialization.safe_globals([argparse.Namespace, AttnBackend, ModelType, signal.Signals]):
        return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def poisoned(megatron, tmp_path_factory):
    """{kind: (checkpoint root, the file the error names)}, and the marker path that must never appear."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    root = tmp_path_factory.mktemp("poisoned")
    marker = root / "code_ran"
    model, args = megatron_gpt(qk_layernorm=True, tied=False, seed=3)
    megatron_enums(args)
    it = "iter_0000005"
    out = {}
    for fmt in ("torch_dist", "torch"):
        save_megatron_checkpoint(model, args, root / f"genuine_{fmt}", fmt)
    # common.pt: the saved args gain the payload
    shutil.copytree(root / "genuine_torch_dist", root / "common")
    common = root / "common" / it / "common.pt"
    saved = _trusted_load(common)
    saved["args"].extra = _Payload(marker)
    torch.save(saved, common)
    out["common.pt"] = (root / "common", common)
    # legacy model_optim_rng.pt: the same
    shutil.copytree(root / "genuine_torch", root / "legacy")
    legacy = root / "legacy" / it / "mp_rank_00" / "model_optim_rng.pt"
    saved = _trusted_load(legacy)
    saved["args"].extra = _Payload(marker)
    torch.save(saved, legacy)
    out["model_optim_rng.pt"] = (root / "legacy", legacy)
    # DCP's .metadata (a plain pickle.dump): its planner data holds the payload
    shutil.copytree(root / "genuine_torch_dist", root / "metadata")
    metadata_file = root / "metadata" / it / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    metadata.planner_data = _Payload(marker)
    metadata_file.write_bytes(pickle.dumps(metadata))
    out[".metadata"] = (root / "metadata", metadata_file)
    # a pickled DCP entry: megatron-core saves the RNG state as a ShardedObject holding the payload
    (root / "entry" / it).mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 5,
                             "rng_state": ShardedObject("rng_state", [_Payload(marker)], (1, 1), (0, 0), replica_id=0)},
                            str(root / "entry" / it))
    (root / "entry" / "latest_checkpointed_iteration.txt").write_text("5")
    out["entry"] = (root / "entry", root / "entry" / it)
    assert not marker.exists()
    return out, marker, root


def _run(script, *argv):
    return subprocess.Popen([sys.executable, os.path.join(REPO, script), *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_poisoned_checkpoints_are_refused_before_any_code_runs(poisoned, tmp_path):
    out, marker, root = poisoned
    prefix = write_corpus(str(tmp_path / "data" / "text_document"), 40, seed=7, vocab_size=127)
    runs = {}
    for kind, (ckpt, _) in out.items():
        if kind != "entry":  # the converter reads no pickled entry (only the weights): it converts, nothing runs
            runs[("convert", kind)] = _run("tools/convert_checkpoint.py", ckpt, tmp_path / f"hf_{kind}")
        runs[("load", kind)] = _run(
            "pretrain_fsdp2.py", "--load", ckpt, "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
            "--data-path", prefix, "--split", "100,0,0", "--data-cache-path", tmp_path / "cache", "--seq-length", "12",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "8", "--lr", "1e-4",
            "--eval-iters", "0", "--no-load-optim", "--save", tmp_path / f"out_{kind}")
    for (tool, kind), proc in runs.items():
        _, stderr = proc.communicate(timeout=600)
        where = out[kind][1] if kind != "entry" else f"{out[kind][1]} (its entry rng_state/shard_0.0_1.1)"
        expected = (f"error: {where}: holds a pickled posix.system, which is not part of a Megatron checkpoint — refusing "
                    f"to load it (loading it could run code)")
        assert proc.returncode == 2, (tool, kind, stderr[-3000:])
        assert "Traceback" not in stderr, (tool, kind, stderr[-3000:])
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert errors == [expected], (tool, kind, stderr[-3000:])
    assert not marker.exists()


def test_each_reader_refuses_in_process_and_genuine_files_still_read(poisoned):
    """The library calls themselves (no subprocess): each pickle kind refused with the file named; the genuine
    files of the same saves read, their megatron enums as inert stand-ins (megatron is not imported)."""
    from megatron_compat.checkpoint.safe_pickle import (ForeignPickleRefused, MegatronStandIn, dcp_load,
                                                        dcp_metadata, load_torch_file)

    out, marker, root = poisoned
    with pytest.raises(ForeignPickleRefused, match="common.pt: holds a pickled posix.system"):
        load_torch_file(out["common.pt"][1])
    with pytest.raises(ForeignPickleRefused, match="model_optim_rng.pt: holds a pickled posix.system"):
        load_torch_file(out["model_optim_rng.pt"][1], mmap=True)
    with pytest.raises(ForeignPickleRefused, match=r"\.metadata: holds a pickled posix.system"):
        dcp_metadata(out[".metadata"][1].parent)
    key = next(k for k in dcp_metadata(out["entry"][1]).state_dict_metadata if k.startswith("rng_state"))
    with pytest.raises(ForeignPickleRefused, match=r"its entry rng_state.*: holds a pickled posix.system"):
        dcp_load({key: io.BytesIO()}, out["entry"][1])
    # a builtin eval smuggled in a torch file is named as such
    buffer = io.BytesIO()
    torch.save({"args": type("E", (), {"__reduce__": lambda self: (eval, ("1",))})()}, buffer)
    with pytest.raises(ForeignPickleRefused, match="holds a pickled builtins.eval"):
        load_torch_file(buffer, where="buffer")
    assert not marker.exists()
    common = load_torch_file(root / "genuine_torch_dist" / "iter_0000005" / "common.pt")
    assert isinstance(common["args"].attention_backend, MegatronStandIn)
    assert type(common["args"].model_type).__module__ == "megatron.core.enums"
    assert common["args"].num_query_groups == 2


def test_hf_directories_wanting_custom_code_are_refused_naming_the_file(tmp_path):
    """An HF model or tokenizer directory whose auto_map names code shipped with it: without --trust-remote-code
    the code never runs and the one line names the file that asked for it."""
    from fsdp2_backend.config.schema import ModelArguments
    from fsdp2_backend.models.loading import load_hf_config
    from fsdp2_backend.usage_errors import UsageError
    from megatron_compat.data.tokenizer import HuggingFaceTokenizer

    marker = tmp_path / "code_ran"
    model_dir, tok_dir = tmp_path / "model", tmp_path / "tok"
    for folder in (model_dir, tok_dir):
        folder.mkdir()
        (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (model_dir / "config.json").write_text('{"model_type": "custom_thing", "auto_map": {"AutoConfig": '
                                           '"custom.CustomConfig"}}')
    (tok_dir / "tokenizer_config.json").write_text('{"tokenizer_class": "CustomTok", "auto_map": {"AutoTokenizer": '
                                                   '["custom.CustomTok", null]}}')
    with pytest.raises(UsageError, match=f"{model_dir}/config.json names custom modelling code"):
        load_hf_config(ModelArguments(model_name_or_path=str(model_dir)))
    with pytest.raises(UsageError, match=f"{tok_dir}/tokenizer_config.json .or its config.json. names custom"):
        HuggingFaceTokenizer(str(tok_dir))
    assert not marker.exists()
