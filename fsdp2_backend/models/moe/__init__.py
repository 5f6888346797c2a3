"""Mixture-of-experts building blocks shared by MoE models: routing helpers and stacked-weight experts."""
