"""Start-up: seconds from the command to the first iteration's log line of a 1-rank tiny run, next to the floor
(`python -c "import torch, transformers"`) and the floor of any FSDP2 loop over a transformers model (that plus
transformers.modeling_utils, torch.distributed.fsdp and DTensor), measured in the same run, and where the run's
time goes; the same run with compiled blocks (`--optimization.torch_compile True`) on a warm compile cache (a
warm-up run first).

The run: `pretrain_fsdp2.py` with Megatron flags, a 2-layer Llama-style model of hidden 64, mock data with the
NullTokenizer, one iteration, no save. Rounds alternate the commands (this machine is shared: all see the
same load); per command the median of the wall seconds to the first iteration line (the import floor: to its
exit) and of the CPU seconds of the whole process.

The breakdown is a third command: the same run in this file's `--phases` mode, which imports torch and
transformers first, then runs `fsdp2_backend.launch.main` with stamps (wall since the command, CPU of the
process) taken at the return of the command-line validation, at the entry and return of `build.build_model`, and
at the run's own lines "> building train, validation, and test datasets", "> finished creating GPT datasets" and
the first iteration line. Each phase is printed with its own seconds (median over the rounds).

    python -m benchmarks.bench_startup [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 2 --tokenizer-type NullTokenizer "
         "--vocab-size 255 --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights "
         "--disable-bias-linear --position-embedding-type rope --normalization RMSNorm --swiglu --mock-data "
         "--train-iters 1 --lr 1e-4 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0").split()
PHASES_MODE = "--phases"
# What any FSDP2 loop over a transformers model imports: transformers 5.25's modeling_utils brings torch._dynamo
# (integrations.deepgemm, via finegrained_fp8) and torchao (quantizers.auto -> quantizer_torchao) whatever the
# model; fully_shard brings DTensor. ~2.6 CPU-s above `import torch, transformers` here, none of it ours.
MODEL_FLOOR = "import ... + HF modeling, FSDP2"
COMMANDS = {
    "import torch, transformers": [sys.executable, "-c", "import torch, transformers"],
    MODEL_FLOOR: [sys.executable, "-c", "import torch, transformers, transformers.modeling_utils, "
                  "torch.distributed.fsdp, torch.distributed.tensor"],
    "tiny run, first iteration line": [sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), *FLAGS],
    # optimization.torch_compile on a rerun: inductor's FX graph cache (and AOT autograd's) from the warm-up run
    # hold the compiled block and loss, so what remains is dynamo's tracing and the cache lookups
    "tiny run, compiled, warm cache": [sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), *FLAGS,
                                       "--optimization.torch_compile", "True"],
}
WARM_UP = "tiny run, compiled, warm cache"  # run once before the rounds (fills the compile cache), not counted
BREAKDOWN_COMMAND = [sys.executable, "-m", "benchmarks.bench_startup", PHASES_MODE]
# (phase, what ends it): the stamps the --phases child takes, in order
PHASES = (
    ("import torch, transformers", "the imports"),
    ("validation: flags -> config", "parse_for_world returns"),
    ("engine imports, process group, seed", "build_model starts"),
    ("model build: tokenizer, HF modules, FSDP2", "build_model returns"),
    ("optimizer, scheduler, checkpointer", "> building train, validation, and test datasets"),
    ("dataset indices (train/valid/test)", "> finished creating GPT datasets"),
    ("first iteration: trainer, step, log line", " iteration "),
)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _is_iteration_line(line: str) -> bool:
    return " iteration " in line and "consumed samples" in line


def _environment() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def _measure(command) -> tuple:
    """(wall seconds to the first iteration line, or to the exit when it prints none; CPU seconds of the process)."""
    cpu, start = _children_cpu(), time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            env=_environment())
    first = None
    for line in proc.stdout:
        if first is None and _is_iteration_line(line):
            first = time.perf_counter() - start
    if proc.wait():
        raise SystemExit(f"failed: {' '.join(command)}")
    return first if first is not None else time.perf_counter() - start, _children_cpu() - cpu


def _measure_phases() -> list:
    """[(wall since the command, CPU of the process)] at the end of each of PHASES, from the --phases child."""
    with tempfile.TemporaryDirectory() as tmp:
        stamp_file = os.path.join(tmp, "stamps.json")
        start = time.time()
        proc = subprocess.run([*BREAKDOWN_COMMAND, stamp_file], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=REPO, env=_environment())
        if proc.returncode:
            raise SystemExit(f"failed: {' '.join(BREAKDOWN_COMMAND)}")
        with open(stamp_file, encoding="utf-8") as f:
            stamps = json.load(f)
    if len(stamps) != len(PHASES):
        raise SystemExit(f"the --phases run took {len(stamps)} stamps, not {len(PHASES)}: {stamps}")
    return [(wall - start, cpu) for wall, cpu in stamps]


class _StampingStdout:
    """stdout that stamps when the run writes the lines that end the data phases (then passes everything on)."""

    def __init__(self, stream, stamp) -> None:
        self._stream, self._stamp, self._markers = stream, stamp, [marker for _, marker in PHASES[4:]]

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._stream.flush()
        if self._markers and self._markers[0] in text and (self._markers[0] != " iteration "
                                                            or _is_iteration_line(text)):
            self._markers.pop(0)
            self._stamp()
        return written

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _phases_child(stamp_file: str) -> None:
    """The tiny run, stamped at the end of each of PHASES; writes [(wall, CPU)] to `stamp_file`, leaves as
    pretrain_fsdp2.py does."""
    stamps = []

    def stamp() -> None:
        stamps.append((time.time(), time.process_time()))

    import torch, transformers  # noqa: F401,E401 — the floor's imports, first

    stamp()
    from fsdp2_backend import build, launch

    def wrapped(function, before: bool):
        def call(*args, **kwargs):
            if before:
                stamp()
            result = function(*args, **kwargs)
            stamp()
            return result

        return call

    launch.parse_for_world = wrapped(launch.parse_for_world, before=False)
    build.build_model = wrapped(build.build_model, before=True)
    sys.stdout = _StampingStdout(sys.stdout, stamp)
    code = launch.main(list(FLAGS))
    with open(stamp_file, "w", encoding="utf-8") as f:
        json.dump(stamps, f)
    sys.__stdout__.flush()
    os._exit(code)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == PHASES_MODE:
        _phases_child(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = {name: [] for name in COMMANDS}
    phases = []
    cold = _measure(COMMANDS[WARM_UP])  # the first compiled run (cold when the cache is empty) fills the cache
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            results[name].append(_measure(command))
        phases.append(_measure_phases())
    print(f"1-rank start-up, median of {args.rounds} alternating rounds: wall seconds [CPU seconds]; this machine "
          f"may be shared: the CPU seconds are the steadier figure")
    floor = None
    model_floor = [statistics.median(r[i] for r in results[MODEL_FLOOR]) for i in (0, 1)]
    for name, runs in results.items():
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        floor = floor or (wall, cpu)
        print(f"  {name:32s}: {wall:6.2f} s [{cpu:6.2f} s]  ({wall / floor[0]:.2f}x [{cpu / floor[1]:.2f}x] the "
              f"imports; {wall / model_floor[0]:.2f}x [{cpu / model_floor[1]:.2f}x] with HF modeling and FSDP2)")
    print(f"  the warm-up compiled run (before the rounds; cold if the compile cache was empty): {cold[0]:.2f} s "
          f"[{cold[1]:.2f} s]")
    print("where the tiny run's time goes (the same run, stamped; each phase's own seconds, median):")
    for i, (name, _) in enumerate(PHASES):
        wall = statistics.median(run[i][0] - (run[i - 1][0] if i else 0.0) for run in phases)
        cpu = statistics.median(run[i][1] - (run[i - 1][1] if i else 0.0) for run in phases)
        print(f"  {name:42s}: {wall:6.2f} s [{cpu:6.2f} s]")
    wall, cpu = statistics.median(run[-1][0] for run in phases), statistics.median(run[-1][1] for run in phases)
    print(f"  {'to the first iteration line (stamped run)':42s}: {wall:6.2f} s [{cpu:6.2f} s]")


if __name__ == "__main__":
    main()
