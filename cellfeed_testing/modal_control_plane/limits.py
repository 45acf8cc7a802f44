"""The server's limits, each traced in README.md (the row named beside it) to its source."""

MAX_ITEM_BYTES = 1 << 20  # C4: a queue item (or a dict value, C11), counted as Modal serializes it
MAX_PARTITION_ITEMS = 5_000  # C4
MAX_PARTITION_BYTES = 64 << 20  # C4
PARTITION_TTL_S = 24 * 3600  # C7: a partition is cleared 24 h after its last put
DICT_ENTRY_TTL_S = 7 * 24 * 3600  # C10: a Dict entry expires after 7 days without a read or write
# C4: Modal's request-size limit is undocumented: its server (or proxy) answers HTTP 413 and the client
# has no check of its own. We take 4 MiB, the default largest message a gRPC server accepts
# (grpc-go's defaultServerMaxReceiveMessageSize, gRPC core's GRPC_DEFAULT_MAX_RECV_MESSAGE_LENGTH):
# the smallest figure a gRPC service plausibly enforces, so what passes here passes there.
MAX_REQUEST_BYTES = 4 << 20
MAX_GPUS = 8  # D10: "H100:8" is the largest GPU count a container can ask for
