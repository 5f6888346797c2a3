"""Megatron-LM / MindSpeed command line → native configuration fields, with a report of every flag's fate.

`translate_megatron(argv, world_size)` parses the line (`arguments`), then gives each flag the command line
sets exactly one disposition: mapped to a native field (the handlers below and `architecture`), accepted
without effect under FSDP2, or declined (`flag_rules`). Megatron's own defaults are applied for everything that
changes results (its lr schedule, Adam betas, seed, log interval, fp32 without --bf16/--fp16, ...), since the
native defaults differ. If anything is declined, a UsageError lists every declined flag as
`--flag: <why> — <what to do>`. No torch import here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fsdp2_backend.usage_errors import UsageError
from megatron_compat import architecture
from megatron_compat.architecture.flags import ARCHITECTURE_DESTS
from megatron_compat.parse import shell_words
from megatron_compat.translate import flag_rules
from megatron_compat.parse.arguments import defaults, megatron_groups, option_strings, parse_megatron, takes_value
from megatron_compat.translate.handlers import DERIVED_STEPS, HANDLERS, loads_checkpoint

GROUP_NAMES = ("model", "data", "parallel", "training", "profiling", "inference", "optimization")
_PRECEDENCE = {"no_effect": 1, "mapped": 2, "declined": 3}


@dataclass
class TranslationReport:
    """What became of each flag the command line set (declined also lists flags a from-scratch build lacks)."""

    mapped: List[Tuple[str, str]] = field(default_factory=list)
    no_effect: List[str] = field(default_factory=list)
    declined: List[Tuple[str, str]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    no_effect_reasons: Dict[str, str] = field(default_factory=dict)  # flag → why it has no effect


@dataclass
class Translation:
    """Native fields by group ({group: {field: value}}, only what the script determines) and the report."""

    fields: Dict[str, Dict[str, Any]]
    report: TranslationReport
    # "group.field" → the flag that set it ("(Megatron default)" when Megatron's default did), so that a field
    # set both by a flag and by a native override can be reported naming both.
    sources: Dict[str, str] = field(default_factory=dict)
    # Megatron's validate_args assertions the line fails (one message each); translate_megatron raises them.
    errors: List[str] = field(default_factory=list)
    # "group.field" → every flag the user typed that determined the field (the handler's own flag and the active
    # flags it read), in command-line order: validation errors on the field name them (`named_flags`).
    field_flags: Dict[str, List[str]] = field(default_factory=dict)
    # The world size the translation assumed (the one given, or without one the smallest the line's own
    # layout is valid at: tp × cp × --num-distributed-optimizer-instances).
    world_size: int = 1


class Context:
    """One translation in progress: the namespace, the fields being filled and each flag's disposition."""

    def __init__(self, ns, active: Dict[str, Any], world_size: int, argv: Sequence[str]):
        self.ns, self.active, self.world_size = ns, active, world_size
        self.fields: Dict[str, Dict[str, Any]] = {group: {} for group in GROUP_NAMES}
        self.dispositions: Dict[str, Tuple[str, str]] = {}
        self.missing: Dict[str, str] = {}  # flags not given that the model being built needs, and why
        self.warnings: List[str] = []
        self.sources: Dict[str, str] = {}
        self.current: str = ""  # the dest whose handler is running
        self.read: List[str] = []  # the active dests the running handler has read
        self.field_flags: Dict[str, List[str]] = {}
        position = {}
        for index, token in enumerate(argv):
            if token.startswith("--"):
                position.setdefault(token.split("=", 1)[0], index)
        # The option the user typed names the flag in messages (e.g. --no-rope-fusion, not the dest), and the
        # report lists flags in command-line order.
        self.flag_names, self.order = {}, {}
        for dest in active:
            options = option_strings()[dest]
            typed = [o for o in options if o in position]
            self.flag_names[dest] = typed[0] if typed else options[0]
            self.order[dest] = position[typed[0]] if typed else len(argv)

    def get(self, dest: str, default: Any = None) -> Any:
        if self.current and dest in self.active and dest not in self.read:
            self.read.append(dest)
        return getattr(self.ns, dest, default)

    def set(self, target: str, value: Any) -> None:
        group, name = target.split(".", 1)
        self.fields[group][name] = value
        flag = self.flag_names.get(self.current)
        if flag or target not in self.sources:
            self.sources[target] = flag or "(Megatron default)"
        flags = self.typed([self.current] + self.read)
        if flags:
            self.field_flags[target] = flags

    def typed(self, dests) -> List[str]:
        """The options the user typed for the active `dests`, in command-line order."""
        active = {d for d in dests if d in self.active}
        return [self.flag_names[d] for d in sorted(active, key=self.order.__getitem__)]

    def set_from(self, dest: str, target: str, value: Any) -> None:
        """`set`, naming flag `dest` as the field's source."""
        current, read, self.current, self.read = self.current, self.read, dest, []
        self.set(target, value)
        self.current, self.read = current, read

    def record(self, dest: str, kind: str, text: str) -> None:
        """Gives a flag its disposition; a stronger one (declined > mapped > no effect) replaces a weaker one."""
        if dest not in self.active:
            if kind == "declined":  # the model needs a flag the line lacks (e.g. --swiglu): said under its name
                self.missing.setdefault(dest, text)
            return
        old = self.dispositions.get(dest)
        if old is None or _PRECEDENCE[kind] > _PRECEDENCE[old[0]]:
            self.dispositions[dest] = (kind, text)

    def decline(self, dest: str, why: str) -> None:
        self.record(dest, "declined", why)

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)


