"""pdserve: a disaggregated prefill/decode LLM serving system on Ray.

This package holds the user's door and the API; the parts of the system are its subpackages
``pdserve.router``, ``pdserve.prefill_worker``, ``pdserve.decode_worker``,
``pdserve.kv_transfer``, ``pdserve.engine``, ``pdserve.loadtest`` and ``pdserve.bench``.

Modules:
- ``cli``: the ``pdserve`` command: its parser, ``generate``, ``scale`` and the shared argument types.
- ``serve``: ``pdserve serve``: starts the worker actors on Ray and serves the router until Ctrl-C.
- ``client``: the Python client of a running server (``Client``, ``AsyncClient``).
- ``codegen``: regenerates the gRPC code below from ``proto/`` (``python -m pdserve.codegen``).
- ``v1``: generated gRPC code of the public API (``pdserve.v1``: Generation, Admin).
- ``internal``: generated gRPC code of the internal KV-transfer service.
"""
