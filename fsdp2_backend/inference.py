"""Generation with a trained model: the native config's `inference` group, end to end.

`generate(config, prompts)` loads the model of `model.model_name_or_path` and its tokenizer, then runs
transformers' `generate` on each prompt (one at a time: no padding, so a prompt's completion does not
depend on the others):

- `model.model_name_or_path` is an HF directory, or one of our training checkpoint directories (an
  `iter_*` directory, or a save directory: its newest complete checkpoint). A checkpoint is converted to a
  temporary HF directory with the checkpoint module's `convert_checkpoint`, so that every model field
  (model_id, tokenizer fields, resize_vocab, init_model_with_meta_device, ...) goes through the one loading
  path of `models.loading` / `data.tokenizer`, exactly as in training.
- `inference.infer_backend`: only `huggingface` (transformers' `generate`) exists.
- `inference.max_new_tokens`: at most that many new tokens per prompt (fewer when EOS comes first).
- `inference.do_sample`: false is greedy decoding (one beam, whatever the model's generation_config says);
  true samples with the model's own generation_config settings (temperature, top_k, top_p), seeded with
  `training.seed` so that a run repeats. The seed is set in a forked RNG: the caller's RNG is untouched.

Several ranks (torchrun): each loads the whole model on its own device and generates the same completions
(greedy, or the same seed); no process group is needed. Entry points print on rank 0 only. Weights are
used in fp32 as loaded (`parallel.param_dtype` is FSDP's training compute dtype, not applied here).
torch is imported only once the config has been checked, so bad input is reported at once.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List, Sequence, Tuple

from fsdp2_backend.config import Config, InferenceArguments, ModelArguments
from fsdp2_backend.usage_errors import UsageError

if TYPE_CHECKING:
    import torch


def check_inference_config(config: Config, prompts: Sequence[str]) -> None:
    """What generation needs, every problem at once: a model to load, a backend, a token budget, prompts.

    Training fields (output_dir, stage, data, ...) are not required here.
    """
    errors = []
    model, inference = config.model, config.inference
    path = model.model_name_or_path
    if not path:
        errors.append("model.model_name_or_path: not set — point it at an HF model directory or at a "
                      "checkpoint directory of a training run")
    elif not os.path.isdir(path):
        errors.append(f"model.model_name_or_path: {path} does not exist or is not a directory — point it at an "
                      f"HF model directory or at a checkpoint directory of a training run")
    if model.train_from_scratch:
        errors.append("model.train_from_scratch: generation needs trained weights, not random ones — unset it")
    if inference.infer_backend != "huggingface":
        errors.append(f"inference.infer_backend: '{inference.infer_backend}' is not available — use huggingface")
    if inference.max_new_tokens < 1:
        errors.append(f"inference.max_new_tokens: {inference.max_new_tokens} generates nothing — give at "
                      f"least 1")
    if not prompts:
        errors.append("prompt: none given — pass at least one prompt (--prompt TEXT)")
    if errors:
        raise UsageError(errors)


@contextmanager
def _hf_model_dir(path: str) -> Iterator[str]:
    """`path` when it is an HF directory; a checkpoint's newest complete one converted to a temporary one."""
    from fsdp2_backend.checkpoint.dirs import META_FILE, resolve_checkpoint
    from fsdp2_backend.checkpoint.hf_export import convert_checkpoint

    if os.path.isfile(os.path.join(path, "config.json")):
        yield path
        return
    checkpoint = resolve_checkpoint(path)
    if checkpoint is None:
        raise UsageError(f"model.model_name_or_path: {path} holds neither an HF model (config.json) nor a "
                         f"complete training checkpoint (an iter_* directory with {META_FILE}) — point it at "
                         f"one of those")
    with tempfile.TemporaryDirectory(prefix="fsdp2-generate-") as tmp:
        yield str(convert_checkpoint(checkpoint, Path(tmp) / "hf"))


