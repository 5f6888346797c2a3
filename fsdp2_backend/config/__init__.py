"""The native configuration: schema (the seed's seven groups), loading (YAML, `--group.field`), validation.

Torch-free, so `--dry-run` stays fast. `from fsdp2_backend.config import Config` is the public name.
"""
from fsdp2_backend.config.layout import ParallelLayout, parallel_layout
from fsdp2_backend.config.schema import (DTYPES, GROUPS, Config, DataArguments, InferenceArguments,
                                         ModelArguments, OptimizationArguments, ParallelArguments,
                                         ProfilingArguments, TrainingArguments)

__all__ = ["DTYPES", "GROUPS", "Config", "DataArguments", "InferenceArguments", "ModelArguments",
           "OptimizationArguments", "ParallelArguments", "ParallelLayout", "ProfilingArguments", "TrainingArguments",
           "parallel_layout"]
