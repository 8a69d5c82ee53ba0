"""The `ibp-embed` command: compress, inspect and verify .ibp files.

    ibp-embed compress IN OUT [--key K] [--word-bits {16,32,64}] [--clusters N] [--threshold T] [--no-raw]
    ibp-embed inspect FILE [--json]
    ibp-embed verify FILE [--against IN [--key K]]

IN is a .pt / .pth file (a tensor, or a state_dict or other nest of dicts and lists
of tensors, read with ``torch.load(weights_only=True)``: nothing but tensors and
plain containers is ever unpickled), a .npy file (``allow_pickle=False``) or
a .safetensors file. ``--key`` names the tensor inside a container (nested keys
joined with "."); without it a container holding exactly one 2-D tensor is fine.

Exit status: 0 on success, 1 when the data is wrong or unreadable (missing or corrupt
file, unsupported dtype or shape, a verification mismatch), 2 when the command line
is (unknown option or extension, a --key that is missing or names nothing).
Expected errors print one line, ``ibp-embed: error: ...``, on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import _native
from .codec import compress, index_nbytes
from .dtypes import NUMPY_TO_TORCH, check_dense, check_dtype, dtype_name
from .errors import FormatError
from .io import read_header
from .table import load

PROG = "ibp-embed"
TORCH_EXTS = (".pt", ".pth")
INPUT_EXTS = TORCH_EXTS + (".npy", ".safetensors")
VERIFY_CHUNK_BYTES = 32 << 20  # raw bytes decoded per step of `verify`
PROGRESS_MIN_ROWS = 1 << 20  # compress shows progress bars from this many rows on


class CLIError(Exception):
    """An expected failure: one line on stderr and exit status `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------- input loading

def load_tensor(path, key: str | None = None) -> tuple[torch.Tensor, str | None]:
    """(the 2-D tensor that `path` holds, or holds under `key`; the key used)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in INPUT_EXTS:
        raise CLIError(f"{path}: unknown input type {ext or '(no extension)'!r}; "
                       f"expected one of {', '.join(INPUT_EXTS)}", 2)
    if not path.is_file():
        raise CLIError(f"{path}: no such file" if not path.exists() else f"{path}: not a regular file")
    if ext in TORCH_EXTS:
        tensors = _flatten(_torch_load(path))
    elif ext == ".npy":
        if key is not None:
            raise CLIError(f"{path}: --key does not apply to a .npy file (it holds one array)", 2)
        return _array_to_tensor(_np_load(path), path, None), None
    else:
        tensors = _safetensors_tensors(path, key)
    key, value = _pick(tensors, key, path)
    tensor = value() if callable(value) else value
    _check_2d(tensor, path, key)
    return tensor, key


def _torch_load(path: Path):
    def attempt(mmap: bool):
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)

    try:
        try:
            return attempt(True)  # zip-format files: tensors stay on disk until read
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return attempt(False)  # a legacy (pre-zip) torch.save file
    except pickle.UnpicklingError as e:
        detail = next((line.strip() for line in str(e).splitlines()
                       if "unsupported" in line.lower() or "global" in line.lower()), "")
        detail = detail if len(detail) < 300 else detail[:300] + "..."
        if "weights only" in str(e).lower() and "global" in str(e).lower():
            raise CLIError(f"{path}: refused: the file holds objects other than tensors and plain "
                           f"containers, which are never unpickled (torch.load weights_only=True)"
                           + (f": {detail}" if detail else "")) from None
        raise CLIError(f"{path}: not a readable PyTorch file: {detail or _one_line(e)}") from None
    except Exception as e:  # the restricted unpickler fails in many ways on foreign bytes
        raise CLIError(f"{path}: not a readable PyTorch file: {type(e).__name__}: "
                       f"{_one_line(e)}") from None


def _flatten(obj, prefix: str = "", out: dict | None = None) -> dict:
    """{dotted key: tensor} of every tensor in a nest of dicts, lists and tuples."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    return out


def _pick(tensors: dict, key: str | None, path: Path):
    """(key, tensor or zero-argument loader) chosen by --key, or the single 2-D tensor."""
    if "" in tensors:  # the file holds a bare tensor
        if key is not None:
            raise CLIError(f"{path}: holds a single tensor, not a dict: drop --key {key!r}", 2)
        return None, tensors[""]
    if key is not None:
        if key not in tensors:
            raise CLIError(f"{path}: no tensor under key {key!r}; "
                           f"2-D tensors: {_key_list(_keys_2d(tensors))}", 2)
        return key, tensors[key]
    keys = _keys_2d(tensors)
    if len(keys) == 1:
        return keys[0], tensors[keys[0]]
    if not keys:
        raise CLIError(f"{path}: holds no 2-D tensor" + (f" (keys: {_key_list(list(tensors))})"
                                                         if tensors else ""))
    raise CLIError(f"{path}: holds {len(keys)} 2-D tensors, pick one with --key: {_key_list(keys)}", 2)


def _keys_2d(tensors: dict) -> list[str]:
    return [k for k, v in tensors.items() if _ndim(v) == 2]


def _ndim(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.dim()
    return getattr(v, "ndim", -1)  # lazy loaders carry the shape's length


def _key_list(keys: list[str], limit: int = 20) -> str:
    if not keys:
        return "(none)"
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def _check_2d(tensor: torch.Tensor, path: Path, key: str | None) -> None:
    where = f"{path}[{key!r}]" if key is not None else str(path)
    if tensor.dim() != 2:
        raise CLIError(f"{where}: shape {tuple(tensor.shape)}; an embedding table is 2-D [rows, dim]")
    try:
        check_dense(tensor, where)
    except TypeError as e:
        raise CLIError(str(e)) from None
    try:
        check_dtype(tensor.dtype)
    except TypeError as e:
        raise CLIError(f"{where}: {e}") from None
    if tensor.shape[1] == 0:
        raise CLIError(f"{where}: shape {tuple(tensor.shape)} has no columns")


def _np_load(path: Path) -> np.ndarray:
    try:
        # Copy-on-write map: nothing is read before it is needed, and the array is
        # writable so torch.from_numpy takes it without copying.
        return np.load(path, mmap_mode="c", allow_pickle=False)
    except ValueError as e:
        if any(s in str(e) for s in ("allow_pickle", "Object arrays", "Python objects")):
            raise CLIError(f"{path}: refused: an object array would need unpickling") from None
        raise CLIError(f"{path}: not a readable .npy file: {_one_line(e)}") from None
    except (OSError, EOFError) as e:
        raise CLIError(f"{path}: not a readable .npy file: {_one_line(e)}") from None


def _array_to_tensor(a: np.ndarray, path: Path, key: str | None) -> torch.Tensor:
    where = f"{path}[{key!r}]" if key is not None else str(path)
    if a.dtype.hasobject:
        raise CLIError(f"{where}: refused: an object array would need unpickling")
    if a.dtype.byteorder not in ("=", "|") and a.dtype.newbyteorder("=") in NUMPY_TO_TORCH:
        a = a.astype(a.dtype.newbyteorder("="))  # big-endian file: same values, host order
    if a.dtype not in NUMPY_TO_TORCH:
        raise CLIError(f"{where}: NumPy dtype {a.dtype} is not supported")
    if a.ndim != 2:
        raise CLIError(f"{where}: shape {a.shape}; an embedding table is 2-D [rows, dim]")
    if not a.flags.writeable:
        a = np.array(a)
    return torch.from_numpy(a)


class _Lazy:
    """A tensor read on demand (call it), with the number of dimensions known beforehand."""

    def __init__(self, load, ndim):
        self._load, self.ndim = load, ndim

    def __call__(self):
        return self._load()


def _safetensors_tensors(path: Path, key: str | None) -> dict:
    try:
        from safetensors import safe_open
    except ImportError:
        raise CLIError("reading .safetensors files needs the `safetensors` package "
                       "(pip install safetensors)") from None
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
        out = {}
        for name in f.keys():
            ndim = len(f.get_slice(name).get_shape())
            out[name] = _Lazy(lambda name=name: _safetensors_get(f, name, path), ndim=ndim)
        return out
    except CLIError:
        raise
    except Exception as e:  # safetensors raises its own SafetensorError for bad files
        raise CLIError(f"{path}: not a readable .safetensors file: {_one_line(e)}") from None


def _safetensors_get(f, name: str, path: Path) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise CLIError(f"{path}[{name!r}]: unreadable: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


# ---------------------------------------------------------------- formatting

def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _where(path, key) -> str:
    return f"{path}[{key!r}]" if key is not None else str(path)


# ---------------------------------------------------------------- commands

def cmd_compress(args) -> int:
    t0 = time.perf_counter()
    tensor, key = load_tensor(args.input, args.key)
    t_load = time.perf_counter() - t0
    out = Path(args.output)
    if out.suffix.lower() != ".ibp":
        print(f"{PROG}: warning: {out} does not end in .ibp", file=sys.stderr)
    n_rows = tensor.shape[0]
    progress = False if args.quiet else n_rows >= PROGRESS_MIN_ROWS
    if progress:
        print(f"building masks from {_where(args.input, key)} ...", file=sys.stderr)
    t1 = time.perf_counter()
    try:
        table = compress(tensor, word_bits=args.word_bits, clusters=args.clusters,
                         threshold=args.threshold, progress=progress, allow_raw=not args.no_raw)
    except (TypeError, ValueError) as e:
        raise CLIError(f"{_where(args.input, key)}: {e}") from None
    t_compress = time.perf_counter() - t1
    t2 = time.perf_counter()
    try:
        table.save(out)
    except OSError as e:
        raise CLIError(f"{out}: cannot write: {e.strerror or e}") from None
    t_save = time.perf_counter() - t2
    file_bytes = out.stat().st_size
    raw_mb = table.raw_nbytes / 1e6
    print(f"{_where(args.input, key)} -> {out}")
    print(f"  shape        {table.shape[0]} x {table.shape[1]}")
    print(f"  dtype        {dtype_name(table.dtype)}")
    print(f"  word size    {table.word_bits} bits")
    print(f"  clusters     {table.clusters}" + (" (stored raw: encoding would not shrink it)"
                                                  if table.is_raw else ""))
    print(f"  raw          {table.raw_nbytes} bytes ({_human(table.raw_nbytes)})")
    print(f"  compressed   {table.nbytes} bytes ({_human(table.nbytes)}); file {file_bytes} bytes")
    print(f"  ratio        {table.ratio:.4f}")
    speed = f" ({raw_mb / t_compress:.1f} MB/s)" if t_compress > 0 and raw_mb else ""
    print(f"  time         load {t_load:.3f} s, compress {t_compress:.3f} s{speed}, "
          f"save {t_save:.3f} s")
    return 0


def inspect_stats(path) -> dict:
    """Everything `inspect` prints, as a JSON-ready dict."""
    header = read_header(path)
    table = load(path, mmap=True, verify=False)
    ids = table.cluster_ids()
    lengths = table.row_lengths().astype(np.int64)
    n_rows = table.shape[0]
    row_bytes = table.shape[1] * table.dtype.itemsize
    w = table.word_bits
    inv_bits = np.bitwise_count(table.masks).astype(np.int64)
    clusters = []
    counts = np.bincount(ids + 1, minlength=table.clusters + 1) if n_rows else \
        np.zeros(table.clusters + 1, np.int64)
    sums = np.bincount(ids + 1, weights=lengths, minlength=table.clusters + 1) if n_rows else \
        np.zeros(table.clusters + 1)
    for k in range(table.clusters):
        rows = int(counts[k + 1])
        clusters.append({
            "cluster": k, "rows": rows,
            "share": rows / n_rows if n_rows else 0.0,
            "stored_bytes": int(sums[k + 1]),
            "mean_stored_bytes": float(sums[k + 1] / rows) if rows else None,
            "invariant_bits_per_word": float(inv_bits[k].mean()),
        })
    raw_rows = int(counts[0])
    mask_bytes = 2 * table.clusters * table.masks.shape[1] * (w // 8)
    return {
        "path": str(path), "file_bytes": int(header["file_size"]),
        "format_version": int(header["format_version"]),
        "shape": list(table.shape), "dtype": dtype_name(table.dtype), "word_bits": w,
        "clusters": table.clusters, "row_bytes": row_bytes,
        "nbytes": table.nbytes, "raw_nbytes": table.raw_nbytes, "ratio": table.ratio,
        "payload_bytes": int(header["payload_bytes"]),
        "index_bytes": 0 if table.is_raw else index_nbytes(n_rows, row_bytes),
        "mask_bytes": mask_bytes,
        "raw_rows": raw_rows, "raw_share": raw_rows / n_rows if n_rows else 0.0,
        "mean_stored_bytes": float(lengths.mean()) if n_rows else None,
        "cluster_stats": clusters,
    }


def cmd_inspect(args) -> int:
    s = inspect_stats(args.file)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    n = s["shape"][0]
    print(f"{s['path']}: ibp_embed table, format version {s['format_version']}, "
          f"{s['file_bytes']} bytes on disk")
    print(f"  shape        {s['shape'][0]} x {s['shape'][1]} ({s['row_bytes']} bytes a row)")
    print(f"  dtype        {s['dtype']}")
    print(f"  word size    {s['word_bits']} bits")
    print(f"  clusters     {s['clusters']}" + (" (a raw table: rows as they are)" if s["clusters"] == 0 else ""))
    print(f"  raw          {s['raw_nbytes']} bytes ({_human(s['raw_nbytes'])})")
    print(f"  nbytes       {s['nbytes']} bytes ({_human(s['nbytes'])}): payload {s['payload_bytes']}, "
          f"index {s['index_bytes']}, masks {s['mask_bytes']}, tail pad "
          f"{s['nbytes'] - s['payload_bytes'] - s['index_bytes'] - s['mask_bytes']}")
    print(f"  ratio        {s['ratio']:.4f}")
    if s["mean_stored_bytes"] is not None:
        print(f"  mean row     {s['mean_stored_bytes']:.2f} stored bytes of {s['row_bytes']}")
    print(f"  raw rows     {s['raw_rows']} ({100 * s['raw_share']:.2f}%)")
    print(f"  {'cluster':>7} {'rows':>12} {'share':>8} {'mean bytes':>11} {'inv bits/word':>14}")
    for c in s["cluster_stats"]:
        mean = f"{c['mean_stored_bytes']:.2f}" if c["mean_stored_bytes"] is not None else "-"
        print(f"  {c['cluster']:>7} {c['rows']:>12} {100 * c['share']:>7.2f}% {mean:>11} "
              f"{c['invariant_bits_per_word']:>14.2f}")
    if n:
        print(f"  {'raw':>7} {s['raw_rows']:>12} {100 * s['raw_share']:>7.2f}% "
              f"{s['row_bytes'] if s['raw_rows'] else '-':>11} {'-':>14}")
    return 0


def _first_bad_row(table, lo: int, hi: int) -> int:
    """The first row in [lo, hi) that does not decode (one row at a time)."""
    for i in range(lo, hi):
        try:
            table.gather(np.array([i], dtype=np.int64))
        except FormatError:
            return i
    return lo


def cmd_verify(args) -> int:
    path = Path(args.file)
    if args.key is not None and args.against is None:
        raise CLIError("--key needs --against", 2)
    source = None
    if args.against is not None:
        source, key = load_tensor(args.against, args.key)
    t0 = time.perf_counter()
    table = load(path, mmap=True, verify=True)  # checksums and structure
    n_rows, dim = table.shape
    row_bytes = dim * table.dtype.itemsize
    if source is not None:
        where = _where(args.against, key)
        if tuple(source.shape) != table.shape:
            raise CLIError(f"{path}: shape {table.shape[0]} x {table.shape[1]} differs from "
                           f"{where}'s {' x '.join(str(s) for s in source.shape)}")
        if source.dtype != table.dtype:
            raise CLIError(f"{path}: dtype {dtype_name(table.dtype)} differs from {where}'s "
                           f"{dtype_name(source.dtype)}")
    chunk = max(1, VERIFY_CHUNK_BYTES // max(row_bytes, 1))
    with tqdm(total=n_rows, unit="row", unit_scale=True, desc=f"verifying {path.name}",
              disable=args.quiet or n_rows <= chunk) as bar:
        for lo in range(0, n_rows, chunk):
            hi = min(lo + chunk, n_rows)
            try:
                got = table.gather(np.arange(lo, hi, dtype=np.int64))
            except FormatError:
                bad = _first_bad_row(table, lo, hi)
                raise CLIError(f"{path}: FAILED: row {bad} does not decode (corrupt data)") from None
            if source is not None:
                a = got.contiguous().view(torch.uint8).reshape(hi - lo, row_bytes).numpy()
                b = source[lo:hi].contiguous().view(torch.uint8).reshape(hi - lo, row_bytes).numpy()
                if not np.array_equal(a, b):
                    diff = np.flatnonzero((a != b).any(axis=1))
                    row = lo + int(diff[0])
                    col = int(np.flatnonzero(a[diff[0]] != b[diff[0]])[0]) // table.dtype.itemsize
                    raise CLIError(f"{path}: FAILED: row {row} differs from {where} (first at "
                                   f"column {col}; {diff.size} differing rows in rows {lo}..{hi - 1})")
            bar.update(hi - lo)
    elapsed = time.perf_counter() - t0
    what = f", bit-identical to {where}" if source is not None else ""
    print(f"{path}: OK: {n_rows} x {dim} {dtype_name(table.dtype)}, checksums valid, "
          f"every row decodes{what} ({elapsed:.3f} s)")
    return 0


# ---------------------------------------------------------------- entry point

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (argparse prints usage first)
        self.print_usage(sys.stderr)
        raise CLIError(message, 2)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= v <= 256:
        raise argparse.ArgumentTypeError(f"must be in 1..256, not {v}")
    return v


def _threshold(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.5 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0.5, 1], not {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Lossless Invariant Bit Packing store for embedding tables.")
    p.add_argument("--version", action="version",
                   version=f"%(prog)s {_package_version()} (format version {_native.FORMAT_VERSION})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("compress", help="compress a table from a .pt, .npy or .safetensors file",
                       description="Compress a 2-D tensor into an .ibp file.")
    c.add_argument("input", metavar="IN", help=".pt/.pth, .npy or .safetensors file")
    c.add_argument("output", metavar="OUT", help="the .ibp file to write (replaced atomically)")
    c.add_argument("--key", "-k", help="the tensor inside a state_dict / container (nested keys "
                                       "joined with '.')")
    c.add_argument("--word-bits", type=int, choices=(16, 32, 64),
                   help="word size (default: the smallest encoding)")
    c.add_argument("--clusters", type=_positive_int, default=1,
                   help="most masks to use, 1..256 (default 1)")
    c.add_argument("--threshold", type=_threshold,
                   help="fixed invariance threshold in (0.5, 1] (default: sweep)")
    c.add_argument("--no-raw", action="store_true",
                   help="always encode, even where the masks, index and tail pad then make the table "
                        "larger than its rows (default: such a table is stored raw)")
    c.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compress)

    i = sub.add_parser("inspect", help="describe an .ibp file", description="Describe an .ibp file.")
    i.add_argument("file", metavar="FILE")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="check an .ibp file (and compare it with its source)",
                       description="Check checksums and structure, decode every row and, with "
                                   "--against, compare bit for bit with the source tensor.")
    v.add_argument("file", metavar="FILE")
    v.add_argument("--against", metavar="IN", help="the source tensor file to compare with")
    v.add_argument("--key", "-k", help="the tensor inside --against's container")
    v.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    v.set_defaults(func=cmd_verify)
    return p


def _package_version() -> str:
    from . import __version__

    return __version__


def main(argv=None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except CLIError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code
    except FormatError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `ibp-embed inspect x.ibp | head`: stop quietly
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1
    except OSError as e:
        name = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"{PROG}: error: {name}{e.strerror or _one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help / --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