def _active(parsed) -> Dict[str, Any]:
    """Flags the command line sets: named explicitly, or holding a value other than their default."""
    ns, out = parsed.namespace, {}
    for dest, default in defaults().items():
        value = getattr(ns, dest)
        if dest in parsed.given or value != default:
            out[dest] = value
    return out


def _static(ctx: Context, groups: Dict[str, str]) -> None:
    """Flags no handler maps get their rule from flag_rules (a declined flag only for a non-default value)."""
    default = defaults()
    options = option_strings()
    for dest in ctx.active:
        if dest in ctx.dispositions or dest in HANDLERS:
            continue
        rule = flag_rules.static_rule(options[dest], groups.get(dest))
        if ctx.get(dest) == default[dest] and (rule is None or rule.kind != flag_rules.NO_EFFECT):
            continue  # named with its default value: nothing to honour
        if rule is None:
            ctx.decline(dest, "no FSDP2 meaning is known for this flag — drop it (or report it as missing)")
        else:
            ctx.record(dest, rule.kind, rule.text)


# Sizes that must be positive for any layout or model to exist (the arithmetic below divides by them).
_POSITIVE = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size", "micro_batch_size", "global_batch_size", "make_vocab_size_divisible_by",
             "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "seq_length", "num_experts",
             "moe_router_topk", "moe_ffn_hidden_size", "ffn_hidden_size", "kv_channels")


def _check_positive(ns) -> None:
    bad = [f"--{dest.replace('_', '-')}: must be at least 1, got {getattr(ns, dest)} — give a positive number"
           for dest in _POSITIVE if getattr(ns, dest) is not None and getattr(ns, dest) < 1
           and not (dest == "num_experts" and getattr(ns, dest) == 0)]  # Megatron reads 0 experts as dense
    if bad:
        raise UsageError(bad)


def _megatron_asserts(ns) -> List[str]:
    """Megatron's validate_args assertions on the model's shape, as one line each instead of a traceback later."""
    bad = []
    hidden, heads, groups = ns.hidden_size, ns.num_attention_heads, ns.num_query_groups
    if hidden and heads and ns.kv_channels is None and hidden % heads:
        bad.append(f"--hidden-size: {hidden} is not divisible by --num-attention-heads {heads} (Megatron asserts "
                   f"hidden_size % num_attention_heads == 0 without --kv-channels) — change one, or give "
                   f"--kv-channels")
    if heads and groups and ns.group_query_attention and heads % groups:
        bad.append(f"--num-query-groups: {groups} does not divide --num-attention-heads {heads} — use a divisor of "
                   f"{heads}")
    warmup = [flag for flag, dest in (("--lr-warmup-iters", "lr_warmup_iters"),
                                      ("--lr-warmup-samples", "lr_warmup_samples")) if getattr(ns, dest)]
    if ns.lr_warmup_fraction is not None and warmup:
        bad.append(f"--lr-warmup-fraction: given with {warmup[0]} (Megatron accepts only one of them) — drop one")
    seq, positions = ns.seq_length, ns.max_position_embeddings
    if seq and positions and seq > positions:
        bad.append(f"--seq-length: {seq} exceeds --max-position-embeddings {positions} (Megatron asserts "
                   f"max_position_embeddings >= seq_length) — raise --max-position-embeddings or shorten "
                   f"--seq-length")
    return bad


def _flags_define_model(ctx: Context, model_given: bool) -> bool:
    """Whether the architecture flags are the whole model (Megatron's defaults fill the rest, and the required
    ones must be given): not when an HF directory (--load, or the native config) defines it; with --load naming
    a checkpoint directory only when the script gives the model's shape (--num-layers, --hidden-size, ...) — the
    model to build while that
    directory holds no checkpoint, checked against the checkpoint's own config once it does. Without them (or
    with --use-checkpoint-args) the checkpoint defines the model."""
    if model_given or "model.model_name_or_path" in _flat(ctx):
        return False
    if loads_checkpoint(ctx):
        if ctx.get("use_checkpoint_args"):
            return False
        return any(dest in ctx.active for dest in architecture.REQUIRED_FROM_SCRATCH)
    return True


def smallest_world(ns) -> int:
    """The smallest world a line's layout is valid at (a dry run without WORLD_SIZE): every data-parallel
    replica of the distributed optimizer needs its own ranks."""
    sizes = [getattr(ns, dest) or 1 for dest in ("tensor_model_parallel_size", "context_parallel_size",
                                                   "num_distributed_optimizer_instances")]
    return sizes[0] * sizes[1] * sizes[2]


