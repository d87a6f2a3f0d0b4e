"""The benchmark commands, ``pdserve bench NAME``: each measures a part of the system against a
baseline in one run on one machine. They sit beside the system and import its parts; no part of
the system imports them.

Modules:
- ``engine``: ``pdserve bench engine``, the engine against Hugging Face ``generate()``: decode and
  prefill tokens/s, and the memory-bandwidth bound of a decode step.
- ``offline``: ``pdserve bench offline``, continuous batching in one decode actor against Hugging
  Face static batches, with the compute bound.
- ``transfer``: ``pdserve bench transfer``, KV transfer between actors against raw TCP and each
  transport's library alone, and the TTFT cost of disaggregation.
- ``faults``: ``pdserve bench faults``, a server under constant load with and without a worker
  killed: requests lost, goodput after the kill, time until throughput is back.
- ``judge``: ``pdserve bench judge``, a running server driven by AIPerf (an outside load tool,
  over the OpenAI-compatible API) and by ``pdserve loadtest run`` at the same rates: both tools'
  TTFT and ITL side by side.
- ``common``: what they share: the machine's description, timing, a local Ray, table printing.
"""
