"""Multi-token prediction (MTP, Megatron's `--mtp-num-layers`, DeepSeek-V3 style) over a transformers causal LM.

Semantics (megatron-core 0.16.1 `transformer/multi_token_prediction.py` and `GPTModel._postprocess`):
- depth k = 1..D has its own `enorm`, `hnorm` (the model's RMSNorm class), `eh_proj` (Linear 2h -> h, no bias),
  one decoder layer of the model's own class and its own `final_layernorm`; the output head is the model's.
- depth 1 starts from the main model's final (normed) hidden states, depth k from depth k-1's output after its
  `final_layernorm` (what Megatron hands the next depth).
- input of depth k: cat(enorm(embedding(input_ids rolled left by k)), hnorm(hidden)) -> eh_proj -> layer ->
  final_layernorm -> head. Rolling fills the vacated last positions with 0 (token id 0, label 0, mask 0).
- labels and loss mask of depth k: rolled left by k (k more than the main model's already shifted labels).
- loss of depth k per micro-batch: sum(CE x rolled mask) / sum(rolled mask); the training loss gains
  mtp_loss_scaling_factor / D x sum_k of it, normalised like the lm loss (`GlobalBatchLoss.extra_backward_loss`;
  with calculate_per_token_loss: the plain sums, divided by the global lm token count like the lm gradients).
- reported (`mtp_k loss`, Megatron's MTPLossLoggingHelper): the micro-batch means, averaged over micro-batches
  and data-parallel ranks; under context parallel each micro-batch's mean runs over its whole sequence (sums and
  counts all-reduced over the cp group), not over one rank's share, so cp N prints what 1 rank prints.
  The factor is not applied to the printed values (Megatron prints the unscaled depth losses).

Why hand-written (not megatron-core's module): Megatron's layers are TP/TE modules with process groups; here the
blocks are plain `nn.Module`s built from the model's own classes, and the rolled ids / labels / masks are
computed on the whole sequence before the context-parallel split (`mtp_batch`), so no cross-rank roll is needed.

How it runs inside the FSDP2 root's forward (like `training.chunked_forward`, for the same reasons): for one call
of the model, the input embedding's forward embeds the main ids and the D rolled ids in one call (one FSDP unit
call), the last decoder layer's call kwargs (causal mask, rotary position embeddings, CP attention arguments)
are captured and reused by the MTP layers, and the lm head's forward — which receives the final hidden states —
runs the MTP depths and attaches their (already normalised) loss to the logits it returns (`_AttachLoss`:
identity forward, its backward feeds the MTP loss a gradient of `loss_scale`), so backward reaches the MTP
layers through the root's own output. Parameters live under `mtp.layers.{k}.*` of the causal LM (saved and
resumed with the model; FSDP units via `mtp.layers.{}`).

HF checkpoints released with MTP layers (`mtp_layouts`): their tensors load into these modules and the HF export
writes them back under the checkpoint's own names. Where the checkpoint's model differs from Megatron's generic
block, the checkpoint's model is followed (its weights were trained that way): Qwen3-Next's MTP layer is a
full-attention layer with the sparse MoE and zero-centred norms, whatever the model's last layer is; Step-3.5
feeds depth 1 the hidden states before the main final norm and depth k depth k-1's output before its norm
(`MTPLayout.prenorm_hidden`); DeepSeek-V4's depth is its own module over the mHC residual streams
(models/deepseek_v4/mtp.py).
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MTP_KEY = "mtp"


class MTPLayer(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj, the model's decoder layer, final_layernorm (Megatron's names)."""

    def __init__(self, config, norm_cls: type, make_layer: Callable[[], nn.Module]):
        super().__init__()
        h, eps = config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)
        self.enorm, self.hnorm = norm_cls(h, eps=eps), norm_cls(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # `mtp_layouts.MTPLayout.layer_factory`: by default the model's decoder-layer class at the last main layer's
        # index (which only selects the attention type and a KV-cache slot, unused in training), so the MTP layer
        # attends like the model's top layer; a released checkpoint's layout may fix another layer kind.
        self.transformer_layer = make_layer()
        self.final_layernorm = norm_cls(h, eps=eps)

    def forward(self, hidden: Tensor, embedded: Tensor, layer_kwargs: dict) -> Tuple[Tensor, Tensor]:
        """(the output after final_layernorm, for the head; the output before it)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        out = self.transformer_layer(x, **layer_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return self.final_layernorm(out), out


class MTPBlock(nn.Module):
    def __init__(self, config, norm_cls: type, make_layer: Callable[[int], nn.Module], num_layers: int,
                 depth_class: Optional[type] = None):
        super().__init__()
        depth_class = depth_class or MTPLayer  # a released layout's own depth module (mtp_layouts.MTPLayout)
        self.layers = nn.ModuleList(depth_class(config, norm_cls, functools.partial(make_layer, k))
                                    for k in range(num_layers))


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_decoder().layers


def attach_mtp(model: nn.Module, num_layers: int, seed: int) -> nn.Module:
    """Adds `model.mtp` (D MTP layers built from the model's own norm and decoder-layer classes), initialised by
    the model's HF `_init_weights` from `manual_seed(seed + 1)`, on the model's device and dtype. Returns model."""
    from fsdp2_backend.models.mtp_layouts import mtp_layout

    layout = mtp_layout(model.config)
    layout.check(model.config, num_layers)
    norm_cls = type(model.get_decoder().norm)
    block = MTPBlock(model.config, norm_cls, layout.layer_factory(model), num_layers, layout.depth_class)
    layout.record_depth(model.config, num_layers)
    ref = next(model.parameters())
    if ref.device.type != "meta":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            for module in block.modules():
                model._init_weights(module)
        block.to(device=ref.device, dtype=ref.dtype)
    else:
        block.to(device="meta")
    model.add_module(MTP_KEY, block)
    return model


def roll_left(tensor: Tensor, k: int) -> Tensor:
    """Megatron's `roll_tensor(shifts=-1)` applied k times along the last dim: the last k positions become 0."""
    out = torch.zeros_like(tensor)
    if k < tensor.size(-1):
        out[..., :tensor.size(-1) - k] = tensor[..., k:]
    return out


def mtp_batch(batch: Dict[str, Tensor], num_layers: int) -> Dict[str, Tensor]:
    """Adds `mtp_input_ids_k`, `mtp_labels_k`, `mtp_loss_mask_k` (k = 1..D), rolled on the whole sequence (before
    any context-parallel split, which must then cut them like the other per-token keys)."""
    out = dict(batch)
    for k in range(1, num_layers + 1):
        out[f"mtp_input_ids_{k}"] = roll_left(batch["input_ids"], k)
        out[f"mtp_labels_{k}"] = roll_left(batch["labels"], k)
        out[f"mtp_loss_mask_{k}"] = roll_left(batch["loss_mask"], k)
    return out


class _AttachLoss(torch.autograd.Function):
    """Returns `output` unchanged; in backward, gives `loss` the gradient `scale` (Megatron's MTPLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, scale: float):
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        # a plain tensor even when the logits are distributed (tensor parallel): the loss is a plain one
        return grad_output, torch.full(ctx.loss_shape, ctx.scale, dtype=torch.float32,
                                       device=grad_output.device), None


def _plain(logits: Tensor) -> Tensor:
    """Logits as a plain tensor: under tensor parallel the head (called past its hooks) returns a distributed
    tensor, whose whole value every rank holds after `full_tensor()`."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def mtp_forward(model: nn.Module, batch: Dict[str, Tensor], num_layers: int,
                extra_backward_loss: Callable[[List[Tensor], List[Tensor]], Tensor], loss_scale: float = 1.0,
                ) -> Tuple[object, List[Tensor], List[Tensor]]:
    """One forward of `model` (the FSDP root, a causal LM with `attach_mtp`) on `batch` (this rank's share, with
    the `mtp_batch` keys): (the model's output, per-depth masked CE sums, per-depth token counts). The MTP
    training term `extra_backward_loss(sums, counts)` is attached to the returned logits (backward reaches it)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    mtp_ids = [batch[f"mtp_input_ids_{k}"] for k in range(1, num_layers + 1)]
    captured: Dict[str, object] = {}
    sums: List[Tensor] = []
    counts: List[Tensor] = []
    plain_head = head.forward
    own_head = head.__dict__.get("forward")
    rows = batch["input_ids"].size(0)

    # The embedding's call embeds the main ids and the rolled ones at once: the ids are joined before every other
    # hook (FSDP's, tensor parallel's input conversion) and split after all of them (tensor parallel's output
    # layout), so the MTP layers get their embeddings in the same layout as the decoder layers' inputs.
    def join_ids(_module, args, kwargs):
        return (torch.cat([args[0], *mtp_ids], dim=0),) + tuple(args[1:]), kwargs

    def split_embeddings(_module, _args, full):
        captured["embedded"] = full[rows:].chunk(num_layers, dim=0)
        return full[:rows].clone()  # not a view: FSDP2's pre-backward hook must stay on the output

    def capture_kwargs(module, args, kwargs):
        kw = dict(kwargs)
        kw.pop("hidden_states", None)
        captured["layer_kwargs"] = kw

    def head_with_mtp(hidden: Tensor) -> Tensor:
        logits = plain_head(hidden)
        layer_kwargs = captured["layer_kwargs"]
        state = captured.get("before_norm", hidden)
        for k, layer in enumerate(model.mtp.layers, start=1):
            normed, raw = layer(state, captured["embedded"][k - 1], layer_kwargs)
            state = raw if layout.prenorm_hidden else normed
            mtp_logits = _plain(plain_head(normed))
            losses = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.size(-1)).float(),
                                     batch[f"mtp_labels_{k}"].reshape(-1), reduction="none")
            mask = batch[f"mtp_loss_mask_{k}"].reshape(-1).float()
            sums.append((losses * mask).sum())
            counts.append(mask.sum())
        return _AttachLoss.apply(logits, extra_backward_loss(sums, counts), loss_scale)

    head.forward = head_with_mtp
    from fsdp2_backend.models.mtp_layouts import mtp_layout

    layout = mtp_layout(model.config)
    source = _decoder_layers(model)[layout.layer_index(model.config)]
    handles = [source.register_forward_pre_hook(capture_kwargs, with_kwargs=True),
               embed.register_forward_pre_hook(join_ids, with_kwargs=True, prepend=True),
               embed.register_forward_hook(split_embeddings)]
    hidden_from = layout.hidden_source(model)  # the checkpoint's model feeds depth 1 another state than the head's
    if hidden_from is not None:
        handles.append(hidden_from.register_forward_pre_hook(
            lambda module, args: captured.__setitem__("before_norm", args[0])))
    try:
        out = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        if own_head is None:
            del head.forward
        else:
            head.forward = own_head
    return out, [s.detach() for s in sums], [c.detach() for c in counts]


def load_mtp_weights(model: nn.Module, hf_dir: Optional[str]) -> int:
    """Copies the MTP tensors of an HF directory's safetensors into `model.mtp` (before sharding), in the
    checkpoint model's own layout (`mtp_layouts`: this project's `mtp.layers.*` export, Qwen3-Next's `mtp.*`);
    returns how many of our tensors were loaded (0: none there, the seeded init stays). A checkpoint whose MTP
    tensors fit another layout is left out with one line; one that half-fits (another depth) is a usage error."""
    import glob
    import os
    from contextlib import ExitStack

    from safetensors import safe_open

    from fsdp2_backend.models.mtp_layouts import load_from_checkpoint

    if not hf_dir or not os.path.isdir(hf_dir):
        return 0
    own = model.get_submodule(MTP_KEY)
    names = {f"{MTP_KEY}.{k}": v for k, v in own.state_dict().items()}
    buffers = frozenset(f"{MTP_KEY}.{k}" for k, _ in own.named_buffers())
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(path, framework="pt"))
                   for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))]
        where = {key: handle for handle in handles for key in handle.keys()}
        found = load_from_checkpoint(names, lambda key: where[key].get_tensor(key), list(where), model.config,
                                     optional=buffers, model_tensor=lambda name: model.get_parameter(name).detach())
    if not found:
        return 0
    own.load_state_dict({k[len(MTP_KEY) + 1:]: v for k, v in found.items()}, strict=False)  # buffers may be absent
    return len(found)
