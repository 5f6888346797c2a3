"""The native configuration: the seed's seven argument groups, plus the Megatron meanings the seed lacks.

Every field of the seed (../shared/seed/fsdp2_arguments_reference.txt) is here with its name, type, default
and help text. Fields marked "(Megatron)" in their help are extensions that the Megatron front end fills and
that a native YAML may set too. Loading (YAML, `--group.field`) lives in `config_loading`, every rule in
`config_validation`. This module must not import torch: `--dry-run` stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Literal, Optional, Union

MODEL_IDS = ("gpt_oss", "qwen3", "qwen3_moe", "qwen3_next", "step35", "mamba3", "minimax_m27", "deepseek_v3",
             "mixtral", "qwen2_moe")
DTYPES = ("bf16", "fp16", "fp32")


def _field(default: Any, help: str, **kw):
    """A dataclass field with its help text; list and dict defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelArguments:
    """Model and tokenizer loading and initialisation."""

    model_name_or_path: Optional[str] = _field(None, "Local path of the model (HF directory). Required, unless "
                                               "`architecture` describes a model to build from scratch.")
    model_id: Optional[Literal["gpt_oss", "qwen3", "qwen3_moe", "qwen3_next", "step35", "mamba3",
                               "minimax_m27", "deepseek_v3", "mixtral", "qwen2_moe"]] = _field(
        None, "Model id of this project's own model implementation; unset runs the native transformers forward.")
    init_model_with_meta_device: bool = _field(False, "Build the model on the meta device, shard, then load or "
                                               "initialise it (saves memory at start-up).")
    trust_remote_code: bool = _field(False, "Allow custom modelling code shipped with an HF model directory.")
    train_from_scratch: bool = _field(False, "Initialise the weights randomly (seeded) instead of loading them.")
    tokenizer_name_or_path: Optional[str] = _field(None, "Tokenizer path, when it differs from "
                                                   "model_name_or_path.")
    cache_dir: Optional[str] = _field(None, "Cache directory for downloaded models.")
    use_fast_tokenizer: bool = _field(True, "Use the fast (tokenizers library) tokenizer.")
    resize_vocab: bool = _field(False, "Resize the embedding and lm_head to the tokenizer after adding tokens.")
    split_special_tokens: bool = _field(False, "Split special tokens while tokenizing.")
    add_tokens: Optional[str] = _field(None, "Non-special tokens to add to the tokenizer, comma-separated.")
    add_special_tokens: Optional[str] = _field(None, "Special tokens to add to the tokenizer, comma-separated.")
    new_special_tokens_config: Optional[str] = _field(
        None, "YAML file {'<token>': 'description'} for semantic initialisation of new special tokens; "
              "takes precedence over add_special_tokens.")
    init_special_tokens: Literal["noise_init", "desc_init", "desc_init_w_noise"] = _field(
        "noise_init", "How new special tokens are initialised: noise_init (mean plus noise), desc_init "
                      "(from descriptions), desc_init_w_noise.")
    model_revision: str = _field("main", "Model version: branch, tag or commit id.")
    hf_hub_token: Optional[str] = _field(None, "Hugging Face Hub token.")
    ms_hub_token: Optional[str] = _field(None, "ModelScope Hub token.")
    om_hub_token: Optional[str] = _field(None, "Modelers Hub token.")
    quant_recipe_name: Optional[Literal["mxfp8"]] = _field(None, "Quantisation recipe.")
    quant_apply_modules: List[str] = _field(["model.layers.{*}"], "Modules quantisation applies to.")
    quant_ignored_modules: List[str] = _field(["*lm_head", "*gate"], "Modules quantisation skips.")
    quant_converters: List[str] = _field(["quantize.linear.mx"], "Quantisation converters.")
    enable_fsdp_low_precision_all_gather: bool = _field(True, "Low-precision FSDP all-gather (with quantisation).")
    fsdp_low_precision_all_gather_mode: Literal["on-demand", "all"] = _field(
        "on-demand", "Low-precision all-gather mode: on demand for forward/backward weights, or all.")
    # Megatron extensions
    architecture: Optional[Dict[str, Any]] = _field(
        None, "(Megatron) HF config keys built from Megatron architecture flags (model_type, num_hidden_layers, "
              "hidden_size, ...): the model to build when model_name_or_path is unset, checked against "
              "config.json when it is set.")
    tokenizer_type: Optional[str] = _field(None, "(Megatron) --tokenizer-type; unset loads an HF tokenizer.")
    tokenizer_model: Optional[str] = _field(None, "(Megatron) --tokenizer-model (SentencePiece / HF).")
    vocab_file: Optional[str] = _field(None, "(Megatron) --vocab-file.")
    merge_file: Optional[str] = _field(None, "(Megatron) --merge-file.")
    vocab_size: Optional[int] = _field(None, "(Megatron) --vocab-size for the NullTokenizer and TikTokenizer.")
    tiktoken_pattern: Optional[Literal["v1", "v2"]] = _field(None, "(Megatron) TikTokenizer regex; unset: v2.")
    tiktoken_num_special_tokens: int = _field(1000, "(Megatron) TikTokenizer ids reserved for special tokens.")
    tokenizer_special_tokens: Optional[List[str]] = _field(
        None, "(Megatron) TikTokenizer special tokens; unset: <unk> <s> </s> <mask> <pad> <cls> <sep>.")
    make_vocab_size_divisible_by: int = _field(1, "(Megatron) Pad the embedding rows to a multiple of this "
                                                  "(Megatron's default is 128).")
    mtp_num_layers: Optional[int] = _field(
        None, "(Megatron) Multi-token prediction depths (DeepSeek-V3 style, models/mtp.py); unset: none.")
    mtp_loss_scaling_factor: float = _field(0.1, "(Megatron) Weight of the MTP loss (averaged over depths) in the "
                                                 "training loss.")
    # Megatron's µP (maximal update parametrisation; models/mup.py, config/mup_rules.py)
    use_mup: bool = _field(False, "(Megatron) µP: attention scale 1/d, logits × mup_output_mult, µP init from "
                                  "scratch, Adam lr/eps of hidden matrices ÷ width multiplier.")
    mup_base_hidden_size: Optional[int] = _field(None, "(Megatron) µP base width; width multiplier = hidden_size / "
                                                       "this. Unset: hidden_size (multiplier 1).")
    mup_embedding_mult: float = _field(1.0, "(Megatron) µP multiplier of the embedding output.")
    mup_output_mult: Optional[float] = _field(None, "(Megatron) µP multiplier of the logits; unset: 1 / width "
                                                    "multiplier.")
    mup_base_head_dim: Optional[float] = _field(None, "(Megatron) µP attention scale = sqrt(this or 1) / "
                                                      "head_dim ** mup_attn_scale_power.")
    mup_attn_scale_power: float = _field(1.0, "(Megatron) µP attention-scale power (0.5: standard 1/sqrt(d)).")
    # Megatron's MoE router (megatron-core's TopKRouter); unset fields keep the model's own routing
    moe_router_score_function: Optional[Literal["softmax", "sigmoid"]] = _field(
        None, "(Megatron) Router score function; unset: the model's own.")
    moe_router_pre_softmax: Optional[bool] = _field(
        None, "(Megatron) Softmax over all experts before the top-k (no renormalisation); unset: the model's own.")
    moe_router_topk_scaling_factor: Optional[float] = _field(None, "(Megatron) Scale of the top-k routing weights.")
    moe_router_num_groups: Optional[int] = _field(None, "(Megatron) Expert groups of group-limited routing.")
    moe_router_group_topk: Optional[int] = _field(None, "(Megatron) Groups each token may route to.")
    moe_router_enable_expert_bias: bool = _field(
        False, "(Megatron) Aux-loss-free balancing: a per-expert selection bias updated after every step from the "
               "global token counts (saved in checkpoints).")
    moe_router_bias_update_rate: float = _field(1e-3, "(Megatron) Expert-bias update rate.")
    moe_router_load_balancing_type: Optional[Union[str, List[str]]] = _field(
        None, "(Megatron) aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none (or a list): Megatron's "
              "losses replace the model's own aux loss; unset: the HF model's own (router_aux_loss_coef).")
    moe_aux_loss_coeff: Union[float, List[float]] = _field(
        0.0, "(Megatron) Coefficient of each load-balancing loss (one per type when a list).")
    moe_z_loss_coeff: Optional[float] = _field(None, "(Megatron) Router z-loss coefficient.")
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = _field(
        None, "(Megatron) Dtype of the router GEMM and routing; unset: the compute dtype.")


