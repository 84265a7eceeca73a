"""Language-model layers over the paged KV cache: the decoder (Llama, Mistral, Qwen2/3), Gemma 3's,
and the CPU linears with packed weights."""
