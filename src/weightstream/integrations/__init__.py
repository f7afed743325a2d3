"""Adapters for the frameworks that load models (vLLM); each imports its framework lazily."""
