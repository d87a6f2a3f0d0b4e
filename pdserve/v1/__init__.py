"""Generated gRPC code for the public API (pdserve.v1); regenerate with `python -m pdserve.codegen`."""
