"""The native configuration: the seed's seven argument groups, plus the Megatron meanings the seed lacks.

Every field of the seed (../shared/seed/fsdp2_arguments_reference.txt) is here (the `training` group in
`schema_training`) with its name, type, default and help text. Fields marked "(Megatron)" in their help are extensions that the Megatron front end fills and
that a native YAML may set too. Loading (YAML, `--group.field`) lives in `config_loading`, every rule in
`config_validation`, the derived parallel sizes in `config.layout`. This module must not import torch:
`--dry-run` stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Literal, Optional, Union

from fsdp2_backend.config.fields import help_field
from fsdp2_backend.config.schema_training import TrainingArguments
from fsdp2_backend.models.registry import model_id_aliases, model_id_names

# Other names of a model id: {name: (model id, whose name it is)}, declared by the ids' specs. Accepted by
# model.model_id, resolved once by validation (config/mindspeed_release_rules.py, which says which name the run took).
MODEL_ID_ALIASES = model_id_aliases()
DTYPES = ("bf16", "fp16", "fp32")


@dataclass
class ModelArguments:
    """Model and tokenizer loading and initialisation."""

    model_name_or_path: Optional[str] = help_field(None, "Local path of the model (HF directory). Required, unless "
                                               "`architecture` describes a model to build from scratch.")
    model_id: Optional[Literal[model_id_names()]] = help_field(  # type: ignore[valid-type]  (read live)
        None, "Model id of this project's own model implementation; unset runs the native transformers forward "
              "(longcat_flash: MindSpeed-LLM v26.1.0's name of longcat_flash_ngram).")
    init_model_with_meta_device: bool = help_field(False, "Build the model on the meta device, shard, then load or "
                                               "initialise it (saves memory at start-up).")
    trust_remote_code: bool = help_field(False, "Allow custom modelling code shipped with an HF model directory.")
    train_from_scratch: bool = help_field(False, "Initialise the weights randomly (seeded) instead of loading them.")
    tokenizer_name_or_path: Optional[str] = help_field(None, "Tokenizer path, when it differs from "
                                                   "model_name_or_path.")
    cache_dir: Optional[str] = help_field(None, "Cache directory for downloaded models.")
    use_fast_tokenizer: bool = help_field(True, "Use the fast (tokenizers library) tokenizer.")
    resize_vocab: bool = help_field(False, "Resize the embedding and lm_head to the tokenizer after adding tokens.")
    split_special_tokens: bool = help_field(False, "Split special tokens while tokenizing.")
    add_tokens: Optional[str] = help_field(None, "Non-special tokens to add to the tokenizer, comma-separated.")
    add_special_tokens: Optional[str] = help_field(None, "Special tokens to add to the tokenizer, comma-separated.")
    new_special_tokens_config: Optional[str] = help_field(
        None, "YAML file {'<token>': 'description'} for semantic initialisation of new special tokens; "
              "takes precedence over add_special_tokens.")
    init_special_tokens: Literal["noise_init", "desc_init", "desc_init_w_noise"] = help_field(
        "noise_init", "How new special tokens are initialised: noise_init (mean plus noise), desc_init "
                      "(from descriptions), desc_init_w_noise.")
    model_revision: str = help_field("main", "Model version: branch, tag or commit id.")
    hf_hub_token: Optional[str] = help_field(None, "Hugging Face Hub token.")
    ms_hub_token: Optional[str] = help_field(None, "ModelScope Hub token.")
    om_hub_token: Optional[str] = help_field(None, "Modelers Hub token.")
    quant_recipe_name: Optional[Literal["mxfp8", "tensorwise", "rowwise", "blockwise", "delayed"]] = help_field(
        None, "Quantisation recipe: mxfp8 (MX blocks of 32), or FP8 with one scale per tensor (tensorwise), per row "
              "(rowwise) or per 1x128 / 128x128 block (blockwise), or per tensor from an amax history (delayed) "
              "(Megatron --fp8-recipe).")
    quant_apply_modules: List[str] = help_field(["model.layers.{*}"], "Modules quantisation applies to.")
    quant_ignored_modules: List[str] = help_field(["*lm_head", "*gate"], "Modules quantisation skips.")
    quant_converters: List[str] = help_field(["quantize.linear.mx"], "Quantisation converters.")
    enable_fsdp_low_precision_all_gather: bool = help_field(True, "Low-precision FSDP all-gather (with quantisation).")
    quant_fp8_format: Literal["e4m3", "hybrid"] = help_field(
        "e4m3", "FP8 element format of the tensorwise / rowwise / blockwise / delayed recipes: e4m3 everywhere, or "
                "hybrid (E5M2 gradients) (Megatron --fp8-format).")
    quant_fp8_amax_history_len: int = help_field(1, "(Megatron) The delayed recipe's amax history length "
                                                     "(--fp8-amax-history-len).")
    quant_fp8_amax_compute_algo: Literal["most_recent", "max"] = help_field(
        "most_recent", "(Megatron) The delayed recipe's amax from its history: the latest or the maximum "
                       "(--fp8-amax-compute-algo).")
    quant_fp8_margin: int = help_field(0, "(Megatron) The delayed recipe's scale is divided by 2^margin "
                                          "(--fp8-margin).")
    fsdp_low_precision_all_gather_mode: Literal["on-demand", "all"] = help_field(
        "on-demand", "Low-precision all-gather mode: on demand for forward/backward weights, or all.")
    # Megatron extensions
    architecture: Optional[Dict[str, Any]] = help_field(
        None, "(Megatron) HF config keys built from Megatron architecture flags (model_type, num_hidden_layers, "
              "hidden_size, ...): the model to build when model_name_or_path is unset, checked against "
              "config.json when it is set.")
    tokenizer_type: Optional[str] = help_field(None, "(Megatron) --tokenizer-type; unset loads an HF tokenizer.")
    tokenizer_model: Optional[str] = help_field(None, "(Megatron) --tokenizer-model (SentencePiece / HF).")
    vocab_file: Optional[str] = help_field(None, "(Megatron) --vocab-file.")
    merge_file: Optional[str] = help_field(None, "(Megatron) --merge-file.")
    vocab_size: Optional[int] = help_field(None, "(Megatron) --vocab-size for the NullTokenizer and TikTokenizer.")
    tiktoken_pattern: Optional[Literal["v1", "v2"]] = help_field(None, "(Megatron) TikTokenizer regex; unset: v2.")
    tiktoken_num_special_tokens: int = help_field(1000, "(Megatron) TikTokenizer ids reserved for special tokens.")
    tokenizer_special_tokens: Optional[List[str]] = help_field(
        None, "(Megatron) TikTokenizer special tokens; unset: <unk> <s> </s> <mask> <pad> <cls> <sep>.")
    make_vocab_size_divisible_by: int = help_field(1, "(Megatron) Pad the embedding rows to a multiple of this "
                                                  "(Megatron's default is 128).")
    mtp_num_layers: Optional[int] = help_field(
        None, "(Megatron) Multi-token prediction depths (DeepSeek-V3 style, models/mtp.py); unset: none.")
    mtp_loss_scaling_factor: float = help_field(0.1, "(Megatron) Weight of the MTP loss (averaged over depths) in the "
                                                 "training loss.")
    # MindSpeed-LLM's MLA latent scales (models/mla_lora_scale.py; folded into the up-projections on HF export)
    mla_scale_q_lora: bool = help_field(False, "(MindSpeed) --enable-mla-scale-q-lora: MLA's normalised query latent "
                                        "× sqrt(hidden_size / q_lora_rank) before q_b_proj; the HF export folds "
                                        "the factor into q_b_proj.")
    mla_scale_kv_lora: bool = help_field(False, "(MindSpeed) --enable-mla-scale-kv-lora: MLA's normalised key/value "
                                         "latent × sqrt(hidden_size / kv_lora_rank) before kv_b_proj; the HF "
                                         "export folds the factor into kv_b_proj.")
    # Megatron's µP (maximal update parametrisation; models/mup.py, config/mup_rules.py)
    use_mup: bool = help_field(False, "(Megatron) µP: attention scale 1/d, logits × mup_output_mult, µP init from "
                                  "scratch, Adam lr/eps of hidden matrices ÷ width multiplier.")
    mup_base_hidden_size: Optional[int] = help_field(None, "(Megatron) µP base width; width multiplier = hidden_size / "
                                                       "this. Unset: hidden_size (multiplier 1).")
    mup_embedding_mult: float = help_field(1.0, "(Megatron) µP multiplier of the embedding output.")
    mup_output_mult: Optional[float] = help_field(None, "(Megatron) µP multiplier of the logits; unset: 1 / width "
                                                    "multiplier.")
    mup_base_head_dim: Optional[float] = help_field(None, "(Megatron) µP attention scale = sqrt(this or 1) / "
                                                      "head_dim ** mup_attn_scale_power.")
    mup_attn_scale_power: float = help_field(1.0, "(Megatron) µP attention-scale power (0.5: standard 1/sqrt(d)).")
    # Megatron's MoE router (megatron-core's TopKRouter); unset fields keep the model's own routing
    moe_router_score_function: Optional[Literal["softmax", "sigmoid", "sqrtsoftplus"]] = help_field(
        None, "(Megatron) Router score function (sqrtsoftplus: MindSpeed's sqrt(softplus(logits)), routed as "
              "sigmoid); unset: the model's own.")
    moe_router_pre_softmax: Optional[bool] = help_field(
        None, "(Megatron) Softmax over all experts before the top-k (no renormalisation); unset: the model's own.")
    moe_router_topk_scaling_factor: Optional[float] = help_field(None, "(Megatron) Scale of the top-k routing weights.")
    moe_router_num_groups: Optional[int] = help_field(None, "(Megatron) Expert groups of group-limited routing.")
    moe_router_group_topk: Optional[int] = help_field(None, "(Megatron) Groups each token may route to.")
    moe_router_enable_expert_bias: bool = help_field(
        False, "(Megatron) Aux-loss-free balancing: a per-expert selection bias updated after every step from the "
               "global token counts (saved in checkpoints).")
    moe_router_bias_update_rate: float = help_field(1e-3, "(Megatron) Expert-bias update rate.")
    moe_router_load_balancing_type: Optional[Union[str, List[str]]] = help_field(
        None, "(Megatron) aux_loss, seq_aux_loss, global_aux_loss, sinkhorn, none or mindspeed_seq_aux_loss "
              "(MindSpeed's --seq-aux under 'none', logged as load_balancing_loss) (or a list): Megatron's "
              "losses replace the model's own aux loss; unset: the HF model's own (router_aux_loss_coef).")
    moe_aux_loss_coeff: Union[float, List[float]] = help_field(
        0.0, "(Megatron) Coefficient of each load-balancing loss (one per type when a list).")
    moe_z_loss_coeff: Optional[float] = help_field(None, "(Megatron) Router z-loss coefficient.")
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = help_field(
        None, "(Megatron) Dtype of the router GEMM and routing; unset: the compute dtype.")


@dataclass
class DataArguments:
    """Dataset loading, preprocessing and format."""

    template: Optional[str] = help_field(None, "Prompt template name (SFT); unset takes it from the tokenizer.")
    dataset: Optional[Union[Dict[str, Any], str, List[str]]] = help_field(
        None, "Training data. Pretraining: an indexed prefix, a Megatron blend (a list [W1, P1, W2, P2], or one "
              "string 'W1 P1 W2 P2'), a raw .jsonl/.jsonl.gz/.parquet file, or MindSpeed's inline {file_name: "
              "FILE}. SFT: an inline dataset config or a dataset_info.json name.")
    eval_dataset: Optional[Union[Dict[str, Any], str]] = help_field(None, "Evaluation data; exclusive with val_size.")
    dataset_dir: str = help_field("./configs/fsdp2/data", "Directory of dataset configuration files.")
    cutoff_len: int = help_field(2048, "Sequence length after tokenisation (Megatron --seq-length).")
    train_on_prompt: bool = help_field(False, "Do not mask the prompt; exclusive with mask_history.")
    mask_history: bool = help_field(False, "Train on the last turn only; exclusive with train_on_prompt.")
    streaming: bool = help_field(False, "Stream the dataset; exclusive with max_samples, val_size must be an integer.")
    buffer_size: int = help_field(16384, "Shuffle buffer size when streaming.")
    mix_strategy: Literal["concat", "interleave_under", "interleave_over"] = help_field(
        "concat", "How several datasets are mixed.")
    interleave_probs: Optional[str] = help_field(None, "Comma-separated sampling probabilities for interleave mixing.")
    overwrite_cache: bool = help_field(False, "Re-run preprocessing even if a cached result exists.")
    preprocessing_batch_size: int = help_field(1000, "Documents per preprocessing batch.")
    preprocessing_num_workers: Optional[int] = help_field(None, "Preprocessing processes (Megatron --workers).")
    max_samples: Optional[int] = help_field(None, "Debugging: truncate each dataset to this many samples.")
    eval_num_beams: Optional[int] = help_field(None, "Beams for model.generate during evaluation.")
    ignore_pad_token_for_loss: bool = help_field(True, "Ignore padding labels in the loss.")
    val_size: float = help_field(0.0, "Validation size: an integer count or a fraction in (0, 1).")
    eval_on_each_dataset: bool = help_field(False, "Evaluate each dataset separately.")
    packing: bool = help_field(False, "Pack several short sequences into one (Megatron --pack).")
    neat_packing: bool = help_field(False, "Packing without cross-attention between packed sequences; sets packing.")
    tool_format: Optional[str] = help_field(None, "Tool format for function-calling examples.")
    default_system: Optional[str] = help_field(None, "Override the template's default system prompt.")
    enable_thinking: Optional[bool] = help_field(True, "Thinking mode for reasoning models (None keeps CoT tags).")
    tokenized_path: Optional[str] = help_field(None, "Where tokenised data is saved (if absent) or loaded (if present).")
    data_shared_file_system: bool = help_field(False, "The dataset lives on a file system shared by all nodes.")
    data_manager_type: Literal["lf", "mg"] = help_field("lf", "Data manager: lf (fine-tuning) or mg (pretraining).")
    split: str = help_field("100,0,0", "Train/valid/test split weights, comma-separated (Megatron --split).")
    create_attention_mask_in_dataloader: Optional[bool] = help_field(False, "Build the attention mask in the "
                                                                        "data loader.")
    no_shared_storage: Optional[bool] = help_field(False, "Nodes do not share storage: each node's local rank 0 "
                                                      "prepares the data.")
    dataloader_type: Literal["single", "cyclic"] = help_field("single", "single: Megatron's sequential pretraining "
                                                                    "sampler; cyclic: reshuffled per epoch.")
    reset_attention_mask: Optional[bool] = help_field(False, "Packed pretraining: documents do not attend across EOD "
                                                         "(actual_seq_len); needs append_eod.")
    append_eod: Optional[bool] = help_field(False, "Pretraining preprocessing: append EOD to each document.")
    # Megatron extensions
    data_cache_path: Optional[str] = help_field(None, "(Megatron) Where dataset index caches (.npy) are written.")
    mock_data: bool = help_field(False, "(Megatron) Train on synthetic data (MockGPTDataset).")
    eod_mask_loss: bool = help_field(False, "(Megatron) Mask the loss on EOD tokens.")
    reset_position_ids: bool = help_field(False, "(Megatron) Restart position ids after each EOD.")
    train_data_path: Optional[List[str]] = help_field(None, "(Megatron) Training split data (blend syntax kept).")
    valid_data_path: Optional[List[str]] = help_field(None, "(Megatron) Validation split data (blend syntax kept).")
    test_data_path: Optional[List[str]] = help_field(None, "(Megatron) Test split data (blend syntax kept).")
    mmap_bin_files: bool = help_field(True, "(Megatron) Memory-map the .bin files.")
    mid_level_dataset_surplus: float = help_field(0.005, "(Megatron) Extra fraction of samples each dataset of a "
                                                     "weighted blend builds beyond its share.")
    fim_data: bool = help_field(False, "(Megatron) Fill-in-the-middle samples (Megatron-LM's GPTFIMDataset).")
    fim_rate: float = help_field(0.5, "(Megatron) Probability that a sample (segment) becomes FIM.")
    fim_spm_rate: float = help_field(0.5, "(Megatron) Probability that a FIM sample uses SPM rather than PSM order.")
    fim_split_sample: Optional[str] = help_field(None, "(Megatron) Token splitting a sample into fragments for FIM.")
    fim_fragment_rate: Optional[float] = help_field(None, "(Megatron) FIM probability per fragment (fim_split_sample).")
    fim_no_prefix: Optional[str] = help_field(None, "(Megatron) Text prefix of fragments left without FIM.")
    fim_tokens: Dict[str, str] = help_field(
        {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>",
         "eod": "<|endoftext|>"}, "(Megatron) FIM tokens: prefix, middle, suffix, pad, eod (--fim-*-token).")


@dataclass
class ParallelArguments:
    """Distributed parallel layout and memory savings."""

    tp_size: int = help_field(1, "Tensor parallel size.")
    fsdp_size: int = help_field(1, "FSDP shard group size; 1 (or the whole world, MindSpeed's way of writing it, cp "
                               "and tp inside) shards over every data-parallel rank, a divisor of the "
                               "data-parallel size replicates across groups (HSDP).")
    recompute: bool = help_field(False, "Activation recomputation (checkpointing).")
    ep_size: int = help_field(1, "Expert parallel size (MoE).")
    ep_fsdp_size: int = help_field(1, "FSDP size inside the expert-parallel group.")
    cp_size: int = help_field(1, "Context parallel size.")
    cp_type: Literal["ulysses", "ring", "kvallgather"] = help_field(
        "ulysses", "Context parallel algorithm. kvallgather (MindSpeed: each rank keeps its queries and sees every "
                   "key/value) is the same exact attention as ring and runs as ring.")
    fsdp_modules: List[str] = help_field(["model.layers.{}", "model.embed_tokens", "lm_head"],
                                     "Modules wrapped by FSDP (globs); must not be empty.")
    ignored_modules: Optional[List[str]] = help_field(
        None, "Modules FSDP leaves alone: whole on every rank, their gradients summed over the data-parallel "
              "ranks after backward.")
    reshard_after_forward: bool = help_field(True, "Reshard FSDP parameters after forward.")
    shard_placement_fn: Optional[str] = help_field(None, "Dotted import path of a custom FSDP shard placement function.")
    efsdp_shard_placement_fn: Optional[str] = help_field("shard_by_dim_1", "Shard placement inside the expert group.")
    tp_colwise: List[str] = help_field(["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"],
                                   "Column-parallel modules (globs).")
    tp_rowwise: List[str] = help_field(["*.o_proj", "*.down_proj"], "Row-parallel modules (globs).")
    ep_modules: List[str] = help_field(["model.layers.{*}.mlp.experts"], "Expert-parallel modules (MoE).")
    ep_fsdp_modules: List[str] = help_field(["model.layers.{*}.mlp.experts"], "FSDP modules inside the expert group.")
    ep_dispatcher: Literal["eager", "fused", "mc2"] = help_field("eager", "MoE token dispatcher.")
    recompute_modules: List[str] = help_field(["model.layers.{*}"], "Modules recomputed when recompute is on.")
    param_dtype: Literal["bf16", "fp16", "fp32"] = help_field("bf16", "FSDP parameter (compute) dtype.")
    reduce_dtype: Literal["bf16", "fp16", "fp32"] = help_field("fp32", "FSDP gradient reduction dtype.")
    num_to_forward_prefetch: int = help_field(1, "FSDP modules prefetched in forward.")
    num_to_backward_prefetch: int = help_field(1, "FSDP modules prefetched in backward.")
    cpu_offload: bool = help_field(False, "FSDP2 CPU offload (CPUOffloadPolicy): sharded parameters, gradients and "
                                   "optimizer state on the host, the optimizer step there (Megatron "
                                   "--optimizer-cpu-offload, MindSpeed's FSDP cpu_offload); same results, less "
                                   "device memory.")
    activation_offload_layers: int = help_field(0, "Saved activations of the first N decoder layers kept in "
                                                "(pinned) host memory until backward (Megatron "
                                                "--cpu-offloading-num-layers); 0: none, -1: every layer. Not with "
                                                "recompute.")
    # MindSpeed-LLM c77308a1 fields (config/rules/mindspeed_master_fields.py says what each does here)
    hook_modules: List[str] = help_field(["model.layers.{*}"], "(MindSpeed) Modules its custom FSDP implementation "
                                         "hooks; no effect here (torch's FSDP2 is the implementation).")
    fsdp_implementation: Literal["native", "custom"] = help_field(
        "native", "(MindSpeed) native: torch's FSDP2; custom (MindSpeed's own Ascend FSDP) runs as native here, with "
                  "the same results.")
    enable_chunk_batch: bool = help_field(False, "(MindSpeed ChunkMBS) Run each chunk_mbs_modules module on slices of "
                                          "chunk_mbs samples under one FSDP unshard (less activation memory).")
    chunk_mbs: int = help_field(1, "(MindSpeed ChunkMBS) Samples per slice.")
    chunk_mbs_batch_dim: int = help_field(0, "(MindSpeed ChunkMBS) The batch dimension of the sliced inputs.")
    chunk_mbs_modules: List[str] = help_field(["model.layers.{*}"], "(MindSpeed ChunkMBS) Modules run slice by slice.")
    chunk_mbs_arg_indexs: List[int] = help_field([0], "(MindSpeed ChunkMBS) Positional arguments that are sliced.")
    chunk_mbs_kwarg_names: List[str] = help_field(
        ["position_embeddings", "position_ids", "attention_mask", "input_ids"],
        "(MindSpeed ChunkMBS) Keyword arguments that are sliced (those holding the batch dimension).")
    # Megatron extensions
    sequence_parallel: bool = help_field(False, "(Megatron) Sequence parallel for norms under tensor parallel.")
    distributed_backend: Optional[Literal["nccl", "gloo", "hccl"]] = help_field(
        None, "(Megatron) Process-group backend; unset picks it by device (hccl / nccl / gloo).")


@dataclass
class ProfilingArguments:
    """Performance profiling."""

    profile: bool = help_field(False, "Collect a profile.")
    profile_step_start: int = help_field(0, "First profiled step (inclusive, >= 0).")
    profile_step_end: int = help_field(-1, "Step where profiling stops (exclusive); -1 profiles to the end.")
    profile_ranks: List[int] = help_field([-1], "Ranks to profile; -1 profiles every rank.")
    profile_level: Literal["level_none", "level0", "level1", "level2"] = help_field(
        "level0", "Detail level: level_none / level0 / level1 / level2.")
    profile_export_type: Literal["text", "db"] = help_field("text", "Export format: text or db.")
    profile_data_simplification: bool = help_field(False, "Simplify the profile data.")
    profile_with_cpu: bool = help_field(False, "Record CPU activity.")
    profile_with_stack: bool = help_field(False, "Record call stacks.")
    profile_with_memory: bool = help_field(False, "Record memory allocations.")
    profile_record_shapes: bool = help_field(False, "Record tensor shapes.")
    profile_save_path: str = help_field("./profile", "Where profiles are written.")


@dataclass
class InferenceArguments:
    """Generation."""

    infer_backend: Literal["huggingface"] = help_field("huggingface", "Inference backend.")
    max_new_tokens: int = help_field(512, "Maximum generated tokens (prompt excluded).")
    do_sample: bool = help_field(False, "Sample instead of greedy decoding.")


@dataclass
class OptimizationArguments:
    """Fused operators and performance features."""

    use_fused_rmsnorm: bool = help_field(False, "Fused RMSNorm kernel.")
    moe_grouped_gemm: bool = help_field(False, "Grouped GEMM for MoE experts.")
    use_fused_rotary_pos_emb: bool = help_field(False, "Fused RoPE kernel.")
    use_flash_attn: bool = help_field(False, "Flash attention.")
    use_triton_gdn: bool = help_field(False, "Triton Gated DeltaNet kernels; at most one of use_triton_gdn and "
                                         "use_flash_gdn.")
    use_flash_gdn: bool = help_field(False, "AscendC Gated DeltaNet kernels.")
    chunk_loss_size: Optional[int] = help_field(None, "Compute the loss in chunks of this many tokens (saves memory).")
    gdn_chunk_size: int = help_field(64, "Gated DeltaNet chunk size.")
    use_triton_rmsnormgated: bool = help_field(False, "Triton gated RMSNorm kernel.")
    fix_router: bool = help_field(False, "Fixed balanced expert assignment (performance tuning only; changes results).")
    torch_compile: bool = help_field(False, "Compile each decoder block once with torch.compile (regional "
                                     "compilation, parallel/compile.py); same losses, faster steps after the first. "
                                     "Neither the seed nor MindSpeed has this switch; Megatron has no flag for it.")
    # MindSpeed-LLM c77308a1 fields (config/rules/mindspeed_master_fields.py says what each does here)
    use_sparse_flash_attn: bool = help_field(False, "(MindSpeed) NPU sparse flash attention for DSA models; this "
                                             "backend computes DSA attention with torch ops.")
    use_fused_lightning_indexer: bool = help_field(False, "(MindSpeed) NPU lightning-indexer kernel (DSA top-k).")
    use_fused_lightning_indexer_loss: bool = help_field(False, "(MindSpeed) NPU fused indexer KL-loss kernel (DSA).")
    use_ascend_mhc: bool = help_field(False, "(MindSpeed) Ascend fused DeepSeek-V4 mHC pre/post operators.")
    use_triton_swiglu_limit: bool = help_field(False, "(MindSpeed) Triton-Ascend SwiGLU-with-limit kernel "
                                               "(DeepSeek-V4).")
    pre_tokens: int = help_field(1048576, "(MindSpeed) Tokens before a query that NPU flash attention attends to.")
    next_tokens: int = help_field(0, "(MindSpeed) Tokens after a query that NPU flash attention attends to (0: "
                                  "causal).")
    indexer_loss_coeff: Optional[float] = help_field(None, "(MindSpeed v26.1.0) The release's spelling of "
                                                     "training.indexer_loss_coeff (MindSpeed master ignores it; "
                                                     "applied here).")


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


def dataset_entries(dataset) -> List[str]:
    """`data.dataset` as the list the pretraining data reads (validation stores it so): a list as it is; MindSpeed's inline {file_name: F}
    as [F]; a string as one path, or as a Megatron blend 'W1 P1 W2 P2' when it starts with a weight."""
    if dataset is None:
        return []
    if isinstance(dataset, dict):
        return [dataset["file_name"]] if dataset.get("file_name") else []
    if isinstance(dataset, list):
        return [str(entry) for entry in dataset]
    words = dataset.split()
    try:
        float(words[0])
    except (ValueError, IndexError):
        return [dataset]
    return words if len(words) > 1 else [dataset]
