"""Which Megatron / MindSpeed flags describe the model architecture, as data for `architecture`.

`ARCHITECTURE_DESTS` become HF config keys (or select the model type); `HF_DEFINED_DESTS` describe features
that no buildable model type here has (declined from scratch, the HF model's business with `--load`).
"""
from __future__ import annotations

# Flags `architecture.apply` reads; every active one gets exactly one disposition there.
ARCHITECTURE_DESTS = frozenset("""
num_layers hidden_size ffn_hidden_size num_attention_heads group_query_attention num_query_groups kv_channels
max_position_embeddings position_embedding_type use_rotary_position_embeddings rotary_base rope_theta rotary_percent
partial_rotary_factor normalization layernorm_epsilon swiglu squared_relu openai_gelu gelu_tanh geglu quick_geglu
add_bias_linear add_qkv_bias add_dense_bias qk_layernorm untie_embeddings_and_output_weights padded_vocab_size
vocab_size init_method_std embedding_init_method_std hidden_dropout attention_dropout num_experts moe_router_topk
moe_ffn_hidden_size moe_intermediate_size moe_aux_loss_coeff moe_z_loss_coeff moe_shared_expert_intermediate_size
n_shared_experts moe_shared_expert_gate shared_expert_gate moe_layer_freq first_k_dense_replace
moe_router_num_groups n_group moe_router_group_topk topk_group moe_router_topk_scaling_factor routed_scaling_factor
norm_topk_prob moe_router_pre_softmax moe_router_score_function moe_router_enable_expert_bias
moe_router_bias_update_rate moe_router_load_balancing_type seq_aux multi_latent_attention
multi_head_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_nope_head_dim qk_pos_emb_head_dim
qk_rope_head_dim v_head_dim
""".split())

# Flags that describe architecture features no buildable model type here has; from scratch they are declined,
# with an HF directory they are that model's business (no effect).
HF_DEFINED_DESTS = frozenset("""
rotary_interleaved rotary_seq_len_interpolation_factor use_rope_scaling rope_scaling_factor rope_type
yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow yarn_correction_range_round_to_int
rotary_scaling_factor mscale mscale_all_dim beta_fast beta_slow rope_scaling_type rope_scaling_mscale
rope_scaling_mscale_all_dim rope_scaling_original_max_position_embeddings rope_scaling_beta_fast
rope_scaling_beta_slow rope_factor low_freq_factor high_freq_factor original_max_position_embeddings long_factor
short_factor long_mscale short_mscale longrope_freqs_type dynamic_factor use_glm_rope mrope_section no_rope_freq
window_size window_attn_skip_freq sliding_window sliding_window_size interleave_sliding_window softmax_type
glu_linear_offset activation_func_clamp_value swiglu_limit enable_gpt_oss export_force_local_attention
attention_output_gate qk_l2_norm qk_clip qk_clip_alpha qk_clip_threshold fp32_residual_connection
apply_residual_connection_post_layernorm apply_query_key_layer_scaling experimental_attention_variant
linear_attention_freq linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads
linear_num_value_heads full_attention_interval mamba_d_conv mamba_d_ssm mamba_expand
mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads use_mamba_mem_eff_path gdp_num_householder
gdp_cutedsl_kernel gdp_num_chunk_states_to_recompute is_hybrid_model hybrid_layer_pattern hybrid_override_pattern
dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_skip_topk_offset
dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss dsa_kernel_backend dsa_indexer_rope_interleaved
dsa_indexer_rotate_activation dsa_indexer_scoring_relu dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32
enable_dsa_indexer index_head_dim index_n_heads index_topk index_topk_freq indexer_loss_coeff
index_share_for_mtp_iteration index_skip_topk_offset index_topk_pattern
enable_mhc_connections mhc_num_residual_streams mhc_sinkhorn_iterations mhc_init_gating_factor enable_mhc hc_eps
hc_mult hc_sinkhorn_iters n_hash_layers o_lora_rank o_groups kv_compress compress_ratios compress_rope_theta
original_seq_len moe_latent_size moe_shared_expert_glu_interleave_size moe_mlp_glu_interleave_size
moe_expert_capacity_factor moe_pad_expert_input_to_capacity moe_token_drop_policy moe_apply_probs_on_input
moe_router_quantile_balancing_ema moe_expert_rank_capacity_factor moe_comm_aux_loss_coeff
moe_device_level_aux_loss_coeff num_zero_experts use_global_aux_loss shared_expert_gate_output_dimension
post_norm no_post_layer_norm input_embeds_norm output_logit_softcapping attn_logit_softcapping
query_pre_attn_scalar embedding_multiplier_scale output_multiplier_scale add_output_layer_bias skip_bias_add
cla_share_factor share_kvstates square_alibi_mask fill_neg_inf alibi_fusion_attn_type attention_mask_type
cp_attention_mask_type cp_window_size use_moba_attn moba_calc_method moba_chunk_size moba_topk
no_enable_linear_qkv onnx_safe fix_sub_seq_length output_layer_slice_num alibi_diagonal_opposite embed_layernorm
""".split())

HF_REASONS = {"init_method_std": "the weights are loaded from --load, not initialised",
               "embedding_init_method_std": "the weights are loaded from --load, not initialised",
               "max_position_embeddings": "with RoPE it only sizes caches; the HF config's value applies"}

# Flags that select the model type (from scratch) rather than set a key.
FAMILY_DESTS = frozenset("""position_embedding_type use_rotary_position_embeddings normalization qk_layernorm
multi_latent_attention multi_head_latent_attention add_qkv_bias add_bias_linear swiglu geglu""".split())
MOE_ONLY = frozenset(d for d in ARCHITECTURE_DESTS if d.startswith("moe_")) | frozenset(
    """n_shared_experts first_k_dense_replace n_group topk_group routed_scaling_factor norm_topk_prob seq_aux
    shared_expert_gate""".split())
MLA_ONLY = frozenset("q_lora_rank kv_lora_rank qk_head_dim qk_nope_head_dim qk_pos_emb_head_dim qk_rope_head_dim "
                      "v_head_dim".split())