def load_for_inference(config: Config) -> Tuple[torch.nn.Module, object]:
    """(model in eval mode on this process's device, tokenizer), from `config.model`; see the module doc."""
    from transformers import GenerationConfig

    from fsdp2_backend.distributed.device import resolve_device
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.data.tokenizer import load_tokenizer, model_vocab_size, noise_init_rows

    seed = config.training.seed
    device = resolve_device().torch_device
    with _hf_model_dir(config.model.model_name_or_path) as hf_dir:
        model_args: ModelArguments = dataclasses.replace(config.model, model_name_or_path=hf_dir)
        tokenizer = load_tokenizer(model_args)
        hf_config = load_hf_config(model_args)
        hf_config.vocab_size = model_vocab_size(model_args, hf_config.vocab_size, tokenizer, from_checkpoint=True)
        model = create_model(model_args, hf_config, seed=seed, device=device, parallelize=lambda m: m,
                             new_rows=noise_init_rows(seed))
        if os.path.isfile(os.path.join(hf_dir, "generation_config.json")):
            # from_pretrained reads it, the registry builder does not: the directory's defaults (EOS ids,
            # sampling settings) apply either way.
            model.generation_config = GenerationConfig.from_pretrained(hf_dir)
    return model.eval(), tokenizer


def _encode(tokenizer, text: str) -> List[int]:
    return list(tokenizer.tokenize(text))  # the run's tokenizer type (data.tokenizer.load_tokenizer)


def _decode(tokenizer, ids: List[int]) -> str:
    if tokenizer.hf is not None:
        return tokenizer.hf.decode(ids, skip_special_tokens=True)
    return tokenizer.detokenize(ids)


def _generation_settings(base, inference: InferenceArguments, tokenizer):
    """The model's generation_config with the inference group's fields applied; EOS/pad from the tokenizer
    when the model names none (e.g. a model trained from Megatron architecture flags)."""
    settings = copy.deepcopy(base)
    settings.max_new_tokens = inference.max_new_tokens
    settings.max_length = None  # max_new_tokens alone bounds the output
    settings.do_sample = inference.do_sample
    settings.num_beams = 1
    if settings.eos_token_id is None:
        settings.eos_token_id = tokenizer.eod
    if settings.pad_token_id is None:
        settings.pad_token_id = tokenizer.pad if tokenizer.pad is not None else settings.eos_token_id
    return settings


def chat_prompt_ids(config: Config, tokenizer, prompt: str) -> List[int]:
    """`prompt` as the user turn of the fine-tuning run's template (`data.template`, or the tokenizer's own), the
    ids up to where the assistant's reply starts — tokenized piece by piece, as the SFT data was."""
    from fsdp2_backend.data.sft.template import encode_turns, get_template

    template = get_template(config.data, tokenizer.hf)
    (prompt_pieces, _), = template.render([{"role": "user", "content": prompt},
                                           {"role": "assistant", "content": ""}])
    return encode_turns(tokenizer.hf, [(prompt_pieces, ())])[0][0]


def complete(model: torch.nn.Module, tokenizer, inference: InferenceArguments, seed: int,
             prompts: Sequence[str], encode=None) -> List[str]:
    """The completion (new text only) of each prompt by an already loaded model; `encode(prompt)` gives the
    prompt's ids (default: the text as it is)."""
    import torch

    settings = _generation_settings(model.generation_config, inference, tokenizer)
    device = next(model.parameters()).device
    eos = settings.eos_token_id if isinstance(settings.eos_token_id, list) else [settings.eos_token_id]
    completions = []
    accelerators = [] if device.type == "cpu" else [device.index or 0]
    with torch.no_grad(), torch.random.fork_rng(devices=accelerators,
                                                device_type=device.type if accelerators else "cuda"):
        torch.manual_seed(seed)
        for number, prompt in enumerate(prompts, 1):
            ids = encode(prompt) if encode is not None else _encode(tokenizer, prompt)
            if not ids:
                raise UsageError(f"prompt {number}: {prompt!r} encodes to no tokens — give a non-empty prompt")
            input_ids = torch.tensor([ids], device=device)
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    generation_config=settings)
            new = output[0, len(ids):].tolist()
            if new and new[-1] in eos:
                new = new[:-1]  # the stop token is not text
            completions.append(_decode(tokenizer, new))
    return completions


def generate(config: Config, prompts: List[str], chat: bool = False) -> List[str]:
    """The completion of each prompt by the model of `config.model`, with `config.inference`'s settings; `chat`:
    each prompt wrapped as the user turn of the fine-tuning run's template (`chat_prompt_ids`)."""
    check_inference_config(config, prompts)
    model, tokenizer = load_for_inference(config)
    encode = (lambda prompt: chat_prompt_ids(config, tokenizer, prompt)) if chat else None
    return complete(model, tokenizer, config.inference, config.training.seed, prompts, encode)
