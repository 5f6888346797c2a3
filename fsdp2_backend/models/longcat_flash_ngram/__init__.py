"""Model id `longcat_flash_ngram`: LongCat-Flash with n-gram embeddings and grouped experts (`modeling.py`).
Imports nothing: the spec is read without torch.
"""
