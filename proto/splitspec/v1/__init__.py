"""Generated stubs of the splitspec.v1 wire contract (see verify.proto)."""
