"""A migration report: lay a new run over an old one, metric by metric, with a verdict and a plot.

    python tools/compare_runs.py OLD NEW [--plot out.png] [--loss-rtol 0.02] [--labels megatron fsdp2]

OLD / NEW: a Megatron-LM / MindSpeed-LLM training log (ours prints the same line), a TensorBoard event directory
(Megatron's scalar names), or a Megatron-LM functional-test golden-values JSON ({metric: {values: {step: v}}}).
A log may hold several jobs of one run (a resumed run appends): an iteration printed twice keeps its last value.

The runs are aligned by iteration; where both give consumed samples and these differ (another global batch
size), by consumed samples instead. For each metric both have — lm loss, grad norm, learning rate, loss scale,
skipped and nan iterations (cumulative per line, as Megatron prints them), throughput (TFLOP/s/GPU), time per
iteration — the report prints the points compared, the largest and mean absolute difference and the largest
relative one. lm loss, learning rate, loss scale and the skipped / nan counts are checked against a tolerance
(relative, per metric; counts exactly) and decide the verdict, AGREE or DIVERGE, with the first point where a
checked metric leaves its tolerance; grad norm and the speed figures are reported, not judged (grad norm differs
step to step under bf16 without the loss doing so; speed is what a migration changes). Exit code: 0 agree,
1 diverge, 2 bad input.

`--plot FILE` draws each metric's two curves over each other (matplotlib, headless Agg backend) and the lm loss
difference — the picture to show before switching. The log parser is written here rather than reusing
`fsdp2_backend.training.logging.parse_train_line` because it must read every Megatron / MindSpeed vintage
(with or without timestamp, 3- or 6-decimal learning rates, extra loss keys, rank prefixes), not only ours.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from fsdp2_backend.usage_errors import UsageError, exit_on_usage_error  # noqa: E402

# Metric → (log-line field, TensorBoard / golden-values tag); None where that source has no such value.
METRICS = {
    "lm loss": ("lm loss", "lm loss"),
    "grad norm": ("grad norm", "grad-norm"),
    "learning rate": ("learning rate", "learning-rate"),
    "loss scale": ("loss scale", "loss-scale"),
    "skipped iterations": ("number of skipped iterations", None),
    "nan iterations": ("number of nan iterations", None),
    "throughput (TFLOP/s/GPU)": ("throughput per GPU (TFLOP/s/GPU)", "throughput"),
    "time per iteration (ms)": ("elapsed time per iteration (ms)", "iteration-time"),
}
# Relative tolerance of the metrics that decide the verdict (counts must be equal); others are reported only.
DEFAULT_RTOL = {"lm loss": 0.02, "learning rate": 1e-3, "loss scale": 0.0, "skipped iterations": 0.0,
                "nan iterations": 0.0}
_ITERATION = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_FIELD = re.compile(r"^\s*([^:|]+?):\s*([-+0-9.eEnaif]+)\s*$")


@dataclass
class Run:
    """One run's series: metric → {iteration: value}, and consumed samples per iteration where known."""

    name: str
    series: Dict[str, Dict[int, float]] = field(default_factory=dict)
    samples: Dict[int, int] = field(default_factory=dict)


def parse_log_line(line: str) -> Optional[Tuple[int, Dict[str, float]]]:
    """(iteration, {field: value}) of a Megatron-style training line, or None: fields `name: number` between
    `|`s after `iteration N/ M |` (any prefix before it: timestamp, rank, launcher tag)."""
    match = _ITERATION.search(line)
    if match is None:
        return None
    fields: Dict[str, float] = {}
    for part in line[match.end():].split("|"):
        found = _FIELD.match(part)
        if found:
            try:
                fields[found.group(1).strip()] = float(found.group(2))
            except ValueError:
                continue
    return int(match.group(1)), fields


def read_log(path: str) -> Run:
    run = Run(os.path.basename(path))
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parsed = parse_log_line(line)
            if parsed is None:
                continue
            iteration, fields = parsed
            for metric, (key, _) in METRICS.items():
                if key in fields:  # a later job's line for the same iteration (a resumed run) replaces it
                    run.series.setdefault(metric, {})[iteration] = fields[key]
            if "consumed samples" in fields:
                run.samples[iteration] = int(fields["consumed samples"])
    return run


