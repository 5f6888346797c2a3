"""Megatron's Muon (training/muon.py) against a plain-torch reference written here from the Muon formulas (megatron-
core 0.16.1's own Muon needs emerging-optimizers, not installed): Newton-Schulz schedules, scale modes, the whole
step; FSDP2 on 2 ranks steps as 1 rank; the --muon-* flags map or are declined with their reason."""
import math
import os
import tempfile

import pytest
import torch

from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.config.validation import validate
from fsdp2_backend.training.muon import MegatronMuon, muon_scale_factor, newton_schulz
from megatron_compat.translate import translate_megatron
from tests.support.launchers import run_distributed
from fsdp2_backend.usage_errors import UsageError

# Coefficient schedules as published: Muon's single tuple (Keller Jordan) and modded-nanogpt's quintic schedule.
SIMPLE = [(3.4445, -4.7750, 2.0315)]
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def _reference_ns(g, schedule, steps):
    """X0 = G / ||G||_F (of G^T when G is tall); X <- a X + b (X X^T) X + c (X X^T)^2 X; in float64."""
    x = g.double().T if g.shape[0] > g.shape[1] else g.double()
    x = x / x.norm()
    for k in range(steps):
        a, b, c = schedule[k % len(schedule)]
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return (x.T if g.shape[0] > g.shape[1] else x).float()


@pytest.mark.parametrize("shape", [(24, 16), (7, 24), (32, 32)])
def test_newton_schulz_equals_the_formulas(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for kind, schedule in (("quintic", QUINTIC), ("simple", SIMPLE)):
        for steps in (1, 5, 7):
            got = newton_schulz(g, steps, kind, matmul_precision="high")
            torch.testing.assert_close(got, _reference_ns(g, schedule, steps), rtol=1e-4, atol=1e-5)
    # medium: the iterations in bf16 (Megatron's default --muon-fp32-matmul-prec), close to the fp32 result
    medium = newton_schulz(g, 5, "quintic", matmul_precision="medium")
    assert medium.dtype == torch.float32 and 0 < (medium - newton_schulz(g, 5, "quintic", "high")).abs().max() < 0.05
    # torch.optim.Muon's own iteration (bf16, one tuple) agrees with "simple" at bf16 accuracy
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.testing.assert_close(newton_schulz(g, 5, "simple", "medium"),
                               _zeropower_via_newtonschulz(g, SIMPLE[0], 5, 1e-7).float(), rtol=0.05, atol=0.03)
    # the result is near-orthogonal: singular values around 1
    s = torch.linalg.svdvals(newton_schulz(g, 5, "quintic", "high"))
    assert 0.5 < s.min() and s.max() < 1.5


def test_scale_factors():
    assert muon_scale_factor(64, 16, "spectral") == 8.0 and muon_scale_factor(16, 64, "spectral") == 8.0
    assert muon_scale_factor(64, 16, "unit_rms_norm") == 2.0 and muon_scale_factor(16, 64, "unit_rms_norm") == 0.5
    assert muon_scale_factor(64, 16, "shape_scaling") == 2.0 and muon_scale_factor(16, 64, "shape_scaling") == 1.0


def _mlp():
    torch.manual_seed(0)
    # tall, wide and uneven (7 rows on 2 ranks) matrices
    return torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 7, bias=False))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(3)]


OPTIONS = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, num_ns_steps=5, coefficient_type="quintic",
               scale_mode="spectral", extra_scale_factor=0.2, matmul_precision="high")


def test_step_equals_the_reference_step():
    model, ref = _mlp(), _mlp()
    opt = MegatronMuon(model.parameters(), **OPTIONS)
    buffers = [torch.zeros_like(p) for p in ref.parameters()]
    o = OPTIONS
    for x in _batches():
        for m in (model, ref):
            m(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # Megatron's OrthogonalizedOptimizer step, from its description
            for p, buf in zip(ref.parameters(), buffers):
                p.mul_(1 - o["lr"] * o["weight_decay"])
                buf.mul_(o["momentum"]).add_((1 - o["momentum"]) * p.grad)
                update = p.grad + o["momentum"] * (buf - p.grad)  # nesterov
                scale = math.sqrt(max(p.shape)) * o["extra_scale_factor"]
                p.sub_(o["lr"] * scale * _reference_ns(update, QUINTIC, 5))
                p.grad = None
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _fsdp_worker(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = MegatronMuon(model.parameters(), **OPTIONS)
    for x in _batches():
        model(x).pow(2).sum().backward()  # same data on both ranks; FSDP averages the equal grads
        opt.step()
        opt.zero_grad()
    full = [p.full_tensor() for p in model.parameters()]
    if rank == 0:
        torch.save(full, out)


def test_two_fsdp2_ranks_step_as_one_rank():
    model = _mlp()
    opt = MegatronMuon(model.parameters(), **OPTIONS)
    for x in _batches():
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "w.pt")
        run_distributed(_fsdp_worker, 2, out)
        got = torch.load(out)
    for ref, p in zip(model.parameters(), got):
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
        "--micro-batch-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --lr 1e-3 "
        "--train-iters 5").split()


def test_muon_flags_map_to_megatrons_muon():
    from fsdp2_backend.training.muon import megatron_muon_options

    t = translate_megatron(BASE + "--optimizer muon --muon-extra-scale-factor 0.2 --muon-nesterov "
                                  "--muon-num-ns-steps 6 --muon-scale-mode unit_rms_norm".split())
    training = validate(Config(**{g: GROUPS[g](**v) for g, v in t.fields.items()}), 1).training
    assert training.muon_momentum == 0.9  # Megatron-LM's --muon-momentum default
    assert megatron_muon_options(training) == dict(nesterov=True, num_ns_steps=6, coefficient_type="quintic",
                                                   scale_mode="unit_rms_norm", extra_scale_factor=0.2,
                                                   matmul_precision="medium")
    adam = translate_megatron(BASE + ["--muon-extra-scale-factor", "0.2"])  # no muon: the option has no effect
    assert "muon_extra_scale_factor" not in adam.fields["training"]
    for flags, flag in (("--muon-no-split-qkv", "--muon-no-split-qkv"),
                        ("--muon-scalar-optimizer lion", "--muon-scalar-optimizer"),
                        ("--muon-tp-mode blockwise --tensor-model-parallel-size 2", "--muon-tp-mode")):
        with pytest.raises(UsageError) as info:
            translate_megatron(BASE + ["--optimizer", "muon"] + flags.split())
        assert [m for m in info.value.messages if m.startswith(flag + ":")], info.value.messages
    config = Config()
    config.training.muon_nesterov = True  # a Megatron-Muon option without Megatron's Muon
    config.training.max_steps = 1
    config.training.save_checkpoints = False
    with pytest.raises(UsageError) as info:
        validate(config, 1)
    assert any(m.startswith("training.muon_nesterov: an option of Megatron's Muon") for m in info.value.messages)
