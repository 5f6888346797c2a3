"""The checkpoint layer: the files a run writes and reads back, below training.

- `atomic`: writing a file or publishing a directory so that a reader sees all of it or nothing (fsync'd).
- `dirs`: our save directories (names, finding a checkpoint); `resume_point`: where a run starts.
- `formats`: one `Format` per kind of checkpoint (ours, Hugging Face, Megatron-LM torch_dist / legacy / torch_dcp /
  fsdp_dtensor), each detecting, describing and reading a directory into plain state.
- `commit`: making one of our checkpoints visible, the latest marker, rotation, why a save failed.
- `hf_export`, `hf_shards`: the Hugging Face writer (a live run's export, an offline conversion).

Megatron-LM's own layouts are read in `megatron_compat/checkpoint/` (the same layer). The package imports no torch
itself: validation reads `dirs` and `resume_point`.
"""
