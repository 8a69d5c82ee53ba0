"""ibp_embed: a lossless Invariant Bit Packing store for embedding tables."""
from .codec import compress
from .errors import FormatError, NativeLibraryError
from .table import CompressedTable, load

__all__ = ["compress", "load", "CompressedTable", "FormatError", "NativeLibraryError"]
__version__ = "0.1.0"
