"""ibp_embed: a lossless Invariant Bit Packing store for embedding tables."""
from .codec import compress
from .errors import FormatError, NativeLibraryError
from .batched import lookup_many
from .table import CompressedTable, load


def release_thread_buffers() -> int:
    """Free the buffers lookups keep with their threads between calls (a cache of
    decoded rows, the deduplication scratch, decode plans: up to tens of MB a thread,
    kept so that the next call allocates and page-faults nothing); returns the bytes
    freed. For servers between bursts of traffic; the next lookups allocate them again.
    It frees the buffers of the calling thread and of its native worker team: a
    program that looks up from several threads calls it from each."""
    from . import _native

    return int(_native.lib.ibp_release_thread_buffers())


__all__ = ["compress", "load", "lookup_many", "CompressedTable", "FormatError", "NativeLibraryError",
           "release_thread_buffers"]
__version__ = "0.1.0"
