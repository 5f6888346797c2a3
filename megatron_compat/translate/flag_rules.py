"""What becomes of each Megatron-LM / MindSpeed flag under FSDP2: the disposition table, as data.

Three kinds, one per flag: `mapped` (a native config field takes its meaning; the text names the field),
`no_effect` (accepted, nothing to do under FSDP2: overlap, fusion, checkpoint-format and logging extras),
`declined` (its meaning cannot be honoured and would change results: exit 2, the text says why and what to do).
Tables are keyed by the option name (`--no-rope-fusion` → `no_rope_fusion`). The mapped flags and the
architecture flags are handled in `translate_handlers` and `architecture`, which may decline them or find them
without effect for particular values. Megatron-LM groups that are wholly out of scope get a
group-wide rule. `fsdp2_backend/cli/gen_migration_table.py` prints this table, so the README cannot drift from the code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

MAPPED, NO_EFFECT, DECLINED = "mapped", "no_effect", "declined"


@dataclass(frozen=True)
class Rule:
    """The disposition of one flag (by dest) and its explanation."""

    kind: str
    text: str


def _names(block: str):
    return block.split()


# --- no effect under FSDP2 -----------------------------------------------------------------------------------------

_NO_EFFECT: Dict[str, str] = {
    "a layer-spec or checkpoint-layout choice of Megatron-LM's ModelOpt model builder (Transformer Engine or local "
    "modules: the same math); this backend builds HF modules and writes its own checkpoints":
        """export_te_mcore_model export_default_te_spec export_force_local_attention export_legacy_megatron
        export_model_type""",
    "sizes an inference KV cache (MindSpeed-LLM registers it with its DSA indexer; pretraining builds no such "
    "cache), so training reads nothing from it":
        """max_batch_size""",
    "selects a fused or vendor kernel for the same math; this backend picks its own kernels":
        """use_fused_mlp mla_fa_divide_qk cross_entropy_loss_fusion cross_entropy_fusion_impl no_masked_softmax_fusion
        no_bias_gelu_fusion no_bias_swiglu_fusion no_bias_dropout_fusion no_rope_fusion
        no_gradient_accumulation_fusion no_persist_layer_norm transformer_impl attention_backend
        flash_attention_version use_transformer_engine_op_fuser use_fused_weighted_squared_relu
        fused_residual_rmsnorm use_te_activation_func moe_permute_fusion moe_router_fusion
        moe_permute_fusion_into_hybridep mla_down_proj_fusion disable_jit_fuser use_kitchen_attention
        kitchen_attention_backend use_fused_swiglu gemm_gradient_accumulation_fusion use_ascend_coc
        coc_fused_kernel coc_parallel_num use_ascend_mc2 use_mc2 mla_fa_without_pad use_sparse_flash_attn
        use_fused_lightning_indexer use_fused_lightning_indexer_loss use_fused_mhc use_triton_mhc
        use_fusion_attn_v2 use_fused_ring_attention_update use_fused_moe_token_permute_and_unpermute
        mla_mm_split enable_mla_absorb shape_order megatron_cp_in_bnsd use_deter_comp lora_fusion
        disable_bf16_reduced_precision_matmul use_mcore_models attention_softmax_in_fp32
        mtp_mem_efficient_logits kv_head_repeat_before_uly_alltoall spec batch_invariant_mode
        batch_invariant_backend jit_compile topk_softmax_in_fp32 router_gating_in_fp32
        moe_revert_type_after_topk sparse_mode pre_tockens next_tockens loss_compute_mode flash_decode
        te_rng_tracker inference_rng_tracker moe_pad_experts_for_cuda_graph_inference enable_experimental
        apply_rope_no_in_complex fp8_reuse_quantized_weight no_use_gmm_fp8 te_gmm_mode use_triton_swiglu_limit
        no_use_sparse_c8_indexer""",
    "a communication-overlap or scheduling setting of Megatron's own schedules; FSDP2 overlaps its own way":
        """moe_allgather_overlap_comm mla_up_proj_tp_overlap enable_overlap_ag_with_matmul
        enable_overlap_matmul_with_rs enable_backward_overlap_ag_with_matmul hccl_group_buffer moe_zerc
        coc_mode enable_token_rearrange_opt moe_dynamic_padding pipe_experts_multi_data
        pipe_experts_multi_stream optimize_recomp_communication_level optimize_recomp_communication_status
        optimize_send_recv_comm use_nd_matmul nd1_dim1_size nd2_dim1_size tp_comm_overlap
        no_tp_comm_bulk_wgrad no_tp_comm_bulk_dgrad no_tp_comm_overlap_ag no_tp_comm_overlap_rs
        tp_comm_overlap_rs_dgrad no_tp_comm_split_ag no_tp_comm_split_rs tp_comm_bootstrap_backend
        tp_comm_overlap_cfg overlap_moe_expert_parallel_comm delay_wgrad_compute
        overlap_dispatch_backward_with_experts_wgrad ep_overlap_early_attn_memory_release
        use_ring_exchange_p2p defer_embedding_wgrad_compute wgrad_deferral_limit
        no_overlap_p2p_communication overlap_grad_reduce overlap_param_gather
        overlap_param_gather_with_optimizer_step no_align_grad_reduce no_align_param_gather ddp_num_buckets
        ddp_bucket_size ddp_pad_buckets_for_high_nccl_busbw ddp_average_in_collective
        high_priority_stream_groups high_priority_a2a_comm_stream use_sharp sharp_enabled_group
        nccl_communicator_config_path use_nccl_ub disable_symmetric_registration gtp_remat_nccl_ub
        gtp_expert_remat_nccl_ub fsdp_manual_registration create_all_gather_group fsdp_double_buffer
        suggested_communication_unit_size no_gradient_reduce_div_fusion megatron_fsdp_version
        no_use_layer_wise_param_layout megatron_fsdp_enable_fine_grained_param_gather
        megatron_fsdp_max_pool_double_buffer fsdp_db_use_persist_buf_on_alloc_fail
        moe_permutation_async_comm moe_alltoall_overlap_comm moe_fb_overlap moe_hierarchical_alltoallv
        use_cp_send_recv_overlap moe_shared_expert_overlap moe_flex_dispatcher_backend moe_enable_deepep
        moe_flex_dispatcher_num_sms moe_deepep_num_sms moe_hybridep_num_sms moe_hybridep_num_blocks_permute
        moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing moe_ncclep_zero_copy
        moe_hybridep_pad_uneven_dispatch_inputs moe_use_grouped_tensor moe_single_grouped_weight
        moe_single_grouped_bias use_grouped_gemm_for_shared_expert use_grouped_gemm_for_dense_mlp
        enable_a2avc moe_tp_extend_ep async_log_allreduce use_nanopipe use_pipe_experts
        moe_experts_pipeline_degree enable_cuda_graph cuda_graph_warmup_steps external_cuda_graph
        cuda_graph_impl inference_cuda_graph_scope optimizer_cuda_graph mlp_chunks_for_prefill
        mlp_chunks_for_training ulysses_degree_in_cp tp_2d tp_x tp_y symmetric_ar_type""",
    "an inference-engine setting; pretraining does not use it":
        """nccl_all_reduce_for_prefill inference_fuse_tp_communication inference_disable_triton_nvls_kernels
        inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels cache_mla_latents""",
    "a memory-saving setting with no effect on the results; FSDP2 manages memory itself":
        """mla_zero_memory recompute_mla_up_proj mla_swap_core_attn_out recompute_mtp_norm recompute_mtp_layer
        moe_unperm2_mem_optim moe_unperm2_mem_optim_swap attention_mask_on_cpu swap_optimizer_times
        moe_adaptive_recompute_activation_scale adaptive_recompute_profiling_step enable_zero3
        cpu_offloading_retain_pinned_cpu_buffers
        fine_grained_activation_offloading offload_modules min_offloaded_tensor_size
        delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks activation_offload_fraction
        moe_paged_stash moe_paged_stash_page_size moe_paged_stash_buffer_size_factor_cuda
        moe_paged_stash_buffer_size_factor_cpu fine_grained_offloading_max_inflight_offloads
        empty_unused_memory_level manual_gc manual_gc_interval no_manual_gc_eval
        use_torch_optimizer_for_cpu_offload overlap_cpu_optimizer_d2h_h2d
        no_pin_cpu_grads no_pin_cpu_params swap_optimizer swap_attention swap_modules reuse_fp32_param
        moe_zero_memory moe_zero_memory_num_layers adaptive_recompute_device_swap
        adaptive_recompute_device_size memory_fragmentation enable_share_memory distribute_saved_activations
        swap_layer_input
        moe_layer_recompute gtp_remat_opt_in_modules recompute_in_advance moe_adaptive_recompute_activation
        moe_without_activation no_clone_scatter_output_in_embedding mhc_recompute_layer_num
        use_precision_aware_optimizer mamba_training_ssm_states_dtype reuse_grad_buf_for_mxfp8_param_ag
        keep_fp8_transpose_cache fp4_param_gather recompute_activation_function
        recompute_activation_function_num_layers recompute_norm recompute_norm_num_layers""",
    "a Megatron DDP / distributed-optimizer layout; FSDP2 shards parameters, gradients and optimizer state itself":
        """use_distributed_optimizer use_megatron_fsdp use_torch_fsdp2 data_parallel_sharding_strategy
        enable_full_sharding_in_hsdp
        ddp_reduce_scatter_with_fp32_accumulation gtp_remat_reduce_scatter_with_fp32_accumulation
        ddp_param_name_patterns_for_fp32_local_accumulation accumulate_allreduce_grads_in_fp32
        megatron_fsdp_main_params_dtype megatron_fsdp_main_grads_dtype megatron_fsdp_grad_comm_dtype
        main_grads_dtype main_params_dtype use_tp_pp_dp_mapping lazy_mpu_init local_rank
        tensor_parallel_num_weight_shards disable_gloo_process_groups disable_gloo_group fake_process_group
        distributed_timeout_minutes distributed_timeout_seconds_after_init mtp_standalone""",
    "a parallel layout with the same math: expert weights are sharded by EP × FSDP, tokens are dispatched by "
    "parallel.ep_dispatcher, context-parallel attention is exact whatever the exchange pattern":
        """adaptive_cp_without_coarse adaptive_cp_dynamic_attn_mask adaptive_cp_only_reschedule
        adaptive_cp_manually_set_mask_list padded_base_length expert_tensor_parallel_size
        expert_tensor_parallel_num_weight_shards moe_token_dispatcher_type
        inference_moe_token_dispatcher_type hierarchical_context_parallel_sizes hybrid_context_parallel
        max_seqlen_per_dp_cp_rank""",
    "how Megatron places its initial weights; here they are loaded from --load or initialised from --seed":
        """no_initialization use_cpu_initialization""",
    "pipeline-parallel layout; pipeline stages are folded into FSDP":
        """dualpipev_dw_detach use_nanopipe_swap automated_pipeline automated_pipeline_perf save_memory_ratio
        recompute_module_list recompute_type optimized_mbs_list mbs_idx pp_schedule_list optimized_mbs_mode
        recompute_in_bubble pipeline_model_parallel_comm_backend overlap_p2p_communication_warmup_flush
        microbatch_group_size_per_virtual_pipeline_stage account_for_embedding_in_pipeline_split
        account_for_loss_in_pipeline_split decoder_first_pipeline_num_layers
        decoder_last_pipeline_num_layers pipeline_model_parallel_layout model_parallel_size schedules_method
        enable_seq1f1b seq1f1b_balance_method seq1f1b_splits num_layer_list noop_layers
        enable_recompute_layers_per_pp_rank""",
    "a Megatron/MindSpeed checkpoint-format or conversion setting; this backend reads HF weights and saves DCP":
        """ckpt_format auto_detect_ckpt_format ckpt_convert_format ckpt_convert_save
        ckpt_convert_update_legacy_dist_opt_format ckpt_fully_parallel_save ckpt_fully_parallel_load
        ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_load_per_rank_objects
        ckpt_fully_parallel_save_process_group ckpt_fully_parallel_load_process_group
        ckpt_assume_constant_structure ckpt_pg_tensors_cache_path ckpt_pg_tensors_cache_create
        no_ckpt_load_validate_sharding_integrity no_strict_fsdp_dtensor_load dist_ckpt_strictness
        dist_ckpt_save_pre_mcore_014 dist_ckpt_optim_fully_reshardable
        distrib_optim_fully_reshardable_mem_efficient use_dist_ckpt dist_ckpt_format dist_ckpt_workers
        ckpt_drop_redundant_extra_state async_strategy use_persistent_ckpt_worker async_ckpt_cpu_priority
        async_ckpt_io_priority async_ckpt_use_cpu_shm no_save_tokenizer_assets
        use_mp_args_from_checkpoint_args no_use_tokenizer_model_from_checkpoint_args
        load_main_params_from_ckpt exit_on_missing_checkpoint save_retain_interval
        enable_hf2mg_convert only_convert_last_checkpoint ckpt_cfg_path saver
        enable_mg2hf_convert model_type_hf hf_cfg_dir load_checkpoint_loosely verify_integrity
        no_ckpt_fully_parallel_save replication replication_jump replication_factor""",
    "a logging or monitoring extra without a counterpart here (the Megatron log line is printed as usual)":
        """timing_log_level timing_log_option
        tensorboard_queue_size no_log_loss_scale_to_tensorboard log_memory_interval
        log_device_memory_used log_num_zeros_in_grad log_max_attention_logit no_barrier_with_level_1_timing
        log_world_size_to_tensorboard logging_level
        log_energy moe_per_layer_logging moe_routing_trace_path moe_routing_trace_max_training_iters
        moe_routing_trace_capture_logits moe_routing_trace_capture_hidden_states
        moe_routing_trace_dump_weights use_wandb config_logger_dir record_memory_history
        memory_snapshot_path nvtx_ranges use_pytorch_profiler pytorch_profiler_collect_chakra
        save_params_interval save_activations_interval save_tokens_per_expert_interval save_wgrads_interval
        save_dgrads_interval dump_param_to_param_group_map check_weight_hash_across_dp_replicas_interval
        gpu_sniff_test_interval train_sync_interval no_record_throughput flight_recorder_dump_path
        flight_recorder_trace_buffer_size no_flight_recorder_dump_on_timeout
        flight_recorder_include_stack_trace no_flight_recorder_include_only_active
        no_flight_recorder_extra_dump_on_exec""",
    "a fault-tolerance, self-test or signal-handling setting; it does not change what is trained":
        """exit_signal_handler_for_dataloader exit_signal_handler_for_training check_for_large_grads result_rejected_tracker_filename
        check_for_spiky_loss rerun_mode error_injection_rate error_injection_type test_mode
        enable_high_availability enable_hbmfault_repair enable_worker_reboot enable_elastic_training
        distributed_optimizer_no_replica te_comparison_with_bf16 te_comparison_with_cpu""",
    "a data-loading speed setting; the samples are the same":
        """num_dataset_builder_threads dataloader_fast_cache_load dataloader_defer_npy_index_mmap
        per_dataset_sequences_path allow_ambiguous_pad_tokens""",
    "a data-preprocessing or BERT/T5 setting that GPT pretraining does not read":
        """return_document_ids mask_prob short_seq_prob sample_rate encoder_num_layers encoder_seq_length
        vocab_extra_ids handler_name dataset_impl json_keys split_sentences keep_newlines
        tokenizer_padding_side merge_group_keys""",
    "the same function as a standard norm whose weight is 1 + gamma (weights are loaded or initialised to match)":
        """apply_layernorm_1p add_rmsnorm_offset""",
    "a precision detail of Megatron's kernels (norms and routers already run in fp32 here)":
        """rmsnorm_weight_in_fp32 init_norm_weight_in_fp32 input_layernorm_in_fp32 fp16_lm_cross_entropy
        moe_router_dtype output_logit_dtype""",
    "rotary-embedding models have no learned position table; the flag changes nothing for them":
        """no_position_embedding""",
    "loss scaling for fp16 (bf16/fp32 need none; fp16 uses a dynamic scaler here)":
        """loss_scale initial_loss_scale min_loss_scale loss_scale_window hysteresis""",
    "an optimizer setting read only by an optimizer this script does not select":
        """sgd_momentum lion_beta1 lion_beta2""",
    "the model definition comes from the HF directory given by --load; this Megatron/MindSpeed layer-spec detail "
    "has no separate meaning there":
        """mtp_spec model_type fc_type""",
}

# --- declined --------------------------------------------------------------------------------------------------

_DECLINED: Dict[str, str] = {
    "MindSpeed-LLM's FSDP2-mixin YAML (read with --use-torch-fsdp2 until MindSpeed 5ac89358, March 2026, which "
    "removed it) is not read here — give its settings as this backend's fields: offload_to_cpu: true is FSDP2's "
    "CPUOffloadPolicy = parallel.cpu_offload (--optimizer-cpu-offload; pin_memory follows the device), "
    "sub_modules_to_wrap = parallel.fsdp_modules, recompute_modules = parallel.recompute_modules, sharding_size = "
    "parallel.fsdp_size, reshard_after_forward / param_dtype / reduce_dtype / ignored_modules / "
    "num_to_forward_prefetch / num_to_backward_prefetch = the parallel fields of those names (given beside the "
    "flags as --parallel.cpu_offload true, ...)":
        """fsdp2_config_path""",
    "quantisation-aware training, quantised gradients or quantised optimizer states are not built here and would "
    "change the numerics — drop it (--o2-optimizer keeps bf16 moments)":
        """qat_scheme qat_quant_block_size quant_grads quant_states indexer_qk_quant_scheme""",
    "MindSpeed's layerwise disaggregated training (u-shaped split learning over virtual data parallel) is a "
    "different training scheme — drop it":
        """layerwise_disaggregated_training""",
    "this FP8/FP4 training option (Transformer Engine) is not available and would change the numerics — drop it "
    "(--fp8-format e4m3 --fp8-recipe mxfp8 is model.quant_recipe_name mxfp8), or drop the fp8/fp4 flags to train "
    "in bf16":
        """fp8_quantizer_factory no_fp8_wgrad fp8_output_proj fp4_format fp4_recipe fp4_quantizer_factory
        te_precision_config_file moe_router_padding_for_quantization moe_router_padding_for_fp8
        exp_avg_dtype exp_avg_sq_dtype moe_dispatch_fwd_dtype moe_combine_bwd_dtype""",
    "this multi-token prediction (MTP) variant is not implemented (--mtp-num-layers and "
    "--mtp-loss-scaling-factor are) — drop the flag":
        """mtp_use_repeated_layer mtp_detach_heads mtp_hsm mtp_hybrid_override_pattern""",
    "reinforcement learning, distillation, retrieval and vision training are not part of this backend — "
    "use Megatron-LM for them":
        """simpo_beta gamma_beta_ratio simpo_loss_type simpo_label_smoothing placeholder_token md5_validate
        max_prompt_length num_samples_per_step rollout_batch_size cliprange_value critic_mini_batch_size
        critic_update_epochs ppo_mini_batch_size clip_ratio entropy_coeff ppo_epochs shuffle_minibatch
        do_sample missing_eos_penalty n_samples_per_prompt reward_model verifier kl_coef gamma lam
        advantage_whiten dataset_category extract_content_for_reward num_gpus_for_train num_gpus_for_infer
        inference_tensor_model_parallel_size perform_rl_step logits_save_top_k logits_load_dir dpo_beta
        dpo_label_smoothing dpo_loss_type pref_ftx ref_model refer_model_iter is_pairwise_dataset
        reward_tokens""",
    "an argument of Megatron's inference/generation scripts, not of pretraining — pretrain_fsdp2.py trains; run "
    "generation with the inference entry point (inference.* settings)":
        """prompts prompts_file top_k top_p temperature return_log_probs num_tokens_to_generate output_path
        incoming_requests_per_sec incoming_requests_per_step inference_repeat_n inference_ckpt_non_strict
        use_coordinator model_provider use_flashinfer_fused_rope num_input_tokens num_output_tokens greedy
        max_new_tokens use_kv_cache max_length task task_data_path eval_language evaluation_batch_size
        max_eval_samples alternative_prompt origin_postprocess chain_of_thought broadcast hf_chat_template
        reasoning_effort max_queue_size""",
    "LoRA fine-tuning is not implemented — train full weights, or use a LoRA-capable trainer":
        """qlora qlora_save_dequantize lora_r lora_alpha lora_target_modules lora_load lora_ckpt_filter
        lora_modules_to_save lora_register_forward_hook save_lora_to_hf lu_lora_final_layer_index lu_lora_lr
        lu_lora_lr_ratio""",
    "instruction/SFT data (MindSpeed finetune datasets) is not supported yet — pretrain on indexed data, or wait "
    "for training.stage sft":
        """is_instruction_dataset prompt_type prompt_type_path variable_seq_lengths no_pad_to_seq_lengths
        padded_samples full_shuffle_instruction_dataset instruction_template hf_datasets_params
        dataset_additional_keys map_keys no_chat_template history_turns enable_thinking drop_thinking
        add_eos_token cut_max_seqlen no_cut_token pad_to_multiple_of neat_pack sft
        sft_tokenizer_prompt_format stage streaming datasets dataset_dir cache_dir overwrite_cache
        max_samples mix_strategy interleave_probs""",
    "a checkpoint-conversion tool argument, not a training argument — run MindSpeed's convert_ckpt.py, or load "
    "the HF directory directly with --load":
        """load_dir load_dir_cloud load_dir_edge save_dir save_dir_cloud save_dir_edge load_model_type save_model_type
        loader target_tensor_parallel_size target_pipeline_parallel_size target_expert_parallel_size mg_dir
        mg_save_dir hf_dir hf_save_dir model_index_file model_config_file model_configs save_layer_by_layer
        num_cloud_vpp_chunks merge_cloud_stages merge_stages middle_ranks middle_stages split_cloud_rank
        split_rank cvt_type ai_framework shard_size model_name model_name_or_path input output_prefix
        script_data_dir iteration no_checking n_subs scale_fmt""",
    "Sinkhorn routing is not implemented; another router changes the results — drop it (softmax top-k routing)":
        """moe_use_sinkhorn""",
    "DeepSpeed-style MoE (capacity, token dropping, random token selection) is not implemented — use Megatron "
    "core MoE flags (--num-experts, --moe-router-topk)":
        """moe_model_type expert_interval moe_train_capacity_factor no_use_rts moe_no_drop""",
    "random gradient/activation perturbation or skipped iterations change the results and are not "
    "implemented — drop it":
        """iterations_to_skip moe_input_jitter_eps input_jitter moe_router_force_load_balancing moe_router_force_biased
        moe_enable_routing_replay data_parallel_random_init init_method_xavier_uniform noisy_gate_policy""",
    "MiniCPM's µP-style scaling (MindSpeed's --dim-model-base / --scale-depth / --scale-emb) is not implemented "
    "— drop it, or use Megatron's --use-mup":
        """dim_model_base scale_depth scale_emb""",
    "a data-pipeline feature that is not implemented (phase transitions, dataset argument files, object "
    "storage) — prepare the data with tools/preprocess_data.py and pass --data-path":
        """phase_transition_iterations data_args_path per_split_data_args_path object_storage_cache_path
        dataloader_inter_document_masking validation_set_names multiple_validation_sets full_validation
        start_eval_at_iter""",
    "this Megatron tokenizer setting has no counterpart — convert the tokenizer to an HF tokenizer directory and "
    "pass --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR":
        """tokenizer_kwargs tokenizer_metadata tokenizer_sentencepiece_legacy no_tokenizer_sentencepiece_ignore_extra_whitespaces
        tokenizer_hf_no_include_special_tokens null_tokenizer_eod_id null_tokenizer_pad_id chat_template
        use_gigatoken no_pad_vocab_size pad_vocab_size_to""",
    "an encoder-decoder / BERT model setting — this backend trains decoder-only causal LMs; use Megatron-LM":
        """decoder_num_layers decoder_seq_length bert_no_binary_head output_bert_embeddings bert_embedder_type
        relative_attention_num_buckets relative_attention_max_distance""",
    "freezing or per-layer learning-rate changes are not implemented and would change results — drop it":
        """freeze_all_layers head_lr_mult no_weight_decay_cond_type moe_upcycling_granularity moe_use_upcycling""",
    "knowledge distillation (Megatron-LM's ModelOpt post-training: a teacher model's logits as the target) is "
    "not part of this backend — run it with Megatron-LM's post_training scripts, or drop the --export-kd-* flags":
        """export_kd_teacher_load export_kd_teacher_model_config export_kd_teacher_ckpt_format export_kd_cfg""",
    "ModelOpt quantisation (Megatron-LM's post-training QAT / quantised export) is not part of this backend — for "
    "FP8 training use --fp8-format with --fp8-recipe; quantise for deployment with ModelOpt":
        """export_quant_cfg export_real_quant_cfg export_kv_cache_quant modelopt_enabled""",
    "ModelOpt's HF-dataset finetuning data (Megatron-LM post-training) is not read — prepare the data with "
    "tools/preprocess_data.py and pass --data-path":
        """finetune_hf_dataset finetune_data_split""",
    "a Llama-4 option of Megatron-LM's ModelOpt export builder; no buildable HF model type has it — give --load "
    "with an HF directory of that model":
        """export_qk_l2_norm export_moe_apply_probs_on_input""",
    "speculative-decoding draft training (ModelOpt's EAGLE / Medusa offline model) is not part of this backend — "
    "use Megatron-LM's post_training scripts":
        """export_offline_model""",
    "ModelOpt's GPT-OSS preset (YaRN RoPE defaults) is not read — give the GPT-OSS architecture flags "
    "(--position-embedding-type yarn and its --yarn-* values) or --load with an HF gpt_oss directory":
        """enable_gpt_oss""",
    "Megatron's YAML config files are not read — pass the flags on the command line, or write the native YAML":
        """yaml_cfg""",
    "`--warmup` is Megatron's removed warmup argument — use --lr-warmup-fraction, --lr-warmup-iters or "
    "--lr-warmup-samples":
        """warmup""",
    "--skip-train replaces training by evaluation — run evaluation separately":
        """skip_train""",
    "loading pretrained weights from a second checkpoint, or pinning the checkpoint iteration, is not supported "
    "— pass the HF weights with --load":
        """pretrained_checkpoint ckpt_step override_ckpt_iteration""",
    "non-persistent (local) checkpoints are not supported — use --save-interval with --save":
        """non_persistent_save_interval non_persistent_ckpt_type non_persistent_global_ckpt_dir
        non_persistent_local_ckpt_dir non_persistent_local_ckpt_algo""",
    "hybrid/heterogeneous layer stacks (Mamba, per-layer configs) cannot be described by an HF config here — "
    "give --load with an HF directory of that model":
        """heterogeneous_layers_config_path heterogeneous_layers_config_encoded_json""",
}

# Megatron-LM groups that are out of scope as a whole (dests not listed above fall here).
GROUP_RULES: Dict[str, Rule] = {
    "rl": Rule(DECLINED, "reinforcement learning (GRPO) is not part of this backend — use Megatron-LM for it"),
    "vision": Rule(DECLINED, "vision models are not supported — this backend trains causal language models"),
    "biencoder": Rule(DECLINED, "retriever/biencoder training is not supported — use Megatron-LM for it"),
    "Logits Distillation": Rule(DECLINED, "logit distillation is not implemented — drop the logits-* flags"),
    "inference": Rule(NO_EFFECT, "an inference-engine setting; pretraining does not use it"),
    "one logger": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "straggler": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "ft_package": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "In-process restart": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "fault injector": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "opentelemetry": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "autoresume": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "workload inspector": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "msc": Rule(NO_EFFECT, "NVIDIA job tooling without a counterpart here"),
    "rerun engine": Rule(NO_EFFECT, "a fault-tolerance setting; it does not change what is trained"),
}


def _table(blocks: Dict[str, str], kind: str) -> Dict[str, Rule]:
    out: Dict[str, Rule] = {}
    for text, names in blocks.items():
        for name in _names(names):
            if name in out:
                raise ValueError(f"{name} listed twice in flag_rules")
            out[name] = Rule(kind, text)
    return out


NO_EFFECT_RULES = _table(_NO_EFFECT, NO_EFFECT)
DECLINED_RULES = _table(_DECLINED, DECLINED)
_overlap = set(NO_EFFECT_RULES) & set(DECLINED_RULES)
if _overlap:
    raise ValueError(f"flags both without effect and declined: {sorted(_overlap)}")


def flag_key(option: str) -> str:
    """'--no-rope-fusion' → 'no_rope_fusion', the key of the tables above."""
    return option.lstrip("-").replace("-", "_")


def static_rule(options: Sequence[str], group: Optional[str]) -> Optional[Rule]:
    """The no-effect or declined rule of a flag (by its option strings) that no handler maps; None: none listed."""
    for option in options:
        rule = NO_EFFECT_RULES.get(flag_key(option)) or DECLINED_RULES.get(flag_key(option))
        if rule:
            return rule
    return GROUP_RULES.get(group) if group else None
