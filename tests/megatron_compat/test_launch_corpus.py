"""Every real launch line of the corpus translates, or is declined with `--flag: why — what to do` lines.

The corpus (60 Megatron-LM and MindSpeed-LLM launch lines read off their scripts) is a copy of the shared
folder's launch_corpus.json in tests/data.
"""
import json
import math
from pathlib import Path

import pytest

from fsdp2_backend.config import validation as config_validation
from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.translate import translate_megatron

# A copy of shared/megatron/launch_corpus.json: 60 real launch lines, kept with the tests.
CORPUS = Path(__file__).resolve().parents[1] / "data" / "launch_corpus.json"
LINES = json.loads(CORPUS.read_text())

# Lines whose declines are expected, with the flag that must be named (one per line, the decisive one).
EXPECTED_DECLINES = {
    "gpt3/train_gpt3_175b_distributed.sh": "--step-batch-size-schedule",  # Megatron-LM refuses it too
    "gpt_dynamic_inference_tp1_pp1_583m_prefix_caching_chunked_prefill_cuda_graphs": "--prompts",
}


def _name(key):
    return key.split(":", 1)[1]


@pytest.mark.parametrize("key", sorted(LINES), ids=_name)
def test_line_translates_or_is_declined_with_reasons(key):
    try:
        translation = translate_megatron(LINES[key])
    except UsageError as exc:
        assert exc.messages
        for message in exc.messages:
            flag, _, why = message.partition(": ")
            assert why and "\n" not in message, message
            assert flag.startswith("-") or flag.startswith("'"), message
            assert " — " in why, message
        for suffix, flag in EXPECTED_DECLINES.items():
            if suffix in key:
                assert any(m.startswith(flag + ":") for m in exc.messages), exc.messages
        return
    assert not any(suffix in key for suffix in EXPECTED_DECLINES), f"{key} was expected to be declined"
    fields = translation.fields
    config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
    # Validate at the smallest world size the script's own layout fits; only its batch arithmetic, or a layout
    # this engine declines with its reason (EP with TP), may object.
    p = config.parallel
    world = math.lcm(p.tp_size * p.cp_size, p.ep_size)
    try:
        config_validation.validate(config, world)
    except UsageError as exc:
        assert all(m.startswith(VALIDATION_DECLINES) for m in exc.messages), exc.messages


VALIDATION_DECLINES = ("training.global_batch_size", "model.mtp_num_layers: not available with parallel.",
                       "parallel.tp_size: model_type nemotron_h")  # examples/mamba/train.sh at tp 4


def test_corpus_figures():
    """A floor against regressions: 51 of the 60 lines translate today (the rest are declined with reasons)."""
    translated = 0
    for argv in LINES.values():
        try:
            translate_megatron(argv)
            translated += 1
        except UsageError:
            pass
    assert len(LINES) == 60
    assert translated >= 51


# Lines that needed the decoupled lr, the QK-norm weight decay, the scheduler resume policy or the time-based exit.
NEWLY_MAPPED = {
    "llama/train_llama3_8b_h100_fp8.sh": dict(decoupled_lr=5e-4, decoupled_min_lr=4.5e-5,
                                              exit_duration_in_mins=235.0),
    "resume_torch_decoupled_lr_1node": dict(decoupled_lr=2e-4, lr_scheduler_on_resume="checkpoint"),
    "gdn_no_nvrx_async": dict(apply_wd_to_qk_layernorm=True),
}


@pytest.mark.parametrize("suffix", sorted(NEWLY_MAPPED))
def test_optimizer_schedule_flags_of_the_corpus_are_mapped(suffix):
    (key,) = [k for k in LINES if suffix in k]
    training = translate_megatron(LINES[key]).fields["training"]
    assert {name: training.get(name) for name in NEWLY_MAPPED[suffix]} == NEWLY_MAPPED[suffix]


def test_mangled_lines_give_usage_errors_never_crashes():
    """Corpus lines with tokens dropped, swapped or duplicated: a translation or a UsageError, nothing else."""
    import random
    rng = random.Random(1234)
    keys = sorted(LINES)
    for _ in range(300):
        argv = list(LINES[rng.choice(keys)])
        for _ in range(rng.randint(1, 4)):
            i, j = rng.randrange(len(argv)), rng.randrange(len(argv))
            op = rng.choice(("drop", "swap", "dup"))
            if op == "drop":
                del argv[i]
            elif op == "swap":
                argv[i], argv[j] = argv[j], argv[i]
            else:
                argv.insert(i, argv[j])
        try:
            translate_megatron(argv, world_size=rng.choice((1, 2, 8)))
        except UsageError as exc:
            assert exc.messages and all(isinstance(m, str) and m for m in exc.messages)