@dataclass
class DataArguments:
    """Dataset loading, preprocessing and format."""

    template: Optional[str] = _field(None, "Prompt template name (SFT); unset takes it from the tokenizer.")
    dataset: Optional[Union[Dict[str, Any], str, List[str]]] = _field(
        None, "Training data. Pretraining: an indexed prefix, a Megatron blend (a list [W1, P1, W2, P2], or one "
              "string 'W1 P1 W2 P2'), a raw .jsonl/.jsonl.gz/.parquet file, or MindSpeed's inline {file_name: "
              "FILE}. SFT: an inline dataset config or a dataset_info.json name.")
    eval_dataset: Optional[Union[Dict[str, Any], str]] = _field(None, "Evaluation data; exclusive with val_size.")
    dataset_dir: str = _field("./configs/fsdp2/data", "Directory of dataset configuration files.")
    cutoff_len: int = _field(2048, "Sequence length after tokenisation (Megatron --seq-length).")
    train_on_prompt: bool = _field(False, "Do not mask the prompt; exclusive with mask_history.")
    mask_history: bool = _field(False, "Train on the last turn only; exclusive with train_on_prompt.")
    streaming: bool = _field(False, "Stream the dataset; exclusive with max_samples, val_size must be an integer.")
    buffer_size: int = _field(16384, "Shuffle buffer size when streaming.")
    mix_strategy: Literal["concat", "interleave_under", "interleave_over"] = _field(
        "concat", "How several datasets are mixed.")
    interleave_probs: Optional[str] = _field(None, "Comma-separated sampling probabilities for interleave mixing.")
    overwrite_cache: bool = _field(False, "Re-run preprocessing even if a cached result exists.")
    preprocessing_batch_size: int = _field(1000, "Documents per preprocessing batch.")
    preprocessing_num_workers: Optional[int] = _field(None, "Preprocessing processes (Megatron --workers).")
    max_samples: Optional[int] = _field(None, "Debugging: truncate each dataset to this many samples.")
    eval_num_beams: Optional[int] = _field(None, "Beams for model.generate during evaluation.")
    ignore_pad_token_for_loss: bool = _field(True, "Ignore padding labels in the loss.")
    val_size: float = _field(0.0, "Validation size: an integer count or a fraction in (0, 1).")
    eval_on_each_dataset: bool = _field(False, "Evaluate each dataset separately.")
    packing: bool = _field(False, "Pack several short sequences into one (Megatron --pack).")
    neat_packing: bool = _field(False, "Packing without cross-attention between packed sequences; sets packing.")
    tool_format: Optional[str] = _field(None, "Tool format for function-calling examples.")
    default_system: Optional[str] = _field(None, "Override the template's default system prompt.")
    enable_thinking: Optional[bool] = _field(True, "Thinking mode for reasoning models (None keeps CoT tags).")
    tokenized_path: Optional[str] = _field(None, "Where tokenised data is saved (if absent) or loaded (if present).")
    data_shared_file_system: bool = _field(False, "The dataset lives on a file system shared by all nodes.")
    data_manager_type: Literal["lf", "mg"] = _field("lf", "Data manager: lf (fine-tuning) or mg (pretraining).")
    split: str = _field("100,0,0", "Train/valid/test split weights, comma-separated (Megatron --split).")
    create_attention_mask_in_dataloader: Optional[bool] = _field(False, "Build the attention mask in the "
                                                                        "data loader.")
    no_shared_storage: Optional[bool] = _field(False, "Nodes do not share storage: each node's local rank 0 "
                                                      "prepares the data.")
    dataloader_type: Literal["single", "cyclic"] = _field("single", "single: Megatron's sequential pretraining "
                                                                    "sampler; cyclic: reshuffled per epoch.")
    reset_attention_mask: Optional[bool] = _field(False, "Packed pretraining: documents do not attend across EOD "
                                                         "(actual_seq_len); needs append_eod.")
    append_eod: Optional[bool] = _field(False, "Pretraining preprocessing: append EOD to each document.")
    # Megatron extensions
    data_cache_path: Optional[str] = _field(None, "(Megatron) Where dataset index caches (.npy) are written.")
    mock_data: bool = _field(False, "(Megatron) Train on synthetic data (MockGPTDataset).")
    eod_mask_loss: bool = _field(False, "(Megatron) Mask the loss on EOD tokens.")
    reset_position_ids: bool = _field(False, "(Megatron) Restart position ids after each EOD.")
    train_data_path: Optional[List[str]] = _field(None, "(Megatron) Training split data (blend syntax kept).")
    valid_data_path: Optional[List[str]] = _field(None, "(Megatron) Validation split data (blend syntax kept).")
    test_data_path: Optional[List[str]] = _field(None, "(Megatron) Test split data (blend syntax kept).")
    mmap_bin_files: bool = _field(True, "(Megatron) Memory-map the .bin files.")
    mid_level_dataset_surplus: float = _field(0.005, "(Megatron) Extra fraction of samples each dataset of a "
                                                     "weighted blend builds beyond its share.")
    fim_data: bool = _field(False, "(Megatron) Fill-in-the-middle samples (Megatron-LM's GPTFIMDataset).")
    fim_rate: float = _field(0.5, "(Megatron) Probability that a sample (segment) becomes FIM.")
    fim_spm_rate: float = _field(0.5, "(Megatron) Probability that a FIM sample uses SPM rather than PSM order.")
    fim_split_sample: Optional[str] = _field(None, "(Megatron) Token splitting a sample into fragments for FIM.")
    fim_fragment_rate: Optional[float] = _field(None, "(Megatron) FIM probability per fragment (fim_split_sample).")
    fim_no_prefix: Optional[str] = _field(None, "(Megatron) Text prefix of fragments left without FIM.")
    fim_tokens: Dict[str, str] = _field(
        {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>",
         "eod": "<|endoftext|>"}, "(Megatron) FIM tokens: prefix, middle, suffix, pad, eod (--fim-*-token).")


