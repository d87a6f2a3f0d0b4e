"""Generated gRPC code of internal services (KV transfer); regenerate with `python -m pdserve.codegen`."""
