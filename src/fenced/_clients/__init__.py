"""The clients layer (docs/design.md): what each client library's errors mean, decided once
for the sources, the guards and the members, the etcd transport they share, and the one
manager of the connections fenced opens for itself.

Nothing is imported here: each module is imported by its own name (``_grpc`` first where
gRPC is used: it sets gRPC's environment before gRPC is imported).
"""
