"""vLLM plugin (the `vllm` extra). Built in the vLLM plugin issue."""
