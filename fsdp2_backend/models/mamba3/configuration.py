"""`Mamba3Config`: the Hugging Face config of this project's Mamba-3 causal LM.

It reads MindSpeed-LLM's mamba3 `config.json`, which is a transformers Mamba-2 config (`model_type: mamba2`,
`hidden_size`, `num_hidden_layers`, `state_size`, `head_dim`, `n_groups`, `expand`, `chunk_size`,
`time_step_*`, ...) with Mamba-3 keys added (`is_mimo`, `mimo_rank`, `rope_fraction`, `A_floor`,
`is_outproj_norm`), and the mamba_ssm spellings of the same sizes (`d_model`, `n_layer`, `d_state`,
`headdim`, `ngroups`, `dt_min`, `dt_max`, `dt_init_floor`, `rms_norm_eps`), which are folded into the
canonical names (two spellings that disagree are an error). Every size is read from here; none is hard-coded.

Mamba-2 keys that Mamba-3 has no use for are accepted so such a config.json loads, and named here: Mamba-3
has no short convolution (`conv_kernel`, `use_conv_bias`) and projects Δ straight from the input
(`time_step_rank`); `use_cache` concerns generation caches, which this training model does not keep.
`hidden_act` must be silu (the gate of y·silu(z) and of the gated norm).
"""
from __future__ import annotations

from transformers.configuration_utils import PreTrainedConfig

# mamba_ssm / MindSpeed spelling → the transformers Mamba-2 name this config keeps
ALIASES = {"d_model": "hidden_size", "n_layer": "num_hidden_layers", "d_state": "state_size",
           "headdim": "head_dim", "ngroups": "n_groups", "rms_norm_eps": "layer_norm_epsilon",
           "dt_min": "time_step_min", "dt_max": "time_step_max", "dt_init_floor": "time_step_floor"}


class Mamba3Config(PreTrainedConfig):
    model_type = "mamba3"

    vocab_size: int = 32768
    hidden_size: int = 2048
    num_hidden_layers: int = 24
    state_size: int = 128
    expand: int = 2
    head_dim: int = 64
    num_heads: int | None = None  # derived: expand · hidden_size / head_dim (checked when given)
    n_groups: int = 1
    is_mimo: bool = False
    mimo_rank: int = 4
    chunk_size: int = 64
    rope_fraction: float = 0.5
    A_floor: float = 1e-4
    is_outproj_norm: bool = False
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    time_step_limit: list[float] | tuple[float, ...] = (0.0, float("inf"))
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    residual_in_fp32: bool = True
    rescale_prenorm_residual: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Mamba-2 keys accepted for config.json compatibility, unused by Mamba-3 (see the module docstring)
    conv_kernel: int | None = None
    use_conv_bias: bool | None = None
    time_step_rank: str | int | None = None
    use_cache: bool = False

    def __post_init__(self, **kwargs):
        for alias, name in ALIASES.items():
            if alias in kwargs:
                value, current = kwargs.pop(alias), getattr(self, name)
                if current != getattr(type(self), name) and current != value:  # both spellings given
                    raise ValueError(f"Mamba3Config: {alias}={value!r} disagrees with {name}={current!r}")
                setattr(self, name, value)
        derived = int(self.expand * self.hidden_size) // self.head_dim
        if int(self.expand * self.hidden_size) % self.head_dim:
            raise ValueError(f"Mamba3Config: expand·hidden_size = {self.expand * self.hidden_size} is not a "
                             f"multiple of head_dim {self.head_dim}")
        if self.num_heads is not None and self.num_heads != derived:
            raise ValueError(f"Mamba3Config: num_heads {self.num_heads} ≠ expand·hidden_size/head_dim = {derived}")
        self.num_heads = derived
        if derived % self.n_groups:
            raise ValueError(f"Mamba3Config: n_groups {self.n_groups} does not divide the {derived} heads")
        if self.rope_fraction not in (0.5, 1.0) or int(self.state_size * self.rope_fraction) // 2 < 1:
            raise ValueError(f"Mamba3Config: rope_fraction {self.rope_fraction} must be 0.5 or 1.0 and leave at "
                             f"least one rotated pair of the state_size {self.state_size}")
        if self.hidden_act != "silu":
            raise ValueError(f"Mamba3Config: hidden_act {self.hidden_act!r} — Mamba-3 gates with silu only")
        if self.chunk_size < 1 or (self.is_mimo and self.mimo_rank < 1):
            raise ValueError("Mamba3Config: chunk_size and mimo_rank must be positive")
        super().__post_init__(**kwargs)

    @property
    def d_inner(self) -> int:
        return int(self.expand * self.hidden_size)

    @property
    def rank(self) -> int:
        """The MIMO rank R (1 for SISO)."""
        return self.mimo_rank if self.is_mimo else 1

    @property
    def num_rope_angles(self) -> int:
        """How many (interleaved) pairs of the state rotate: state_size · rope_fraction / 2, rounded down."""
        return int(self.state_size * self.rope_fraction) // 2

    @property
    def layer_types(self):
        return ["linear_attention"] * self.num_hidden_layers

    @classmethod
    def from_any(cls, hf_config) -> "Mamba3Config":
        """A Mamba3Config from any HF config object carrying the fields (e.g. transformers' Mamba2Config that
        MindSpeed's config.json loads as); keys this config does not know stay as plain attributes."""
        if isinstance(hf_config, cls):
            return hf_config
        data = {k: v for k, v in hf_config.to_dict().items() if k not in ("model_type", "transformers_version")}
        return cls(**data)
