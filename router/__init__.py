"""The router: the front end of pdserve, running in the ``pdserve serve`` process. It takes
requests over gRPC, tokenizes and validates them, places them on workers (a decode actor and, in
disaggregated mode, a prefill actor), detokenizes the tokens that come back, applies stop strings,
streams text to the client and ends with a summary; it also serves the metrics and the admin API.

Modules:
- ``server``: the ``grpc.aio`` server (Generation, Admin, health, reflection) and ``RouterConfig``.
- ``service``: one request's life: validate, place, stream deltas back as text, summarize.
- ``admin``: the ``pdserve.v1.Admin`` service (``pdserve scale``).
- ``preprocess``: tokenization (prompt, chat template, token ids), validation of every field, the caps.
- ``request_parser``: parsing a request off the wire, naming the field that holds invalid UTF-8.
- ``worker_pool``: the worker actors: membership, placement, the long polls, worker death, scaling.
- ``request_stream``: the router's end of one request: its state and its deltas, in order.
- ``request_state``: the request states and the one table of moves between them.
- ``admission``: the bounded queue where requests wait for a worker with room.
- ``disaggregated``: one request's reserve-on-decode, prefill-on-prefill flow.
- ``errors``: why the pool could not place or finish a request (mapped to gRPC statuses).
- ``placement``: the policies that pick a worker (and a prefill worker), on plain data.
- ``scaling``: starting worker actors, and changing how many run while the server serves.
- ``resources``: what each worker role asks Ray for, and whether the cluster can give it.
- ``detokenizer``: incremental detokenization (multi-byte characters split across tokens).
- ``stop``: stop strings over streamed text.
- ``metrics``: the Prometheus metrics and the ``/metrics`` endpoint.
"""
