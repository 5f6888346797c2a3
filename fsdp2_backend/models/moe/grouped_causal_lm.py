"""`GroupedMoECausalLM`: what every transformers causal LM with our stacked experts and router swapped in shares.

- `forward`: transformers' forward, with the routers' Megatron losses of the call as `aux_loss` (added to the
  loss: `router.attach_aux_loss`);
- `_init_weights`: the seeded initialisation is transformers' own — our `GroupedExperts` are initialised as the
  model's own experts class (`hf_experts_class`) would be (same parameter names and shapes), and the routers'
  Megatron buffers (expert bias, token counts) start at zero;
- `save_pretrained`: transformers' save (its on-disk layout), with config.json naming transformers' own class
  (`hf_class`), so the export loads in transformers without this project.

A model lists the mixin first: `class XGroupedForCausalLM(GroupedMoECausalLM, XForCausalLM)`.

`config._experts_implementation` (transformers' choice of experts kernel, which a config from `from_pretrained`
carries): transformers decides whether a class may take it by looking for its `@use_experts_implementation`
decorator in the source of the class's module, and caches the answer on the first class it checks, which a
subclass inherits or not depending on which model the process built first. Our stacked experts ignore the
setting (their kernel is the project's `moe_grouped_gemm`), so the answer is fixed on the class (also on qwen3_moe's
and qwen3_next's, which do not use the mixin): such a config builds our model in any order. (Not on step35: its
inner Step3p7TextModel checks again and takes no setting; its configs never carry one.)
"""
from __future__ import annotations

from typing import Optional

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.router import TopKRouter, attach_aux_loss


class GroupedMoECausalLM:
    """Mixin over a transformers `PreTrainedModel` causal LM (see the module docstring)."""

    # transformers' cached answer to "may this class take config._experts_implementation?" (module docstring)
    _can_set_experts_implementation_cached_value = True

    hf_experts_class: Optional[type] = None  # transformers' experts module our GroupedExperts replaced
    hf_class: Optional[type] = None          # transformers' causal LM class config.json names on export

    def forward(self, *args, **kwargs):
        """transformers' forward; with Megatron's losses on, `aux_loss` is their weighted sum over the layers."""
        return attach_aux_loss(self, super().forward(*args, **kwargs))

    def _init_weights(self, module):
        if self.hf_experts_class is not None and isinstance(module, GroupedExperts):
            hf = object.__new__(self.hf_experts_class)  # initialised as transformers initialises its experts
            hf.__dict__.update(module.__dict__)
            super()._init_weights(hf)
            return
        super()._init_weights(module)
        if isinstance(module, TopKRouter):  # Megatron's buffers start at 0
            module.reset_buffers()

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        """transformers' save, naming transformers' own class in config.json."""
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process and self.hf_class is not None:
            self.config.architectures = [self.hf_class.__name__]
            self.config.save_pretrained(save_directory)
