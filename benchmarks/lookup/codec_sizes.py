"""Size-only baselines: zstd / lz4 per row, blosc2 and zipnn on whole tables."""
from __future__ import annotations

import time

import numpy as np
import torch

BLOSC_CHUNK = 4 << 20
BLOSC_CLEVEL = 1


def per_row_codec_sizes(rows_u8: np.ndarray, sample: int, seed: int) -> dict:
    """zstd-3 and lz4 per row on a uniform sample of rows: estimated stored bytes of the table."""
    from ..codec import PerRowStore

    n = rows_u8.shape[0]
    if n > sample:
        pick = np.sort(np.random.default_rng(seed).choice(n, sample, replace=False))
        sub = np.ascontiguousarray(rows_u8[pick])
    else:
        sub = rows_u8
    out = {}
    for codec in ("zstd", "lz4"):
        store = PerRowStore(sub, codec)
        out[codec] = {"nbytes": store.stored_bytes() * n / sub.shape[0],
                      "encode_s": store.encode_s * n / sub.shape[0], "sampled_rows": int(sub.shape[0])}
    return out


def blosc2_size(rows_u8: np.ndarray, typesize: int) -> dict:
    import blosc2

    t0 = time.perf_counter()
    sc = blosc2.SChunk(chunksize=BLOSC_CHUNK, data=rows_u8.reshape(-1),
                       cparams=blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=BLOSC_CLEVEL,
                                              filters=[blosc2.Filter.SHUFFLE], typesize=typesize,
                                              nthreads=torch.get_num_threads()))
    return {"nbytes": int(sc.cbytes), "encode_s": time.perf_counter() - t0}


def zipnn_available() -> str | None:
    """zipnn's version if it imports, else None."""
    import importlib

    try:
        importlib.import_module("zipnn")
    except Exception:  # noqa: BLE001 - absent or broken install
        return None
    try:
        from importlib.metadata import version

        return version("zipnn")
    except Exception:  # noqa: BLE001
        return "?"


def zipnn_size(rows_u8: np.ndarray, dtype: torch.dtype, verify: bool = True) -> dict:
    """zipnn on the whole table. zipnn rewrites its input buffer in place (its byte
    reordering), so it compresses a copy."""
    import zipnn

    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=name)
    buf = bytearray(rows_u8.tobytes())
    t0 = time.perf_counter()
    comp = z.compress(buf)
    enc = time.perf_counter() - t0
    res = {"nbytes": len(comp), "encode_s": enc}
    if verify:
        res["bit_exact"] = bytes(zipnn.ZipNN(input_format="byte", bytearray_dtype=name).decompress(comp)) \
            == rows_u8.tobytes()
    return res