def translate_report(argv: Sequence[str], world_size: Optional[int] = 1, model_given: bool = False) -> Translation:
    """Translates and reports every flag, declined ones included; raises UsageError only for a bad command line.

    `world_size` None: the smallest world the line's layout is valid at (`smallest_world`).
    `model_given`: the native config (YAML, --model.*) already names the model (model_name_or_path or
    architecture), so the architecture flags only refine it and none is required."""
    argv, warnings = shell_words.clean(argv, takes_value)
    parsed = parse_megatron(argv)
    _check_positive(parsed.namespace)
    active = _active(parsed)
    if world_size is None:
        world_size = smallest_world(parsed.namespace)
    ctx = Context(parsed.namespace, active, world_size, argv)
    ctx.warnings.extend(warnings)
    for dest, (target, handler) in HANDLERS.items():
        ctx.current, ctx.read = dest, []
        handler(ctx, getattr(ctx.ns, dest))
        if dest not in ctx.dispositions:  # the handler may have declined it or found it without effect
            ctx.record(dest, "mapped", target)
    ctx.current, ctx.read = "", []
    for step in DERIVED_STEPS:
        step(ctx)
    from_scratch = _flags_define_model(ctx, model_given)
    arch = architecture.apply(ctx.ns, active, from_scratch, ctx.record, ctx.set_from)
    if (from_scratch and arch.get("model_type") != "gpt2" and "hidden_dropout" not in active
            and ctx.get("hidden_dropout")):
        # Megatron's default 0.1 would apply dropout after attention and MLP; HF Llama-style models have none.
        ctx.warn(f"--hidden-dropout: Megatron's default {ctx.get('hidden_dropout')} is not applied — HF "
                 f"{arch.get('model_type')} models have no hidden dropout (give --hidden-dropout 0 to say so)")
    if from_scratch and arch.get("model_type") == "deepseek_v3" and not ctx.get("qk_layernorm"):
        # megatron-core's MLA normalises the q / kv latents only under --qk-layernorm; HF DeepSeek-V3 always does
        ctx.warn("--multi-latent-attention without --qk-layernorm: megatron-core's MLA would have no q/kv latent "
                 "norms; HF DeepSeek-V3 always has them, so this model does (DeepSeek's recipes give --qk-layernorm)")
    if arch and not (ctx.get("use_checkpoint_args") and loads_checkpoint(ctx)):  # the checkpoint's model wins
        ctx.set("model.architecture", arch)
        given = [ctx.flag_names[d] for d in sorted(active, key=ctx.order.__getitem__)
                 if d in ARCHITECTURE_DESTS]
        ctx.sources["model.architecture"] = ", ".join(given) or "(Megatron default)"
    for dest, (kind, text) in ctx.dispositions.items():  # each HF config key names the flag that gave it
        if kind == "mapped" and text.startswith("model.architecture."):
            key = "model.architecture." + text[len("model.architecture."):].split()[0]
            ctx.field_flags[key] = ctx.typed([d for d, (k, t) in ctx.dispositions.items()
                                              if k == "mapped" and t.split()[0] == key])
    _static(ctx, megatron_groups())
    report = _report(ctx)
    report.declined += [(flag, "required to build the model (no --load with an HF directory or a checkpoint, "
                               "no model in the YAML) — give it")
                        for flag in architecture.missing_flags(ctx.ns, from_scratch, active)]
    return Translation({g: v for g, v in ctx.fields.items() if v}, report, ctx.sources,
                       _megatron_asserts(parsed.namespace), ctx.field_flags, world_size)


def translate_megatron(argv: Sequence[str], world_size: Optional[int] = 1, model_given: bool = False) -> Translation:
    """Translates a Megatron/MindSpeed launch line; raises UsageError on bad input or any declined flag."""
    translation = translate_report(argv, world_size, model_given)
    if translation.report.declined or translation.errors:
        raise UsageError([f"{flag}: {why}" for flag, why in translation.report.declined] + translation.errors)
    return translation


def _flat(ctx: Context) -> Dict[str, Any]:
    return {f"{g}.{k}": v for g, values in ctx.fields.items() for k, v in values.items()}


def _report(ctx: Context) -> TranslationReport:
    report = TranslationReport(warnings=list(ctx.warnings))
    for dest in sorted(ctx.active, key=ctx.order.__getitem__):
        kind, text = ctx.dispositions.get(dest, (None, None))
        flag = ctx.flag_names[dest]
        if kind == "mapped":
            report.mapped.append((flag, text))
        elif kind == "no_effect":
            report.no_effect.append(flag)
            report.no_effect_reasons[flag] = text
        elif kind == "declined":
            report.declined.append((flag, text))
    report.declined += [("--" + dest.replace("_", "-"), text) for dest, text in ctx.missing.items()]
    return report


def report_lines(report: TranslationReport) -> List[str]:
    """The flag report as printed by --dry-run: mapped flags, one line of flags without effect, warnings."""
    lines = [f"mapped: {flag} → {target}" for flag, target in report.mapped]
    if report.no_effect:
        lines.append("accepted without effect under FSDP2: " + ", ".join(report.no_effect))
    lines += [f"declined: {flag}: {why}" for flag, why in report.declined]
    lines += [f"warning: {message}" for message in report.warnings]
    return lines
