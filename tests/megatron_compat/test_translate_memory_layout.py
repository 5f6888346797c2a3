"""Megatron's HSDP and host-offload flags: what each becomes (megatron_compat/translate/memory_layout.py).

Expected values are Megatron's arithmetic written out here: N distributed-optimizer instances over dp ranks are
HSDP groups of dp / N ranks (fsdp_size counts context-parallel ranks inside, as MindSpeed does)."""
import pytest

from fsdp2_backend.config.layout import parallel_layout
from fsdp2_backend.config.schema import ParallelArguments
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.translate import translate_megatron, translate_report
from tests.support.megatron_lines import TRANSLATE_BASE_FLAGS


def _parallel(argv, world_size):
    return translate_megatron(TRANSLATE_BASE_FLAGS + argv, world_size=world_size).fields.get("parallel", {})


@pytest.mark.parametrize("argv, world, fsdp_size, shard, replicate", [
    ("--num-distributed-optimizer-instances 2", 8, 4, 4, 2),
    ("--num-distributed-optimizer-instances 4", 16, 4, 4, 4),
    # tp 2 x cp 2 on 16 ranks: dp 4, 2 instances of 2; fsdp_size counts the cp ranks inside (2 x 2)
    ("--num-distributed-optimizer-instances 2 --tensor-model-parallel-size 2 --context-parallel-size 2", 16, 4, 2, 2),
])
def test_distributed_optimizer_instances_are_hsdp_replicas(argv, world, fsdp_size, shard, replicate):
    parallel = _parallel(argv.split(), world)
    assert parallel["fsdp_size"] == fsdp_size
    layout = parallel_layout(ParallelArguments(**parallel), world)
    assert (layout.dp_shard, layout.dp_replicate) == (shard, replicate)


def test_hsdp_flags_decline_or_say_what_differs():
    with pytest.raises(UsageError, match="--num-distributed-optimizer-instances: 3 instances do not divide"):
        translate_megatron(TRANSLATE_BASE_FLAGS + "--num-distributed-optimizer-instances 3".split(), world_size=8)
    report = translate_report(TRANSLATE_BASE_FLAGS + "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim"
                              .split(), world_size=4).report
    assert any("optim" in w and "replicated across the replica groups" in w for w in report.warnings)
    alone = translate_report(TRANSLATE_BASE_FLAGS + "--outer-dp-sharding-strategy optim".split(), world_size=4).report
    assert "--outer-dp-sharding-strategy" in alone.no_effect
    replication = translate_report(TRANSLATE_BASE_FLAGS + "--num-distributed-optimizer-instances 4".split(), world_size=4)
    assert "fsdp_size" not in replication.fields.get("parallel", {})
    assert any("plain replication" in w for w in replication.report.warnings)


def test_offload_flags_map_and_fractions_are_declined():
    parallel = _parallel("--optimizer-cpu-offload --optimizer-offload-fraction 1.0 --cpu-offloading-num-layers 3"
                         .split(), 2)
    assert parallel["cpu_offload"] is True and parallel["activation_offload_layers"] == 3
    assert "cpu_offload" not in _parallel([], 2)
    with pytest.raises(UsageError, match="--optimizer-offload-fraction: 0.5: FSDP2's CPU offload moves the whole"):
        translate_megatron(TRANSLATE_BASE_FLAGS + "--optimizer-cpu-offload --optimizer-offload-fraction 0.5".split())
    unused = translate_report(TRANSLATE_BASE_FLAGS + "--optimizer-offload-fraction 0.5".split()).report
    assert "--optimizer-offload-fraction" in unused.no_effect and not unused.declined


def test_no_shared_storage_reaches_the_data_field():
    """Megatron's --no-shared-storage: each node's local rank 0 builds the index caches (data.no_shared_storage)."""
    assert translate_megatron(TRANSLATE_BASE_FLAGS + ["--no-shared-storage"]).fields["data"]["no_shared_storage"] is True
    assert translate_megatron(TRANSLATE_BASE_FLAGS).fields["data"]["no_shared_storage"] is False
