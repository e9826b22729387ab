"""How many bytes a check reads: bounded work is asserted in bytes, not seconds (a wall-clock bound fails on
a loaded CI machine and passes a slow regression on a fast one)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


class ReadCount:
    """Bytes returned by os.read (rlconf.files' one reader of other people's files) inside `counting_reads`."""

    def __init__(self) -> None:
        self.bytes = 0


@contextlib.contextmanager
def counting_reads() -> Iterator[ReadCount]:
    """Counts every os.read of this process while the block runs: a check that reads a file it should have
    refused (a link to /dev/zero, a file past its limit) shows here on any machine, however fast."""
    count, real_read = ReadCount(), os.read

    def counted(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        count.bytes += len(data)
        return data

    os.read = counted
    try:
        yield count
    finally:
        os.read = real_read
