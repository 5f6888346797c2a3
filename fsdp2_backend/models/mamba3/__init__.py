"""Model id `mamba3`: this project's Mamba-3 causal LM — `configuration.py` (`Mamba3Config`), `modeling.py`
(`Mamba3ForCausalLM`, `build_mamba3`, `register_with_transformers`: importing it registers model_type "mamba3" with
transformers' Auto classes). Imports nothing: the spec is read without torch.
"""
