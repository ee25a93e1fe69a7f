"""Parties in separate processes (one per party, on one host or many) over the gRPC transport with mutual TLS."""