@dataclass
class ParallelArguments:
    """Distributed parallel layout and memory savings."""

    tp_size: int = _field(1, "Tensor parallel size.")
    fsdp_size: int = _field(1, "FSDP shard group size; 1 (or the whole world, MindSpeed's way of writing it, cp "
                               "and tp inside) shards over every data-parallel rank, a divisor of the "
                               "data-parallel size replicates across groups (HSDP).")
    recompute: bool = _field(False, "Activation recomputation (checkpointing).")
    ep_size: int = _field(1, "Expert parallel size (MoE).")
    ep_fsdp_size: int = _field(1, "FSDP size inside the expert-parallel group.")
    cp_size: int = _field(1, "Context parallel size.")
    cp_type: Literal["ulysses", "ring"] = _field("ulysses", "Context parallel algorithm.")
    fsdp_modules: List[str] = _field(["model.layers.{}", "model.embed_tokens", "lm_head"],
                                     "Modules wrapped by FSDP (globs); must not be empty.")
    ignored_modules: Optional[List[str]] = _field(None, "Modules FSDP leaves alone.")
    reshard_after_forward: bool = _field(True, "Reshard FSDP parameters after forward.")
    shard_placement_fn: Optional[str] = _field(None, "Dotted import path of a custom FSDP shard placement function.")
    efsdp_shard_placement_fn: Optional[str] = _field("shard_by_dim_1", "Shard placement inside the expert group.")
    tp_colwise: List[str] = _field(["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"],
                                   "Column-parallel modules (globs).")
    tp_rowwise: List[str] = _field(["*.o_proj", "*.down_proj"], "Row-parallel modules (globs).")
    ep_modules: List[str] = _field(["model.layers.{*}.mlp.experts"], "Expert-parallel modules (MoE).")
    ep_fsdp_modules: List[str] = _field(["model.layers.{*}.mlp.experts"], "FSDP modules inside the expert group.")
    ep_dispatcher: Literal["eager", "fused", "mc2"] = _field("eager", "MoE token dispatcher.")
    recompute_modules: List[str] = _field(["model.layers.{*}"], "Modules recomputed when recompute is on.")
    param_dtype: Literal["bf16", "fp16", "fp32"] = _field("bf16", "FSDP parameter (compute) dtype.")
    reduce_dtype: Literal["bf16", "fp16", "fp32"] = _field("fp32", "FSDP gradient reduction dtype.")
    num_to_forward_prefetch: int = _field(1, "FSDP modules prefetched in forward.")
    num_to_backward_prefetch: int = _field(1, "FSDP modules prefetched in backward.")
    # Megatron extensions
    sequence_parallel: bool = _field(False, "(Megatron) Sequence parallel for norms under tensor parallel.")
    distributed_backend: Optional[Literal["nccl", "gloo", "hccl"]] = _field(
        None, "(Megatron) Process-group backend; unset picks it by device (hccl / nccl / gloo).")


