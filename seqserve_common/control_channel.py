"""Settings of the gRPC control channel between the scheduler and its workers."""

from __future__ import annotations

# Largest Step message either side accepts. A Step carries token ids, never tensors, but a
# batch of re-admitted sequences (prompt plus generated tokens each) can pass gRPC's 4 MiB
# default.
MAX_MESSAGE_BYTES = 64 << 20

GRPC_MESSAGE_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES))
