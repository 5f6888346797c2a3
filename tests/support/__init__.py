"""Shared test builders (no tests here): what several test modules build the same way, so that no test module
imports another (tests/tools/test_test_layout.py checks it).

- Launching processes: `launchers` (gloo ranks, the entry point, any command; their logs), `preprocess` (the
  preprocessing tool); `launch_scan` reads which tests launch what (tests/conftest.py marks from it).
- Tiny models keyed by id: `tiny_models` (`TINY_CONFIGS`, one per registry id, and tiny HF directories),
  `step35_reference`, `qwen3_next_parallel`, `mtp_layouts`, `mtp_parallel_runs`.
- Megatron references: `megatron_reference` (its datasets), `megatron_checkpoints` (checkpoints megatron-core saves),
  `megatron_training` (its training run to resume), `megatron_genuine` (args its parser made), `megatron_lines`
  (launch lines), `router_reference` / `router_runs` (its router), `kernel_references` (plain-loop kernels).
- MindSpeed YAML fixtures: `mindspeed_yaml`, `newer_ids_yaml`, `step35_yaml`; SFT: `sft_assets`.
- Others: `configs` (config builders), `disk` (real disk faults), `save_recorder`, `trainer_parity`, `import_graph`.
"""
