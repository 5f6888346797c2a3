"""Activation offload of whole layers (parallel/offload.py): the first N decoder layers run under the host
saved-tensor hooks, the others untouched, and loss and gradients equal the model without offload (on CPU the
tensors are already on the host: the test shows the wiring and the unchanged math; the device memory figure is
benchmarks/gpu_check.py's offload row). CPU offload of parameters and optimizer state trains in the multi-node
test (tests/e2e/test_multinode.py) against a one-rank run without it."""
import copy

import torch

from fsdp2_backend.parallel.offload import apply_activation_offload, offload_policy, packed_tensors
from tests.support.tiny_models import tiny_qwen3_config


def test_first_layers_offloaded_and_the_math_unchanged():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_qwen3_config(num_hidden_layers=3))
    model = copy.deepcopy(reference)
    wrapped = apply_activation_offload(model, 2, "cpu")
    assert wrapped == list(model.model.layers)[:2] and packed_tensors(reference) is None
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (reference, model):
        loss = m(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    counts = [getattr(layer, "host_activations", None) for layer in model.model.layers]
    assert counts[0].packed > 0 and counts[1].packed == counts[0].packed and counts[2] is None
    assert packed_tensors(model) == 2 * counts[0].packed
    assert offload_policy(False, "cuda") is None and offload_policy(True, "cpu").pin_memory is False
    assert offload_policy(True, "cuda").pin_memory is True
