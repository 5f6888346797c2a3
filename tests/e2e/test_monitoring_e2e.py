"""What a Megatron user watches, through the real entry point: TensorBoard events, W&B offline run files and
progress.txt of a run stopped by --exit-interval and resumed by the same command.

W&B runs offline (WANDB_MODE=offline); its run file (`run-ID.wandb`: W&B's record log, a LevelDB-style log of
`wandb_internal_pb2.Record` protobufs, read here with W&B's own protobuf classes) is read back record by record.
"""
import json
import math
import struct

from fsdp2_backend.training.throughput import model_flops_per_token
from tests.support.launchers import run_pretrain
from tests.support.megatron_lines import RESUME_RUN_FLAGS

EXTRAS = ("--train-iters 6 --exit-interval 4 --eval-interval 3 --eval-iters 1 --tensorboard-log-interval 2 "
          "--log-params-norm --log-memory-to-tensorboard --log-timers-to-tensorboard --log-throughput "
          "--log-validation-ppl-to-tensorboard --log-progress --wandb-project proj --wandb-exp-name exp").split()


def wandb_records(path):
    """The protobuf records of a .wandb file: a 7-byte header, then 32 KiB blocks of chunks, each with a
    4-byte CRC, 2-byte length and 1-byte type (1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunks, buf = path.read_bytes(), 7, 32768, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            chunks.append(buf)
    records = []
    for raw in chunks:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def _key(item):
    return item.key or ".".join(item.nested_key)  # W&B writes a key or its nested path


def wandb_run(run_dir):
    """(run id, config dict, {step: {key: value}}) of one offline run directory."""
    records = wandb_records(next(run_dir.glob("run-*.wandb")))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {_key(item): json.loads(item.value_json) for item in run.config.update}
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            values = {_key(item): json.loads(item.value_json) for item in r.history.item}
            history[r.history.step.num] = {k: v for k, v in values.items() if not k.startswith("_")}
    return run.run_id, config, history


def tb_scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_tensorboard_wandb_and_progress_of_a_resumed_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    save, tb = tmp_path / "run", tmp_path / "tb"
    args = (*EXTRAS, "--tensorboard-dir", str(tb))
    first, log1 = run_pretrain(RESUME_RUN_FLAGS, save, *args)
    second, log2 = run_pretrain(RESUME_RUN_FLAGS, save, *args)
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6]
    printed = {it: float(loss) for it, (_, loss) in {**first, **second}.items()}
    lines = [line for line in (log1 + log2).splitlines() if " iteration " in line and "lm loss:" in line]
    assert all(" params norm: " in line and "throughput per GPU (TFLOP/s/GPU): " in line for line in lines)

    scalars = tb_scalars(tb)
    # --tensorboard-log-interval 2: the per-iteration scalars at 2, 4, 6 only; the same loss as the line
    for tag in ("lm loss", "learning-rate", "grad-norm", "params-norm", "loss-scale", "batch-size",
                "mem-allocated-bytes", "mem-max-allocated-bytes"):
        assert sorted(scalars[tag]) == [2, 4, 6], tag
    assert all(math.isclose(scalars["lm loss"][it], printed[it], rel_tol=1e-5) for it in (2, 4, 6))
    assert scalars["mem-max-allocated-bytes"][6] >= scalars["mem-allocated-bytes"][6] > 2**20
    # --log-timers-to-tensorboard: at every log line (--log-interval 1)
    for tag in ("iteration-time", "throughput", "forward-backward-time", "optimizer-time"):
        assert sorted(scalars[tag]) == list(range(1, 7)), tag
        assert all(value > 0 for value in scalars[tag].values())
    assert all(scalars["forward-backward-time"][it] < scalars["iteration-time"][it] for it in range(2, 7))
    # validation at 3 and 6 (eval interval, and the end of training), with its perplexity
    valid = scalars["lm loss validation"]
    assert sorted(valid) == [3, 6] and sorted(scalars["lm loss validation ppl"]) == [3, 6]
    assert all(math.isclose(scalars["lm loss validation ppl"][it], math.exp(valid[it]), rel_tol=1e-5)
               for it in (3, 6))
    assert sorted(scalars["lm loss validation vs samples"]) == [12, 24]  # x: consumed training samples

    # W&B: the same run id continued by the resumed run; the same scalars per iteration; the run config
    id_file = (save / "wandb" / "wandb-run-id").read_text().strip()
    runs = sorted((save / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run.name.endswith("-" + id_file) for run in runs)
    (id1, config, hist1), (id2, _, hist2) = wandb_run(runs[0]), wandb_run(runs[1])
    assert id1 == id2 == id_file and "W&B: continuing run" in log2
    assert sorted(hist1) == [1, 2, 3, 4] and sorted(hist2) == [5, 6]
    history = {**hist1, **hist2}
    for it in (2, 4, 6):
        for tag in ("lm loss", "learning-rate", "grad-norm", "params-norm"):
            assert math.isclose(history[it][tag], scalars[tag][it], rel_tol=1e-6), (it, tag)
        assert history[it]["samples vs steps"] == 4 * it
    assert math.isclose(history[3]["lm loss validation"], valid[3], rel_tol=1e-6)
    assert "throughput" in history[5] and "lm loss vs samples" not in history[2]
    training, data = (config[group].get("value", config[group]) for group in ("training", "data"))
    assert training["lr"] == 1e-3 and training["wandb_exp_name"] == "exp" and data["cutoff_len"] == 32

    # progress.txt: Megatron's tab-separated lines, from one rank
    progress = [line.split("\t") for line in (save / "progress.txt").read_text().splitlines()]
    assert [fields[3] for fields in progress] == ["Starting job", "Saved checkpoint", "Saved checkpoint",
                                                  "Starting job", "Saved checkpoint"]
    assert all(fields[2] == "# GPUs: 1" for fields in progress)
    saved = [fields for fields in progress if fields[3] == "Saved checkpoint"]
    assert [fields[4] for fields in saved] == ["Iteration: 3", "Iteration: 4", "Iteration: 6"]
    flops_per_iter = model_flops_per_token(json.loads((save / "hf" / "config.json").read_text()), 32) * 4 * 32
    assert saved[-1][7] == f"Floating-point operations: {flops_per_iter * 6:.2e}"
    assert saved[-1][8] == f"Tokens (in billions): {6 * 4 * 32 / 1e9:.2f}"
