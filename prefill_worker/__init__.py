"""The prefill worker: a Ray actor that turns prompts into KV cache, in batches and chunks under
a token budget, pushes that KV into a decode actor's reserved blocks over a KV transport while it
computes, and samples token #1 for the router.

Modules:
- ``worker``: ``PrefillEngine`` (the engine thread: admission, chunked prefill, the pushes) and
  ``PrefillWorker``, the Ray actor around it; ``start_prefill_workers``.
"""
