"""The emulated limits (each traced in README.md to its source) and the server's reply codes."""

MAX_ITEM_BYTES = 1 << 20  # S6: a queue item or dict value, counted as Modal serializes it
MAX_PARTITION_ITEMS = 5_000  # S7
MAX_PARTITION_BYTES = 64 << 20  # S7
PARTITION_TTL_S = 24 * 3600  # S8: a partition is cleared 24 h after its last put
DICT_ENTRY_TTL_S = 7 * 24 * 3600  # S12: a Dict entry expires after 7 days without a read or write
# S9: Modal's request-size limit is undocumented: its server (or proxy) answers HTTP 413 and the client
# has no check of its own. We take 4 MiB, the default largest message a gRPC server accepts
# (grpc-go's defaultServerMaxReceiveMessageSize, gRPC core's GRPC_DEFAULT_MAX_RECV_MESSAGE_LENGTH):
# the smallest figure a gRPC service plausibly enforces, so what passes here passes there.
MAX_REQUEST_BYTES = 4 << 20
MAX_GPUS = 8  # S17: "H100:8" is the largest GPU count a function can ask for
MAX_TIMEOUT_S = 24 * 3600  # S13: a function's timeout is 1 s .. 24 h

OK, FULL, EMPTY, NOT_FOUND, INVALID, TOO_LARGE, ERROR, TRANSIENT = range(8)  # TRANSIENT: S21's injected faults
# S21: modal's default Retry (modal/_utils/grpc_utils.py:499-509): 3 retries, 0.1 s doubling to at most 1 s
CLIENT_RETRIES, CLIENT_BASE_DELAY_S, CLIENT_MAX_DELAY_S = 3, 0.1, 1.0
