"""The engine both workers share: model loading, the forward pass of each supported architecture
over a flat batch of tokens from many sequences, the paged KV cache and its block allocator,
attention, and sampling. It decides nothing about which requests run (the workers do).

Modules:
- ``config``: ``EngineConfig``, every engine knob (model, device, dtype, threads, KV pool size).
- ``model_loader``: finds a model (the embedded default GGUF or a Hugging Face directory), converts
  it once, and loads its config, weights and tokenizer.
- ``models``: one file per architecture (Llama family, GPT-2); ``build_model`` picks one.
- ``model_runner``: ``ModelRunner``, a loaded model plus its KV pool, running one forward per step.
- ``sequence``: ``Sequence``, one request's tokens, block table, progress and finish.
- ``block_allocator``: the paged KV block allocator (free list, reference counts) and block tables.
- ``kv_cache``: the preallocated KV pool, addressed by block id.
- ``attention``: attention over the paged KV cache for a flat batch (decode and prefill runs).
- ``paged_decode``: the decode attention kernel that reads the pool in place (Numba, CPU).
- ``prefill_attention``: the causal prefill attention kernel (C, AVX-512, CPU).
- ``linear``: projection weights (packed for the GEMM library) and the one matmul over them.
- ``quantized``: GGUF-quantized weights multiplied in that form when a step has few rows.
- ``native``: compiles and loads the C kernels in ``csrc/`` on first use.
- ``sampler``: logits to tokens (greedy, temperature, top-k, top-p, seeds, logprobs).
- ``sampling_params``: ``SamplingParams``, one request's sampling parameters, validated.
- ``memory``: the process's peak memory, as a worker reports it.
- ``offline``: ``generate``, the engine on its own over a fixed set of prompts.
"""
