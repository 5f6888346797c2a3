"""Megatron-LM's checkpoint formats (torch_dist, legacy `mp_rank_*`, the distributed optimizer's buckets), read
into plain state dicts and a config; the engine's `training/` consumes them."""
