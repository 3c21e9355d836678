"""Hugging Face transformers adapter (the `hf` extra). Built in the HF adapter issue."""
