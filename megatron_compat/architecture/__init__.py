"""Megatron model-architecture flags → `model.architecture`, Hugging Face config keys.

Two cases. With `--load` naming an HF directory, that directory defines the model: only the flags the script
gives become keys (named as the HF config names them), and config validation checks them against its
config.json. Without `--load` (train from scratch), or with `--load` equal to `--save` (Megatron's resume
pattern), the flags are the whole model: Megatron's defaults fill what the script leaves out (ffn = 4h or the
SwiGLU rule, kv_channels = h / heads, the padded vocabulary) and the flags must describe a model type that
transformers can build (`model_type`, e.g. llama, qwen2, qwen3, gpt2, mixtral, qwen3_moe, deepseek_v3); a flag
selecting anything else is declined with what to do. Flags that only Megatron's own layer specs read fall to
"no effect" when an HF directory defines the model.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable, Dict, List, Optional

from megatron_compat.architecture import gdn as architecture_gdn
from megatron_compat.architecture import gemma2 as architecture_gemma2
from megatron_compat.architecture import gpt_oss as architecture_gpt_oss
from megatron_compat.architecture import hybrid as architecture_hybrid
from megatron_compat.architecture import mamba as architecture_mamba
from megatron_compat.architecture import minimax as architecture_minimax
from megatron_compat.architecture import mla as architecture_mla
from megatron_compat.architecture.router import ROUTER_FAMILIES, hf_router_keys, megatron_router, pai_aux_loss
from megatron_compat.architecture.dispositions import check_buildable as _check_buildable
from megatron_compat.architecture.dispositions import rotary as _rotary
from megatron_compat.architecture.dispositions import settle as _settle
from megatron_compat.architecture.dispositions import flag_vocab

_MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss", "minimax_m2")
_MIXTRAL_NAMES = ("mixtral", "gpt_oss", "minimax_m2")  # num_local_experts, intermediate_size = expert width


class Arch:
    """Collects the keys and the dispositions of the architecture flags for one translation."""

    def __init__(self, ns, active, from_scratch: bool, record: Callable[[str, str, str], None],
                 set_field: Optional[Callable[[str, str, Any], None]] = None):
        self.ns, self.active, self.from_scratch, self._record = ns, active, from_scratch, record
        self._set_field = set_field
        self.keys: Dict[str, Any] = {}
        self.declined: Dict[str, str] = {}
        self.recorded: set = set()

    def note(self, dest: str, kind: str, text: str) -> None:
        """Records a disposition for an active flag (the translation keeps the strongest); a decline also for a
        flag the line lacks (the model would need it: Megatron's default differs from what HF builds)."""
        if dest in self.active or kind == "declined":
            self.recorded.add(dest)
            self._record(dest, kind, text)

    def get(self, dest: str, default: Any = None) -> Any:
        return getattr(self.ns, dest, default)

    def put(self, dest: Optional[str], key: str, value: Any) -> None:
        """Sets a key; with an HF directory only when the flag was given (the directory defines the rest)."""
        if value is None:
            return
        if self.from_scratch or (dest is not None and dest in self.active):
            self.keys[key] = value
        if dest is not None:
            self.note(dest, "mapped", f"model.architecture.{key}")

    def field(self, dest: str, target: str, value: Any) -> None:
        """Sets a native config field (`group.name`) from flag `dest` (skipped when the value is None)."""
        if value is None or self._set_field is None:
            return
        self._set_field(dest, target, value)
        self.note(dest, "mapped", target)

    def decline(self, dest: str, why: str) -> None:
        self.declined.setdefault(dest, why)


def _family(a: Arch) -> str:
    g = a.get
    if architecture_gdn.selects_qwen3_next(a.ns, a.active):
        return "qwen3_next"
    if architecture_gpt_oss.selects_gpt_oss(a.ns, a.active):
        return "gpt_oss"
    if architecture_minimax.selects_minimax(a.ns, a.active):
        return "minimax_m2"
    if architecture_gemma2.selects_gemma2(a.ns, a.active):
        return architecture_gemma2.MODEL_TYPE
    if g("multi_latent_attention") or g("multi_head_latent_attention"):
        return "deepseek_v3"
    if g("num_experts"):
        if g("moe_shared_expert_intermediate_size") or g("n_shared_experts"):
            return "qwen2_moe"
        return "qwen3_moe" if g("qk_layernorm") else "mixtral"
    gated = g("swiglu") or g("geglu")
    if g("position_embedding_type") == "learned_absolute" and not g("use_rotary_position_embeddings") and not gated:
        return "gpt2"
    if g("qk_layernorm"):
        return "qwen3"
    if g("add_qkv_bias") and not g("add_bias_linear"):
        return "qwen2"
    return "llama"


def _ffn(a: Arch) -> Optional[int]:
    g = a.get
    if g("ffn_hidden_size") is not None or g("hidden_size") is None:
        return g("ffn_hidden_size")
    if g("swiglu") or g("geglu"):
        return int((4 * g("hidden_size") * 2 / 3) / 64) * 64  # Megatron's SwiGLU default, a multiple of 64
    return 4 * g("hidden_size")


def _act(a: Arch) -> str:
    g = a.get
    if g("squared_relu"):
        return "relu2"
    if g("openai_gelu"):
        return "gelu_new"
    if g("gelu_tanh"):
        return "gelu_pytorch_tanh"
    return "silu" if g("swiglu") else "gelu"


def _dense_keys(a: Arch, family: str) -> None:
    g = a.get
    heads, hidden = g("num_attention_heads"), g("hidden_size")
    kv_heads = g("num_query_groups") if g("group_query_attention") else heads  # Megatron ignores groups otherwise
    head_dim = g("kv_channels") or (hidden // heads if hidden and heads else None)
    names = {"gpt2": _GPT2_NAMES, architecture_gemma2.MODEL_TYPE: architecture_gemma2.NAMES}.get(family, {})
    put = lambda dest, key, value: a.put(dest, names.get(key, key), value)  # noqa: E731
    put("num_layers", "num_hidden_layers", g("num_layers"))
    put("hidden_size", "hidden_size", hidden)
    put("num_attention_heads", "num_attention_heads", heads)
    put("ffn_hidden_size", "intermediate_size", _ffn(a))
    if a.from_scratch or not _rotary(a):  # with RoPE from an HF directory, its own value only sizes caches
        put("max_position_embeddings", "max_position_embeddings", g("max_position_embeddings"))
    put("layernorm_epsilon", "rms_norm_eps", g("layernorm_epsilon"))
    if a.from_scratch:  # loaded weights need no initialisation
        put("init_method_std", "initializer_range", g("init_method_std"))
    put("attention_dropout", "attention_dropout", g("attention_dropout"))
    put("untie_embeddings_and_output_weights", "tie_word_embeddings",
        not g("untie_embeddings_and_output_weights"))
    vocab_dest = "padded_vocab_size" if g("padded_vocab_size") else "vocab_size"
    vocab = flag_vocab(a)
    if vocab is not None:
        put(vocab_dest, "vocab_size", vocab)
    for dest in ("swiglu", "squared_relu", "openai_gelu", "gelu_tanh", "geglu"):
        put(dest, "hidden_act", _act(a))
    if family == "gpt2":
        put("hidden_dropout", "hidden_dropout", g("hidden_dropout"))
        a.put(None, "embd_pdrop", g("hidden_dropout"))
        return
    put("group_query_attention", "num_key_value_heads", kv_heads)
    put("num_query_groups", "num_key_value_heads", kv_heads)
    if family == "deepseek_v3":  # MLA's head widths are the qk/v ones; transformers sets head_dim (the rope width)
        a.note("kv_channels", "no_effect", "multi-latent attention uses --qk-head-dim / --qk-pos-emb-head-dim / "
                                           "--v-head-dim, as in Megatron")
    else:
        put("kv_channels", "head_dim", head_dim)
    rope_theta = g("rope_theta") if g("rope_theta") is not None else g("rotary_base")
    put("rope_theta" if g("rope_theta") is not None else "rotary_base", "rope_theta", float(rope_theta))
    partial = g("partial_rotary_factor") or g("rotary_percent")
    put("partial_rotary_factor" if g("partial_rotary_factor") else "rotary_percent", "partial_rotary_factor", partial)
    if family in ("llama", "qwen3", "qwen3_moe", architecture_gemma2.MODEL_TYPE):
        put("add_bias_linear", "attention_bias", bool(g("add_bias_linear")))
    if family == "llama":
        put("add_bias_linear", "mlp_bias", bool(g("add_bias_linear")))
    if family == "qwen2" and g("add_bias_linear"):
        a.decline("add_bias_linear", "Qwen2-style models have biases on q/k/v only — add --disable-bias-linear")
    if family == "qwen2":
        put("add_qkv_bias", "attention_bias", True)


_GPT2_NAMES = {"num_hidden_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
               "intermediate_size": "n_inner", "max_position_embeddings": "n_positions",
               "rms_norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function",
               "attention_dropout": "attn_pdrop", "hidden_dropout": "resid_pdrop"}


def _moe_keys(a: Arch, family: str) -> None:
    g = a.get
    experts_key = "num_local_experts" if family in _MIXTRAL_NAMES else \
        {"deepseek_v3": "n_routed_experts"}.get(family, "num_experts")
    a.put("num_experts", experts_key, g("num_experts"))
    a.put("moe_router_topk", "num_experts_per_tok", g("moe_router_topk"))
    moe_ffn = g("moe_ffn_hidden_size") or g("moe_intermediate_size") or _ffn(a)
    ffn_dest = "moe_intermediate_size" if g("moe_intermediate_size") else "moe_ffn_hidden_size"
    if family in _MIXTRAL_NAMES:
        a.put(ffn_dest, "intermediate_size", moe_ffn)
    else:
        a.put(ffn_dest, "moe_intermediate_size", moe_ffn)
    if family in _OWN_ROUTER:
        megatron_router(a, family)
    else:
        hf_router_keys(a, family)
    norm = g("norm_topk_prob") or not g("moe_router_pre_softmax") or \
        g("moe_router_score_function") == "sigmoid"  # Megatron: top-k then softmax, or sigmoid = normalised
    for dest in ("norm_topk_prob", "moe_router_pre_softmax"):
        a.put(dest, "norm_topk_prob", norm if family not in _MIXTRAL_NAMES else None)
    if family in _MIXTRAL_NAMES and g("norm_topk_prob"):
        # These routers always renormalise the k selected scores (Mixtral: softmax, top-k, renormalise; GPT-OSS:
        # softmax over the top-k logits; MiniMax-M2: sigmoid, top-k, renormalise): what --norm-topk-prob asks,
        # also after Megatron's --moe-router-pre-softmax (a softmax over all experts renormalised over k is the
        # softmax over the k).
        a.note("norm_topk_prob", "mapped", f"model.architecture.model_type ({family}: its router renormalises "
                                           "the top-k scores)")
        a.note("moe_router_pre_softmax", "mapped", f"model.architecture.model_type ({family}: with "
                                                   "--norm-topk-prob, the softmax over the k selected experts)")
    elif family in ("mixtral", "deepseek_v3") and g("moe_router_pre_softmax"):  # their norm_topk_prob is no pre-softmax
        a.field("moe_router_pre_softmax", "model.moe_router_pre_softmax", True)  # switch: the router's own field
    shared = g("moe_shared_expert_intermediate_size")
    if family == "deepseek_v3":
        n_shared = g("n_shared_experts") or (shared // moe_ffn if shared and moe_ffn else None)
        a.put("n_shared_experts" if g("n_shared_experts") else "moe_shared_expert_intermediate_size",
              "n_shared_experts", n_shared)
    elif family == "qwen2_moe":
        a.put("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size", shared)
        if g("n_shared_experts") and moe_ffn:
            a.put("n_shared_experts", "shared_expert_intermediate_size", g("n_shared_experts") * moe_ffn)
    deepseek = family == "deepseek_v3"
    for dest, key in (("moe_router_num_groups", "n_group"), ("n_group", "n_group"),
                      ("moe_router_group_topk", "topk_group"), ("topk_group", "topk_group"),
                      ("moe_router_topk_scaling_factor", "routed_scaling_factor"),
                      ("routed_scaling_factor", "routed_scaling_factor")):
        if (deepseek and not pai_aux_loss(a)) or (family not in _OWN_ROUTER and not a.from_scratch):
            a.put(dest, key, g(dest))  # group-limited routing exists only in DeepSeek-V3-style HF models
    if deepseek:  # from scratch, Megatron's defaults (no groups, no scaling), not transformers' (8 groups, 2.5)
        for dest, key, default in (("moe_router_num_groups", "n_group", 1), ("moe_router_group_topk", "topk_group", 1),
                                   ("moe_router_topk_scaling_factor", "routed_scaling_factor", 1.0)):
            a.put(None, key, a.keys.get(key, default))
    _dense_layers(a, family)


# Families whose model here is this project's (models/moe/router.py): Megatron's router flags are native fields.
_OWN_ROUTER = tuple(ROUTER_FAMILIES) + ("gpt_oss", "minimax_m2")


def _dense_layers(a: Arch, family: str) -> None:
    """Which layers are dense: --first-k-dense-replace and --moe-layer-freq, in each family's own keys."""
    g = a.get
    k, freq = g("first_k_dense_replace"), g("moe_layer_freq")
    if isinstance(freq, list):  # Megatron's per-layer pattern, 1 = MoE
        dense = [i for i, moe in enumerate(freq) if not moe]
        if family == "deepseek_v3" and dense == list(range(len(dense))):
            a.put("moe_layer_freq", "first_k_dense_replace", len(dense))
        elif family in ("qwen3_moe", "qwen2_moe") or not a.from_scratch:
            a.put("moe_layer_freq", "mlp_only_layers", dense)
    elif freq is not None and freq > 1:
        if family in ("qwen3_moe", "qwen2_moe") or not a.from_scratch:
            a.put("moe_layer_freq", "decoder_sparse_step", freq)
        elif family == "deepseek_v3":
            a.put("moe_layer_freq", "moe_layer_freq", freq)
    elif "moe_layer_freq" in a.active:
        a.note("moe_layer_freq", "no_effect", "every layer is an MoE layer, as the HF model builds it")
    if k is None:
        if family == "deepseek_v3":  # from scratch Megatron's default, every layer MoE (transformers': 3 dense first)
            a.put(None, "first_k_dense_replace", a.keys.get("first_k_dense_replace", 0))
        return
    if k <= 0:
        a.note("first_k_dense_replace", "no_effect", "no dense layers first, as the HF model builds it")
    elif family == "deepseek_v3":
        a.put("first_k_dense_replace", "first_k_dense_replace", k)
    elif family in ("qwen3_moe", "qwen2_moe") or not a.from_scratch:
        a.put("first_k_dense_replace", "mlp_only_layers", list(range(k)))


def _routing(a: Arch, family: str) -> None:
    """Router scoring is the model type's own; Megatron's per-step expert-bias update is not implemented."""
    if not a.get("num_experts") or family in _OWN_ROUTER:  # those: megatron_router
        return
    for dest in ("moe_router_enable_expert_bias", "moe_router_bias_update_rate"):
        if a.get("moe_router_enable_expert_bias"):
            a.decline(dest, f"aux-loss-free balancing (the expert bias updated every step) needs this project's "
                            f"router, which {family} models lack — drop --moe-router-enable-expert-bias")
    score = a.get("moe_router_score_function")
    if not a.from_scratch:
        a.note("moe_router_score_function", "no_effect", "the HF model type in --load defines its router scores")
    elif (score == "sigmoid") == (family == "deepseek_v3"):
        a.note("moe_router_score_function", "mapped", f"model.architecture.model_type ({family})")
    else:
        a.decline("moe_router_score_function", f"HF {family} models score experts with "
                  f"{'sigmoid' if family == 'deepseek_v3' else 'softmax'} — change the flag, or give --load with "
                  "an HF directory")


def _mla_keys(a: Arch) -> None:
    g = a.get
    a.put("q_lora_rank", "q_lora_rank", g("q_lora_rank"))
    a.put("kv_lora_rank", "kv_lora_rank", g("kv_lora_rank"))
    a.put("qk_nope_head_dim" if g("qk_nope_head_dim") else "qk_head_dim", "qk_nope_head_dim",
          g("qk_nope_head_dim") or g("qk_head_dim"))
    a.put("qk_rope_head_dim" if g("qk_rope_head_dim") else "qk_pos_emb_head_dim", "qk_rope_head_dim",
          g("qk_rope_head_dim") or g("qk_pos_emb_head_dim"))
    a.put("v_head_dim", "v_head_dim", g("v_head_dim"))


REQUIRED_FROM_SCRATCH = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")


def missing_flags(ns, from_scratch: bool, active=()) -> List[str]:
    """The flags Megatron requires to build a model, when no HF directory defines it."""
    if not from_scratch:
        return []
    required = REQUIRED_FROM_SCRATCH
    if architecture_mamba.selects_mamba3(ns, active):
        required = architecture_mamba.REQUIRED
    elif architecture_hybrid.selects_hybrid(ns, active):  # the layer pattern gives the count
        required = architecture_hybrid.REQUIRED
    return ["--" + dest.replace("_", "-") for dest in required if getattr(ns, dest) is None]


def apply(ns, active, from_scratch: bool, record: Callable[[str, str, str], None],
          set_field: Optional[Callable[[str, str, Any], None]] = None) -> Dict[str, Any]:
    """Fills the architecture keys and records a disposition for every active architecture flag;
    `set_field(dest, "group.name", value)` receives the native fields some flags map to (the MoE router)."""
    a = Arch(ns, active, from_scratch, record, set_field)
    if from_scratch and architecture_mamba.selects_mamba3(ns, active):  # a pure Mamba stack → mamba3
        return architecture_mamba.apply(a)
    if from_scratch and architecture_hybrid.selects_hybrid(ns, active):  # Megatron's hybrid stack → NemotronH
        return architecture_hybrid.apply(a)
    family = _family(a)
    if not from_scratch and family == "gpt2" and loaded_model_type(ns) != "gpt2":
        # GPT-2-style flags (no --swiglu / RMSNorm / rope) over a loaded Llama/Qwen-style model: the loaded model
        # names the keys, and its heads and head width are checked like any others (were "without effect")
        family = "llama"
    gdn = family == "qwen3_next"
    if gdn:  # Qwen3-Next: Qwen3-MoE's attention, MoE and router flags, plus the GDN ones (architecture_gdn)
        family = architecture_gdn.BASE_FAMILY
    if from_scratch:
        a.keys["model_type"] = family
        _check_buildable(a, family)
    _dense_keys(a, family)
    if family in _MOE_FAMILIES and a.get("num_experts"):
        _moe_keys(a, family)
    if family == "deepseek_v3":
        _mla_keys(a)
        architecture_mla.apply_yarn(a)  # YaRN flags → rope_scaling (megatron-core's MLA rotary embedding)
        for dest in ("multi_latent_attention", "multi_head_latent_attention"):
            a.put(dest, "model_type", "deepseek_v3" if from_scratch else None)
    if family == "qwen2_moe" and from_scratch and not (a.get("moe_shared_expert_gate") or a.get("shared_expert_gate")):
        a.decline("moe_shared_expert_intermediate_size", "Qwen2-MoE-style shared experts are gated — add "
                  "--moe-shared-expert-gate, or give --load with an HF directory")
    for dest in ("moe_shared_expert_gate", "shared_expert_gate"):
        a.put(dest, "shared_expert_gate", True if a.get(dest) else None)
    if gdn:
        architecture_gdn.apply(a)
    if family == "gpt_oss":
        architecture_gpt_oss.apply(a)
    if family == "minimax_m2":
        architecture_minimax.apply(a)
    if family == architecture_gemma2.MODEL_TYPE:
        architecture_gemma2.apply(a)
    _routing(a, family)
    _settle(a, family)
    for dest, why in a.declined.items():
        a.note(dest, "declined", why)
    return a.keys


def loaded_model_type(ns) -> Optional[str]:
    """The `model_type` of the model `--load` names (an HF directory's config.json, or a save directory's newest
    checkpoint's hf_meta/config.json), or None."""
    load = getattr(ns, "load", None)
    if not load or load == "None" or not os.path.isdir(load):
        return None
    candidates = [os.path.join(load, "config.json"), os.path.join(load, "hf_meta", "config.json")]
    candidates += sorted(glob.glob(os.path.join(load, "iter_*", "hf_meta", "config.json")), reverse=True)
    for path in candidates:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            continue
    return None
