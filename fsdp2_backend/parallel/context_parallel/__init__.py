"""Context parallel (our own: torch's `context_parallel` has no CPU sharding rules).

- `attention.enable_context_parallel(model, cp_mesh, cp_type)`: switch an HF model's attention to Ulysses or ring.
- `batch.shard_batch_for_cp(batch, cp_rank, cp_size, cp_type)`: this rank's part of the sequence.
- `batch.cp_token_mean(loss_sum, token_count, group)`: the loss each rank back-propagates.
- `ulysses`, `ring`, `blockwise`: the algorithms. Nothing is imported here: each caller
  imports the part it uses (the torch-free layout checks are `fsdp2_backend.config.tp_cp_checks`).
"""
