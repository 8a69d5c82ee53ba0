"""A differential fuzz of the pooled lookups: random tables and batches, every kernel set,
1 and 2 threads, against torch's embedding_bag on the original rows.

    python tests/fuzz_lookups.py --minutes 10          # seeds 0, 1, 2, ... for ten minutes
    python tests/fuzz_lookups.py --seed 1234 --cases 1 # one case again

The unit tests pick each lookup path on purpose (a slot a row, hashed slots, the
deduplicated scratch, every id decoded, raw tables); this draws the paths by chance
over what they are chosen from: tables of 1 to 400k rows, dims 1-400, float32 / float16
/ bfloat16 with special values (NaN payloads, infinities, -0.0, denormals), word sizes
and clusters, ids uniform, Zipf, sorted or from a few rows, empty bags, weights and
modes, one to three tables a call. Each case checks:

- `gather` returns the table's exact bits, on every kernel set;
- `lookup_many` on every kernel set and thread count: unweighted sums bit for bit equal
  to torch's (both add a bag's rows in order in float32), weighted sums and means
  within a relative 1e-5 (absolute 1e-6; their rounding may differ: fused
  multiply-adds, a reciprocal);
- one table's `lookup` bit for bit equal to its columns of `lookup_many`;
- an id past the table's end, or negative, raises IndexError.
Outputs are allocated poisoned (helpers.every_isa), so an element a kernel leaves
unwritten fails as well.

Small tables are pooled from a decoded copy (PackedJobs), made once under the first
kernel set: the others' decoders meet those tables through `gather` and `lookup`.
The draws of a case do not depend on the CPU's kernel sets: a seed replays its case
on any machine (the kernel sets compared are this CPU's).

Prints each failing seed with its tables and exits 1 if any failed. Not run by `make
test` (tests/test_fuzz_lookups.py runs a few cases); run it after changing a lookup or
decode path.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback

import numpy as np
import torch

from helpers import every_isa
from ibp_embed import batched, codec, datasets
from ibp_embed._native import KERNEL_SETS, lib, runnable_kernel_sets

DIMS = (1, 2, 3, 7, 8, 16, 24, 31, 32, 48, 63, 64, 96, 100, 128, 192, 256, 384, 400)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ELEMENTS = 12_000_000  # per table: a case takes seconds, not minutes
SPECIAL = (float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -1e-42, 65504.0, 1e-7)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def random_rows(rng: np.random.Generator, n: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """An [n, dim] table of one of six kinds, and the kind's name. "moved": values in [1, 2]
    with the last mantissa bit clear (a float32's two halves then have invariant bits of
    their own: at W = 16 two extras), of which 5-60% of the rows have most columns of a
    run at another exponent with that bit set, so that a step's words may all not
    participate (such a W = 16 step past its window's first register chose that window
    on the low halves' bits alone, 58251bc; 1% outliers never brought one there)."""
    kind = str(rng.choice(["torchrec", "normal", "trained", "special", "constant"]))
    seed = int(rng.integers(1 << 30))
    # half of the trained-like tables are "moved", drawn from a generator of their own:
    # rng's draws, and so a seed's other tables, ids and weights, are those before it came
    g = np.random.default_rng([seed, 2])
    if kind == "trained" and g.random() < 0.5:
        kind = "moved"
    if kind == "trained":
        return datasets.make_trained_like_table(n, dim, dtype, seed=seed, perm_seed=seed), kind
    if kind == "moved":
        rows = (1 + torch.from_numpy(g.random((n, dim), dtype=np.float32))).to(dtype)
        _bits(rows)[:] &= ~1
        a = g.integers(0, dim, n)
        run = (np.arange(dim) >= a[:, None]) & (np.arange(dim) < (a + 1 + g.integers(0, dim - a))[:, None])
        run &= (g.random(n) < g.uniform(0.05, 0.6))[:, None] & (g.random((n, dim)) < g.uniform(0.5, 1))
        at = torch.from_numpy(run)
        rows[at] = (rows[at].float() * 1024).to(dtype)
        _bits(rows)[at] |= 1
        return rows, kind
    rows = datasets.make_table(n, dim, dtype, init="normal" if kind == "normal" else "torchrec", seed=seed)
    if kind == "constant":
        rows[:] = rows[0].clone()
    elif kind == "special":  # 2% of the values special, and NaNs with other payloads
        flat = rows.view(-1)
        k = max(1, flat.numel() // 50)
        at = torch.from_numpy(rng.integers(0, flat.numel(), k))
        flat[at] = torch.tensor(SPECIAL).to(dtype)[torch.from_numpy(rng.integers(0, len(SPECIAL), k))]
        nan = torch.isnan(flat)
        bits = _bits(flat)
        bits[nan] ^= torch.from_numpy(rng.integers(0, 3, int(nan.sum()))).to(bits.dtype)
    return rows, kind


def random_ids(rng: np.random.Generator, n_rows: int, count: int) -> tuple[torch.Tensor, str]:
    how = str(rng.choice(["zipf", "uniform", "few", "sorted"]))
    if how == "zipf":
        ids = datasets.zipf_ids(count, n_rows, float(rng.uniform(0.6, 1.4)), seed=int(rng.integers(1 << 30)),
                                perm_seed=int(rng.integers(100)))
        return torch.as_tensor(ids, dtype=torch.int64), how
    if how == "few":
        return torch.from_numpy(rng.choice(rng.integers(0, n_rows, int(rng.integers(1, 20))), count)), how
    ids = torch.from_numpy(rng.integers(0, n_rows, count))
    return (ids.sort().values if how == "sorted" else ids), how


def reference(rows: torch.Tensor, ids, offsets, weights, mode: str) -> torch.Tensor:
    out = torch.nn.functional.embedding_bag(ids, rows.float(), offsets[:-1], mode="sum", per_sample_weights=weights)
    if mode == "mean":
        out = out * (1.0 / (offsets[1:] - offsets[:-1]).clamp(min=1).float())[:, None]
    return out


def mismatch(out: np.ndarray, ref: np.ndarray, exact_cols: np.ndarray) -> np.ndarray:
    """[i, j] of the elements that differ: in exact_cols by their bits (any NaN equals any
    NaN: torch does not keep payloads through sums), elsewhere by more than 1e-5."""
    same = (out.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(out) & np.isnan(ref))
    close = np.isclose(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    return np.argwhere(np.where(exact_cols[None, :], same, close) == 0)


def one_case(seed: int, kernel_sets: dict) -> str | None:
    """Runs case `seed` on kernel_sets ({name: IBP_ISA_*}, of those this CPU runs); returns
    what failed, or None. libibp's kernel set and thread count are as before when it
    returns (the kernel set through helpers.every_isa, which also poisons the outputs
    each set's calls allocate, so that an element a kernel leaves unwritten fails)."""
    threads = lib.ibp_get_num_threads()
    try:
        return _case(seed, kernel_sets)
    finally:
        lib.ibp_set_num_threads(threads)


def _case(seed: int, kernel_sets: dict) -> str | None:
    rng = np.random.default_rng(seed)
    picks = np.random.default_rng([seed, 1])  # the draws inside the kernel-set loop
    n_tables, n_bags = int(rng.integers(1, 4)), int(rng.choice([1, 2, 7, 64, 513, 1024, 4096]))
    tables, rows, ids, offsets, weights, modes, about = [], [], [], [], [], [], []
    for _ in range(n_tables):
        dim = int(rng.choice(DIMS))
        n = max(1, min(int(np.exp(rng.uniform(0, np.log(400_000)))), MAX_ELEMENTS // dim))
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        r, kind = random_rows(rng, n, dim, dtype)
        t = codec.compress(r, word_bits=[None, 16, 32, 64][int(rng.integers(4))],
                           clusters=int(rng.choice([1, 1, 2, 4, 16])), progress=False)
        pooling = rng.integers(0, int(rng.choice([1, 5, 20, 40])) + 1, n_bags)
        if rng.random() < 0.2:
            pooling[rng.random(n_bags) < 0.3] = 0
        off = torch.from_numpy(np.concatenate([[0], np.cumsum(pooling)]))
        i, how = random_ids(rng, n, int(off[-1]))
        w = torch.from_numpy(rng.uniform(-2, 2, int(off[-1])).astype(np.float32)) if rng.random() < 0.3 else None
        mode = "mean" if rng.random() < 0.25 else "sum"
        for lst, x in zip((tables, rows, ids, offsets, weights, modes), (t, r, i, off, w, mode)):
            lst.append(x)
        about.append(f"{n}x{dim} {str(dtype)[6:]} {kind} W{t.word_bits} K{t.clusters} ids {how} "
                     f"P~{pooling.mean():.1f}{' weighted' if w is not None else ''} {mode}")
    what = f"seed {seed}: " + "; ".join(about)
    gathered = [torch.from_numpy(rng.integers(0, t.shape[0], min(5000, 3 * t.shape[0]))) for t in tables]
    ref = torch.cat([reference(*a) for a in zip(rows, ids, offsets, weights, modes)], dim=1).numpy()
    exact = np.concatenate([np.full(t.shape[1], m == "sum" and w is None) for t, m, w in zip(tables, modes, weights)])
    names = {isa: name for name, isa in KERNEL_SETS.items() if name in kernel_sets}
    with contextlib.closing(every_isa()) as isas:
        for isa in isas:
            if isa not in names:
                continue
            for k, (t, r, pick) in enumerate(zip(tables, rows, gathered)):
                if not torch.equal(_bits(t.gather(pick)), _bits(r[pick])):
                    return f"table {k}'s gather differs from its bits ({names[isa]}; {what})"
            for threads in (1, 2):
                lib.ibp_set_num_threads(threads)
                where = f"{names[isa]}, {threads} thread" + ("s" if threads > 1 else "")
                out = batched.lookup_many(tables, ids, offsets, per_sample_weights=weights, mode=modes)
                bad = mismatch(out.numpy(), ref, exact)
                if len(bad):
                    return f"lookup_many ({where}) differs at {bad[:3].tolist()} ({what})"
                k = int(picks.integers(n_tables))
                c0 = sum(t.shape[1] for t in tables[:k])
                one = tables[k].lookup(ids[k], offsets[k], per_sample_weights=weights[k], mode=modes[k])
                if not torch.equal(_bits(one), _bits(out[:, c0:c0 + tables[k].shape[1]].contiguous())):
                    return f"table {k}'s lookup differs from lookup_many ({where}; {what})"
    k = int(rng.integers(n_tables))
    if ids[k].numel():
        bad_ids = ids[k].clone()
        past = int(rng.integers(3))
        bad_ids[int(rng.integers(bad_ids.numel()))] = (tables[k].shape[0] + past) if rng.random() < 0.5 else (-1 - past)
        try:
            batched.lookup_many(tables, [bad_ids if j == k else x for j, x in enumerate(ids)], offsets,
                                per_sample_weights=weights, mode=modes)
        except IndexError:
            return None
        return f"an id out of table {k}'s range raised nothing ({what})"
    return None


def run(first: int, cases: int | None, seconds: float | None, out=sys.stdout) -> int:
    """Cases first, first + 1, ... (`cases` of them, or for `seconds`); returns the failures."""
    sets = runnable_kernel_sets()
    start, seed, failed = time.monotonic(), first, 0
    while (cases is None or seed - first < cases) and (seconds is None or time.monotonic() - start < seconds):
        try:
            problem = one_case(seed, sets)
        except Exception:  # noqa: BLE001 - a crash of a case is a finding, not the end
            problem = f"seed {seed} raised:\n{traceback.format_exc()}"
        if problem:
            failed += 1
            print(problem, file=out, flush=True)
        seed += 1
        if (seed - first) % 20 == 0:
            print(f"[{time.monotonic() - start:.0f} s] {seed - first} cases, {failed} failed", file=out, flush=True)
    print(f"{seed - first} cases (seeds {first}-{seed - 1}) on {', '.join(sets)}: {failed} failed", file=out)
    return failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the first case's seed")
    p.add_argument("--cases", type=int, help="how many cases (default: until --minutes)")
    p.add_argument("--minutes", type=float, default=None, help="how long (default 5 without --cases)")
    a = p.parse_args(argv)
    if a.cases is not None and a.cases < 1:
        p.error(f"--cases must be at least 1, not {a.cases}")
    if a.minutes is not None and not a.minutes > 0:
        p.error(f"--minutes must be more than 0, not {a.minutes}")
    minutes = a.minutes if a.minutes is not None or a.cases is not None else 5.0
    return 1 if run(a.seed, a.cases, None if minutes is None else 60 * minutes) else 0


if __name__ == "__main__":
    sys.exit(main())
