"""The composition root: the `splitspec` command (cli/main.py) wires every room's parsers."""
import os

# gRPC core's own log lines (a GOAWAY after a link cut: "I1129 ... chttp2_transport.cc ... Got goaway")
# are not this CLI's messages; errors still show. Set before anything imports grpc; a user's own
# GRPC_VERBOSITY wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
