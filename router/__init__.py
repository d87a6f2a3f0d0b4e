"""The router: the gRPC front end of pdserve, running in the `pdserve serve` process.

- ``server``: the ``grpc.aio`` server (Generation service, health, reflection) and its config;
- ``service``: one request's life: validate, place, stream deltas back as text, summarize;
- ``preprocess``: tokenization (prompt, chat template, token ids) and validation of every field;
- ``worker_pool``: the worker actors: long polls, per-request streams, admission, worker death,
  and in disaggregated mode the reserve-on-decode / prefill-on-prefill flow;
- ``placement``: the policies that pick a worker (and a prefill worker), on plain data;
- ``detokenizer``: incremental detokenization (multi-byte characters split across tokens);
- ``stop``: stop strings over streamed text.
"""