@dataclass
class TrainingArguments:
    """Hyper-parameters, optimizer, saving and logging."""

    output_dir: Optional[str] = _field(None, "Output directory (checkpoints, logs, exports). Required unless "
                                             "save_checkpoints is false.")
    optimizer: Literal["adamw", "muon"] = _field("adamw", "Optimizer.")
    o2_optimizer: bool = _field(False, "(MindSpeed) Keep the AdamW moments in bf16 (--o2-optimizer; bf16 training).")
    muon_momentum: float = _field(0.95, "Muon momentum (Megatron --muon-momentum).")
    muon_scale_mode: Optional[Literal["spectral", "unit_rms_norm", "shape_scaling"]] = _field(
        None, "(Megatron) Set: Megatron's Muon with this update scale (and the muon_* fields below); unset: "
              "torch.optim.Muon with Moonshot's AdamW-rms lr matching.")
    muon_nesterov: bool = _field(False, "(Megatron) Nesterov momentum in Megatron's Muon.")
    muon_coefficient_type: Literal["quintic", "simple", "polar_express"] = _field(
        "quintic", "(Megatron) Newton-Schulz coefficient schedule of Megatron's Muon.")
    muon_num_ns_steps: int = _field(5, "(Megatron) Newton-Schulz iterations of Megatron's Muon.")
    muon_extra_scale_factor: float = _field(1.0, "(Megatron) Extra factor on Megatron's Muon update.")
    muon_fp32_matmul_prec: Literal["medium", "high"] = _field(
        "medium", "(Megatron) Newton-Schulz matmuls of Megatron's Muon: medium bf16, high fp32.")
    lr: float = _field(1e-5, "Peak learning rate.")
    weight_decay: float = _field(0.01, "Weight decay (not applied to biases and 1-D parameters).")
    adam_beta1: float = _field(0.9, "AdamW beta1.")
    adam_beta2: float = _field(0.95, "AdamW beta2.")
    adam_epsilon: float = _field(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _field(1.0, "Gradient clipping norm (0 disables).")
    lr_scheduler_type: Literal["cosine", "linear", "constant", "inverse-square-root", "WSD"] = _field(
        "cosine", "Learning-rate schedule (Megatron --lr-decay-style).")
    warmup_ratio: float = _field(0.03, "Fraction of the decay steps spent in linear warmup.")
    min_lr: float = _field(1e-6, "Minimum learning rate.")
    num_train_epochs: float = _field(3.0, "Training epochs; max_steps > 0 overrides it.")
    max_steps: int = _field(-1, "Training steps (Megatron --train-iters); > 0 overrides num_train_epochs.")
    gradient_accumulation_steps: int = _field(1, "Micro-batches accumulated per optimizer step.")
    disable_shuffling: bool = _field(False, "Do not shuffle the training set.")
    seed: int = _field(42, "Random seed.")
    save_steps: int = _field(500, "Save a checkpoint every this many steps; 0: no periodic saves (MindSpeed's "
                                  "meaning; the final save still happens).")
    save_total_limit: Optional[int] = _field(3, "Keep at most this many checkpoints (oldest removed).")
    resume_from_checkpoint: Optional[str] = _field(None, "Checkpoint to resume from.")
    logging_steps: int = _field(1, "Log every this many steps.")
    stage: Literal["pt", "sft"] = _field("sft", "Training stage: pt (pretraining) or sft.")
    calculate_per_token_loss: bool = _field(False, "Scale the loss by the global batch's token count.")
    dataloader_num_workers: int = _field(0, "Data loader worker processes (0: main process).")
    dataloader_prefetch_factor: Optional[int] = _field(None, "Batches prefetched per worker.")
    dataloader_pin_memory: bool = _field(True, "Pin data loader memory.")
    dataloader_persistent_workers: bool = _field(False, "Keep data loader workers alive between epochs.")
    dataloader_drop_last: bool = _field(False, "Drop the last incomplete batch.")
    per_device_train_batch_size: int = _field(8, "Micro-batch size per device (Megatron --micro-batch-size).")
    save_only_model: bool = _field(False, "Save only the model (no optimizer, scheduler or RNG state).")
    save_async: bool = _field(False, "Save checkpoints asynchronously.")
    save_epochs: int = _field(1, "Save every this many epochs (when training by epochs).")
    save_hf_weights: bool = _field(True, "Export HF weights at the end of training.")
    # MindSpeed-LLM fields the seed's table omits (their YAMLs and launchers set them)
    log_throughput: bool = _field(False, "(MindSpeed) Show the model's training throughput in the log line "
                                         "(Megatron's 'throughput per GPU (TFLOP/s/GPU)'; Megatron --log-throughput).")
    log_cpu_memory: bool = _field(False, "(MindSpeed) Show this process's CPU memory (current and peak RSS) in the "
                                         "log line.")
    # Megatron extensions
    save_checkpoints: bool = _field(True, "(Megatron) False: no checkpoints and no export (a script "
                                          "without --save).")
    global_batch_size: Optional[int] = _field(None, "(Megatron) --global-batch-size; derives "
                                                    "gradient_accumulation_steps = gbs / (mbs x dp).")
    rampup_batch_size: Optional[List[int]] = _field(None, "(Megatron) [START, INCREMENT, SAMPLES]: the global batch "
                                                          "grows from START by INCREMENT to global_batch_size over "
                                                          "SAMPLES samples (needs train_samples).")
    step_batch_size_schedule: Optional[str] = _field(None, "(Megatron) 'TOKENS:GBS ...' (K/M/B/T suffixes): the "
                                                           "global batch from each threshold on (needs train_samples).")
    decrease_batch_size_if_needed: bool = _field(False, "(Megatron) Round the global batch down to a multiple of "
                                                        "micro batch x data-parallel size.")
    train_samples: Optional[int] = _field(None, "(Megatron) Train by samples instead of steps.")
    lr_warmup_iters: int = _field(0, "(Megatron) Warmup iterations (instead of warmup_ratio).")
    lr_warmup_samples: int = _field(0, "(Megatron) Warmup samples (when training by samples).")
    lr_warmup_init: float = _field(0.0, "(Megatron) Learning rate at the start of warmup.")
    lr_decay_iters: Optional[int] = _field(None, "(Megatron) Decay iterations (default: max_steps).")
    lr_decay_samples: Optional[int] = _field(None, "(Megatron) Decay samples (default: train_samples).")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = _field(
        "exponential", "(Megatron) Anneal style of the WSD schedule.")
    lr_wsd_decay_iters: Optional[int] = _field(None, "(Megatron) Anneal iterations of the WSD schedule.")
    lr_wsd_decay_samples: Optional[int] = _field(None, "(Megatron) Anneal samples of the WSD schedule.")
    exit_interval: Optional[int] = _field(None, "(Megatron) Stop (after saving) when the iteration is a "
                                                "multiple of this.")
    eval_interval: Optional[int] = _field(None, "(Megatron) Validate every this many steps; unset: never.")
    eval_iters: int = _field(100, "(Megatron) Validation iterations per evaluation.")
    no_load_optim: bool = _field(False, "(Megatron) Do not load the optimizer state on resume.")
    no_load_rng: bool = _field(False, "(Megatron) Do not load the RNG state on resume.")
    no_save_optim: bool = _field(False, "(Megatron) Do not save the optimizer state.")
    no_save_rng: bool = _field(False, "(Megatron) Do not save the RNG state.")
    finetune: bool = _field(False, "(Megatron) Load model weights only; restart iteration and samples at 0.")
    tensorboard_dir: Optional[str] = _field(None, "(Megatron) Write TensorBoard scalars here.")
    tensorboard_log_interval: int = _field(1, "(Megatron) Write the TensorBoard / W&B scalars every this many steps.")
    log_params_norm: bool = _field(False, "(Megatron) Show the parameters' L2 norm in the log line ('params norm') "
                                          "and as the params-norm scalar.")
    log_memory_to_tensorboard: bool = _field(False, "(Megatron) Write the device memory scalars (mem-allocated-bytes, "
                                                    "...; CPU: the process's RSS).")
    log_validation_ppl_to_tensorboard: bool = _field(False, "(Megatron) Write the validation perplexity scalars.")
    log_timers_to_tensorboard: bool = _field(False, "(Megatron) Write iteration-time, throughput and the phase "
                                                    "timers (forward-backward-time, optimizer-time) as scalars.")
    log_progress: bool = _field(False, "(Megatron) Append job starts and checkpoint saves, with throughput, to "
                                       "output_dir/progress.txt.")
    wandb_project: Optional[str] = _field(None, "(Megatron) Log the run to this Weights & Biases project (needs the "
                                                "wandb package; WANDB_MODE=offline works).")
    wandb_exp_name: Optional[str] = _field(None, "(Megatron) The W&B run's name; required with wandb_project.")
    wandb_save_dir: Optional[str] = _field(None, "(Megatron) Where W&B writes (default output_dir/wandb); it keeps "
                                                 "the run id, so a resumed run continues the same W&B run.")
    wandb_entity: Optional[str] = _field(None, "(Megatron) The W&B entity (team or user).")
    decoupled_lr: Optional[float] = _field(None, "(Megatron) Peak learning rate of the input embedding and output "
                                                 "layer weights (same schedule shape); unset: lr.")
    decoupled_min_lr: Optional[float] = _field(None, "(Megatron) Minimum learning rate of those weights; unset: "
                                                     "min_lr. Needs decoupled_lr.")
    apply_wd_to_qk_layernorm: bool = _field(False, "(Megatron) Apply weight decay to the QK-norm weights "
                                                   "(q_norm / k_norm) although they are 1-D.")
    start_weight_decay: Optional[float] = _field(None, "(Megatron) Weight decay at the start of training "
                                                       "(linear/cosine weight_decay_incr_style only).")
    end_weight_decay: Optional[float] = _field(None, "(Megatron) Weight decay at the end of training "
                                                     "(linear/cosine weight_decay_incr_style only).")
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = _field(
        "constant", "(Megatron) How weight decay goes from start_weight_decay to end_weight_decay over training; "
                    "constant uses weight_decay throughout.")
    lr_scheduler_on_resume: Literal["check", "checkpoint", "override"] = _field(
        "check", "(Megatron) On resume, when the schedule (lr, min_lr, warmup, decay, weight decay) differs from "
                 "the checkpoint's: check refuses to start (Megatron's default), checkpoint continues with the "
                 "checkpoint's schedule (--use-checkpoint-opt_param-scheduler), override uses this run's "
                 "(--override-opt_param-scheduler).")
    exit_duration_in_mins: Optional[float] = _field(None, "(Megatron) Stop (after saving) once training has run "
                                                          "this many minutes; every rank stops at the same "
                                                          "iteration.")
    check_for_nan_in_loss_and_grad: bool = _field(True, "(Megatron) Stop the run with an error at the first "
                                                        "iteration whose loss or gradient norm is NaN/Inf (nothing "
                                                        "saved or exported after it); false skips such iterations "
                                                        "(--no-check-for-nan-in-loss-and-grad).")
    exit_signal_handler: bool = _field(False, "(Megatron) On exit_signal (SIGTERM by default: a scheduler's "
                                              "preemption), save a checkpoint at the next iteration boundary and "
                                              "exit (--exit-signal-handler).")
    exit_signal: str = _field("SIGTERM", "(Megatron) The signal exit_signal_handler catches (a name such as SIGTERM "
                                         "or SIGUSR1, or its number).")


@dataclass
class ProfilingArguments:
    """Performance profiling."""

    profile: bool = _field(False, "Collect a profile.")
    profile_step_start: int = _field(0, "First profiled step (inclusive, >= 0).")
    profile_step_end: int = _field(-1, "Step where profiling stops (exclusive); -1 profiles to the end.")
    profile_ranks: List[int] = _field([-1], "Ranks to profile; -1 profiles every rank.")
    profile_level: Literal["level_none", "level0", "level1", "level2"] = _field(
        "level0", "Detail level: level_none / level0 / level1 / level2.")
    profile_export_type: Literal["text", "db"] = _field("text", "Export format: text or db.")
    profile_data_simplification: bool = _field(False, "Simplify the profile data.")
    profile_with_cpu: bool = _field(False, "Record CPU activity.")
    profile_with_stack: bool = _field(False, "Record call stacks.")
    profile_with_memory: bool = _field(False, "Record memory allocations.")
    profile_record_shapes: bool = _field(False, "Record tensor shapes.")
    profile_save_path: str = _field("./profile", "Where profiles are written.")


@dataclass
class InferenceArguments:
    """Generation."""

    infer_backend: Literal["huggingface"] = _field("huggingface", "Inference backend.")
    max_new_tokens: int = _field(512, "Maximum generated tokens (prompt excluded).")
    do_sample: bool = _field(False, "Sample instead of greedy decoding.")


@dataclass
class OptimizationArguments:
    """Fused operators and performance features."""

    use_fused_rmsnorm: bool = _field(False, "Fused RMSNorm kernel.")
    moe_grouped_gemm: bool = _field(False, "Grouped GEMM for MoE experts.")
    use_fused_rotary_pos_emb: bool = _field(False, "Fused RoPE kernel.")
    use_flash_attn: bool = _field(False, "Flash attention.")
    use_triton_gdn: bool = _field(False, "Triton Gated DeltaNet kernels; at most one of use_triton_gdn and "
                                         "use_flash_gdn.")
    use_flash_gdn: bool = _field(False, "AscendC Gated DeltaNet kernels.")
    chunk_loss_size: Optional[int] = _field(None, "Compute the loss in chunks of this many tokens (saves memory).")
    gdn_chunk_size: int = _field(64, "Gated DeltaNet chunk size.")
    use_triton_rmsnormgated: bool = _field(False, "Triton gated RMSNorm kernel.")
    fix_router: bool = _field(False, "Fixed balanced expert assignment (performance tuning only; changes results).")


GROUPS: Dict[str, type] = {
    "model": ModelArguments,
    "data": DataArguments,
    "parallel": ParallelArguments,
    "training": TrainingArguments,
    "profiling": ProfilingArguments,
    "inference": InferenceArguments,
    "optimization": OptimizationArguments,
}


@dataclass
class Config:
    """The whole native configuration: one instance of each group."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    parallel: ParallelArguments = field(default_factory=ParallelArguments)
    training: TrainingArguments = field(default_factory=TrainingArguments)
    profiling: ProfilingArguments = field(default_factory=ProfilingArguments)
    inference: InferenceArguments = field(default_factory=InferenceArguments)
    optimization: OptimizationArguments = field(default_factory=OptimizationArguments)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """{group: {field: value}} for every field, in declaration order."""
        return {name: {f.name: getattr(getattr(self, name), f.name) for f in fields(GROUPS[name])}
                for name in GROUPS}


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of every parallel dimension for a world size, derived once from the config."""

    world_size: int
    tp: int
    cp: int
    dp: int            # data-parallel ranks = world / (tp x cp)
    dp_shard: int      # FSDP shard group size
    dp_replicate: int  # HSDP replicas = dp / dp_shard
    ep: int
    ep_fsdp: int


def fsdp_shard_size(fsdp_size: int, world_size: int, dp: int, cp: int) -> int:
    """The data-parallel ranks one FSDP group shards over, from `fsdp_size` as MindSpeed counts it: the ranks
    sharding the parameters, context-parallel ranks inside (fsdp 8 with cp 2 on 8 ranks is 4 data-parallel
    shards); 1, or the whole world, means every data-parallel rank. 0 when it fits no layout (validation says
    why)."""
    if fsdp_size <= 1 or fsdp_size == world_size or fsdp_size == dp * cp:
        return dp
    if fsdp_size % cp or dp % (fsdp_size // cp):
        return 0
    return fsdp_size // cp


def parallel_layout(parallel: ParallelArguments, world_size: int) -> ParallelLayout:
    """Sizes for `world_size`; assumes `config_validation` accepted them."""
    tp, cp = parallel.tp_size, parallel.cp_size
    dp = max(world_size // (tp * cp), 1)
    dp_shard = fsdp_shard_size(parallel.fsdp_size, world_size, dp, cp)
    return ParallelLayout(world_size=world_size, tp=tp, cp=cp, dp=dp, dp_shard=dp_shard,
                          dp_replicate=max(dp // max(dp_shard, 1), 1), ep=parallel.ep_size, ep_fsdp=parallel.ep_fsdp_size)
