"""Model id `step35`: Step-3.5 (HF model_type step3p5): transformers' text model + lm head, grouped experts
(`modeling.py`). Imports nothing: the spec is read without torch.
"""
