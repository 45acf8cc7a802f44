"""One exception type for problems a user can fix (bad input, bad settings, unreachable storage).

The CLI prints its message as one line and exits non-zero, with no traceback; anything else
is a bug and keeps its traceback.
"""


class CellfeedError(Exception):
    """A problem with input or settings; the message says what is wrong and what to do."""
