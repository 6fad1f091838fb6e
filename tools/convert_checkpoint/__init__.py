"""Checkpoint converters: ds_to_universal (reshape a run), to_hf / from_hf (transformers Bloom and GPT-2)."""