def read_golden_values(path: str) -> Run:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    run = Run(os.path.basename(path))
    for metric, (_, tag) in METRICS.items():
        entry = data.get(tag) if tag else None
        if isinstance(entry, dict) and isinstance(entry.get("values"), dict):
            values = {int(step): float(v) for step, v in entry["values"].items() if v not in ("nan", None)}
            if metric == "time per iteration (ms)":
                values = {step: v * 1000.0 for step, v in values.items()}  # TensorBoard's seconds
            run.series[metric] = values
    return run


def read_tensorboard(path: str) -> Run:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise UsageError(f"{path}: reading a TensorBoard directory needs the tensorboard package — pip install "
                         "tensorboard") from err
    events = EventAccumulator(path, size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    run = Run(os.path.basename(os.path.normpath(path)))
    for metric, (_, tag) in METRICS.items():
        if tag in tags:
            scale = 1000.0 if metric == "time per iteration (ms)" else 1.0
            run.series[metric] = {e.step: e.value * scale for e in events.Scalars(tag)}  # later event wins
    if "lm loss" in tags and "lm loss vs samples" in tags:  # written together: pair them in order
        for by_iter, by_samples in zip(events.Scalars("lm loss"), events.Scalars("lm loss vs samples")):
            run.samples[by_iter.step] = by_samples.step
    return run


def read_run(path: str) -> Run:
    """A log file, a TensorBoard event directory or a golden-values JSON, by what `path` is."""
    if os.path.isdir(path):
        run = read_tensorboard(path)
    elif not os.path.isfile(path):
        raise UsageError(f"{path}: no such file or directory — give a training log, a TensorBoard directory or a "
                         "golden-values .json")
    elif path.endswith(".json"):
        run = read_golden_values(path)
    else:
        run = read_log(path)
    if not run.series.get("lm loss"):
        raise UsageError(f"{path}: no training iterations with an lm loss found — give a Megatron-style training "
                         "log (lines with 'iteration N/ M | ... lm loss: X |'), a TensorBoard directory or a "
                         "golden-values .json")
    return run


def align(old: Run, new: Run) -> Tuple[str, Dict[int, int]]:
    """("iteration" or "consumed samples", {old iteration: new iteration}) of the points both runs have."""
    shared = sorted(set(old.series["lm loss"]) & set(new.series["lm loss"]))
    both = [it for it in shared if it in old.samples and it in new.samples]
    if both and any(old.samples[it] != new.samples[it] for it in both):
        by_samples = {s: it for it, s in new.samples.items()}
        return "consumed samples", {it: by_samples[s] for it, s in sorted(old.samples.items()) if s in by_samples}
    return "iteration", {it: it for it in shared}


@dataclass
class MetricReport:
    metric: str
    points: int
    max_abs: float
    mean_abs: float
    max_rel: float
    rtol: Optional[float]
    first_bad: Optional[int]  # the first (old) iteration outside the tolerance

    @property
    def ok(self) -> bool:
        return self.rtol is None or self.first_bad is None


def compare(old: Run, new: Run, rtol: Dict[str, float]) -> Tuple[str, Dict[int, int], List[MetricReport]]:
    axis, pairs = align(old, new)
    reports = []
    for metric in METRICS:
        a, b = old.series.get(metric), new.series.get(metric)
        if not a or not b:
            continue
        points = [(it, a[it], b[pairs[it]]) for it in pairs if it in a and pairs[it] in b]
        if not points:
            continue
        diffs = [abs(y - x) for _, x, y in points]
        rels = [abs(y - x) / max(abs(x), 1e-12) for _, x, y in points]
        tol = rtol.get(metric)
        first_bad = next((it for (it, x, y), r in zip(points, rels)
                          if tol is not None and not (r <= tol or (math.isnan(x) and math.isnan(y)))), None)
        finite = [d for d in diffs if math.isfinite(d)] or [float("nan")]
        reports.append(MetricReport(metric, len(points), max(finite), sum(finite) / len(finite),
                                    max([r for r in rels if math.isfinite(r)] or [float("nan")]), tol, first_bad))
    return axis, pairs, reports


def format_report(old: Run, new: Run, axis: str, pairs: Dict[int, int], reports: List[MetricReport]) -> List[str]:
    lines = [f"old: {old.name}   new: {new.name}   aligned by {axis}: {len(pairs)} points "
             f"({min(pairs) if pairs else '-'}..{max(pairs) if pairs else '-'})",
             f"{'metric':<26}{'points':>7}{'max |diff|':>13}{'mean |diff|':>13}{'max rel':>10}{'tolerance':>11}"
             "  result"]
    for r in reports:
        tol = "report" if r.rtol is None else ("equal" if r.rtol == 0 else f"{r.rtol:g}")
        result = "-" if r.rtol is None else ("ok" if r.ok else f"exceeds from iteration {r.first_bad}")
        lines.append(f"{r.metric:<26}{r.points:>7}{r.max_abs:>13.4g}{r.mean_abs:>13.4g}{r.max_rel:>10.2g}{tol:>11}"
                     f"  {result}")
    speed = next((r for r in reports if r.metric.startswith("throughput")), None)
    if speed is not None:
        a, b = (sum(run.series[speed.metric].values()) / len(run.series[speed.metric]) for run in (old, new))
        lines.append(f"mean throughput: old {a:.1f}, new {b:.1f} TFLOP/s/GPU (new/old {b / a:.2f}x)" if a else "")
    bad = [r for r in reports if not r.ok]
    lines.append("verdict: AGREE — every checked metric is within its tolerance" if not bad else
                 "verdict: DIVERGE — " + "; ".join(f"{r.metric} from iteration {r.first_bad}" for r in bad))
    return [line for line in lines if line]


def plot(old: Run, new: Run, pairs: Dict[int, int], reports: List[MetricReport], out: str,
         labels: Sequence[str]) -> None:
    """Each compared metric's curves (old blue, new orange, by old iteration), plus the lm loss difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [r.metric for r in reports if r.metric not in ("skipped iterations", "nan iterations")]
    fig, axes = plt.subplots(len(metrics) + 1, 1, figsize=(9, 2.6 * (len(metrics) + 1)), sharex=True, squeeze=False)
    back = {v: k for k, v in pairs.items()}
    for ax, metric in zip(axes[:, 0], metrics):
        a, b = old.series[metric], new.series[metric]
        ax.plot(sorted(a), [a[i] for i in sorted(a)], color="#1f77b4", label=labels[0], linewidth=1.6)
        xs = sorted(i for i in b if i in back)
        ax.plot([back[i] for i in xs], [b[i] for i in xs], color="#ff7f0e", label=labels[1], linewidth=1.2,
                linestyle="--")
        ax.set_ylabel(metric)
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    ax = axes[-1, 0]
    a, b = old.series["lm loss"], new.series["lm loss"]
    xs = [it for it in sorted(pairs) if it in a and pairs[it] in b]
    ax.plot(xs, [b[pairs[it]] - a[it] for it in xs], color="#2ca02c")
    ax.axhline(0.0, color="gray", linewidth=0.8)
    ax.set_ylabel("lm loss new - old")
    ax.set_xlabel("iteration" + (" (old run's)" if any(k != v for k, v in pairs.items()) else ""))
    ax.grid(alpha=0.3)
    fig.suptitle(f"{labels[0]} vs {labels[1]}")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="the reference run: a log, a TensorBoard directory or a golden-values .json")
    parser.add_argument("new", help="the run to judge against it")
    parser.add_argument("--plot", help="write the curves over each other to this image (e.g. out.png)")
    parser.add_argument("--loss-rtol", type=float, default=DEFAULT_RTOL["lm loss"],
                        help="relative tolerance of lm loss (default %(default)s)")
    parser.add_argument("--lr-rtol", type=float, default=DEFAULT_RTOL["learning rate"],
                        help="relative tolerance of the learning rate (default %(default)s)")
    parser.add_argument("--labels", nargs=2, metavar=("OLD", "NEW"), help="curve labels (default: file names)")
    args = parser.parse_args(argv)
    old, new = read_run(args.old), read_run(args.new)
    rtol = {**DEFAULT_RTOL, "lm loss": args.loss_rtol, "learning rate": args.lr_rtol}
    axis, pairs, reports = compare(old, new, rtol)
    if not pairs:
        raise UsageError(f"{args.old} / {args.new}: the runs share no iteration or consumed-samples point — "
                         "compare logs of the same training")
    for line in format_report(old, new, axis, pairs, reports):
        print(line)
    if args.plot:
        plot(old, new, pairs, reports, args.plot, args.labels or (old.name, new.name))
        print(f"plot: {args.plot}")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    with exit_on_usage_error():
        code = main()
    sys.exit(code)
