"""Exceptions raised by ibp_embed."""


class FormatError(ValueError):
    """A compressed table or .ibp file is truncated, corrupt, foreign or of another version."""


class NativeLibraryError(ImportError):
    """libibp is missing, unloadable or of another version: run `make`."""
