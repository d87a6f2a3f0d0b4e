"""The decode worker: a Ray actor that runs continuous batching over one ``ModelRunner``. In
disaggregated mode it reserves KV blocks for a request, receives the prompt's KV from a prefill
actor and decodes from token #1; in colocated mode it also prefills, in chunks mixed into decode
steps. It sends each step's new tokens of every request to the router in one message.

Modules:
- ``worker``: ``EngineLoop`` (the engine thread: commands in, step outputs out, KV reservations
  and their leases) and ``DecodeWorker``, the Ray actor around it; ``start_workers``.
- ``scheduler``: ``Scheduler``, which decides each step which sequences run with how many tokens,
  and preempts when blocks run out (policy only: it never touches tensors).
- ``messages``: the plain data between the router and the worker actors (``WorkerRequest``,
  ``RequestDelta``, ``WorkerStats``, ``EngineCounters``).
- ``aborts``: ``EarlyAborts``, the ids aborted before their request arrived (both worker kinds).
"""
