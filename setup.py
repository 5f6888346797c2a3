"""Installs the Megatron-compatible FSDP2 training backend.

torch: any version >= 2.9 (NPU and CUDA users keep their own build); the Makefile pins the CPU wheel CI installs.
"""
from setuptools import find_packages, setup

setup(
    name="megatron-fsdp2",
    version="0.1.0",
    description="A Megatron-LM compatible drop-in FSDP2 training backend over Hugging Face models",
    python_requires=">=3.10",
    # Two top-level packages, both names our own: nothing that shadows another PyPI project (Hugging Face's
    # `kernels`, which transformers >= 5.25 imports; `tools`). tools/*.py are scripts, not a package.
    packages=find_packages(include=["megatron_compat", "megatron_compat.*", "fsdp2_backend", "fsdp2_backend.*"]),
    package_data={"megatron_compat.parse": ["*.json", "*.txt"]},
    install_requires=[
        "torch>=2.9",  # the exact CPU wheel CI uses is pinned in the Makefile
        "numpy",
        "PyYAML",
        "transformers>=5.0",
        "tokenizers",
        "safetensors",
        "tiktoken",
        "sentencepiece",
        "numba",  # the dataset index loops (megatron_compat/data/index_kernels.py), compiled from a wheel
    ],
    extras_require={
        # megatron-core is the reference implementation the tests compare against; never used at run time.
        # triton: the RMSNorm kernel's tests run it under the triton interpreter on CPU (~290 MB wheel).
        "test": ["pytest", "pytest-xdist", "megatron-core==0.16.1", "pyarrow", "nltk", "triton", "wandb", "tensorboard",
                 "matplotlib", "datasets", "torchao",
                 "accelerate",  # transformers' FP8 from_pretrained (the reference of tests/models/test_fp8_block_loading.py)
                 "psutil"],  # megatron-core's dist_checkpointing.save (tests/megatron_compat/test_megatron_import.py) needs it
        "triton": ["triton"],
        "quant": ["torchao"],  # model.quant_recipe_name mxfp8 (MX casts; MXFP8 GEMMs on MX hardware)
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],  # --wandb-project (training.wandb_project)
        "plot": ["matplotlib"],  # tools/compare_runs.py --plot
        "data": ["pyarrow", "nltk"],  # .parquet input, --split-sentences
        "sft": ["datasets"],  # stage sft / data_manager_type lf (HF datasets: files, mixing, streaming, caching)
        # Documented only; never installed by CI (torch_npu without the Ascend toolkit breaks `import torch`).
        "npu": ["torch_npu", "triton-ascend"],
    },
    scripts=[],
)
