"""UpdatableTable: row rewrites in the arena stay bit-exact through moves, compaction and repacks."""
import numpy as np
import pytest
import torch

import ibp_embed
from ibp_embed.store import UpdatableTable


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def base():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3000, 48, generator=g) * 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clusters", [1, 3])
def test_updates_stay_bit_exact(base, dtype, clusters):
    w = base.to(dtype)
    u = UpdatableTable(ibp_embed.compress(w, clusters=clusters), repack_drift=None)
    ref = w.clone()
    g = torch.Generator().manual_seed(1)
    for step in range(20):
        ids = torch.randperm(w.shape[0], generator=g)[:200]
        # growing noise makes rows incompressible over time, so many must move
        new = (ref[ids].float() + torch.randn(200, w.shape[1], generator=g) * 0.002 * step).to(dtype)
        u.update(ids, new)
        ref[ids] = new
    ids = torch.arange(0, w.shape[0], 7)
    new = (torch.rand(ids.numel(), w.shape[1], generator=g) * 1e4 - 5e3).to(dtype)  # incompressible
    u.update(ids, new)
    ref[ids] = new
    assert torch.equal(_bits(u.decompress()), _bits(ref))
    idx = torch.randint(0, w.shape[0], (500,), generator=g)
    assert torch.equal(_bits(u.gather(idx)), _bits(ref[idx]))
    off = torch.arange(0, 501, 5)
    torch.testing.assert_close(u.lookup(idx, off),
                               torch.nn.functional.embedding_bag(idx, ref.float(), off[:-1], mode="sum"),
                               rtol=1e-6, atol=1e-6)


def test_compact_repack_and_to_table(base, tmp_path):
    u = UpdatableTable(ibp_embed.compress(base), repack_drift=None)
    ref = base.clone()
    ids = torch.arange(0, 3000, 3)
    ref[ids] = torch.randn(ids.numel(), 48) * 1e6  # far from the masks' statistics
    u.update(ids, ref[ids])
    assert u.info()["moves"] > 0
    u.compact()
    assert u.dead_bytes == 0
    assert torch.equal(_bits(u.decompress()), _bits(ref))
    u.repack()
    assert torch.equal(_bits(u.decompress()), _bits(ref))
    assert u.live_bytes == int(ibp_embed.compress(ref).row_lengths().sum())  # masks rebuilt
    t = u.to_table()
    assert torch.equal(_bits(t.decompress()), _bits(ref))
    t.save(tmp_path / "t.ibp")
    assert torch.equal(_bits(ibp_embed.load(tmp_path / "t.ibp").decompress()), _bits(ref))


def test_blocks_move_and_compaction_reclaims_their_space(base):
    u = UpdatableTable(ibp_embed.compress(base), repack_drift=None)
    ref = base.clone()
    rows = u.info()["block_rows"]
    assert rows == 16  # 48 fp32: blocks of about 4 KB raw
    g = torch.Generator().manual_seed(3)
    for b in range(0, 40, 2):  # whole blocks turn incompressible: they cannot stay
        ids = torch.arange(b * rows, (b + 1) * rows)
        ref[ids] = torch.rand(rows, 48, generator=g) * 1e4 - 5e3
        u.update(ids, ref[ids])
    i = u.info()
    assert i["moves"] >= 20
    assert i["arena_bytes"] == i["live_bytes"] + i["slack_bytes"] + i["dead_bytes"] + i["free_bytes"]
    assert i["dead_bytes"] + i["compactions"] > 0
    assert torch.equal(_bits(u.decompress()), _bits(ref))
    u.compact()
    i = u.info()
    assert i["dead_bytes"] == 0
    assert i["slack_bytes"] <= i["live_bytes"] // 64 + 8 * (3000 // rows + 1)  # headroom bounded
    assert torch.equal(_bits(u.decompress()), _bits(ref))


def test_automatic_repack_when_ratio_drifts(base):
    u = UpdatableTable(ibp_embed.compress(base), repack_drift=0.02)
    masks_before = u._book.masks.copy()
    rows = torch.randn(3000, 48) * 10.0
    u.update(torch.arange(3000), rows)
    assert not np.array_equal(u._book.masks, masks_before)  # the repack rebuilt the masks
    assert torch.equal(_bits(u.decompress()), _bits(rows))


def test_arena_grows_and_compacts_under_churn(base):
    u = UpdatableTable(ibp_embed.compress(base), repack_drift=None)
    ref = base.clone()
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        ids = torch.randperm(3000, generator=g)[:500]
        new = torch.randn(500, 48, generator=g) * torch.rand(500, 1, generator=g)
        u.update(ids, new)
        ref[ids] = new
        assert u.dead_bytes <= u.info()["arena_bytes"]
    assert torch.equal(_bits(u.decompress()), _bits(ref))


def test_bad_updates_raise(base):
    u = UpdatableTable(ibp_embed.compress(base))
    with pytest.raises(IndexError):
        u.update([3000], base[:1])
    with pytest.raises(ValueError, match="distinct"):
        u.update([1, 1], base[:2])
    with pytest.raises(ValueError):
        u.update([1, 2], base[:1])
    with pytest.raises(ValueError):
        u.update([1], base[:1].double())
    with pytest.raises(ValueError):
        u.update([1], base[:1, :10])
    assert torch.equal(_bits(u.decompress()), _bits(base))  # nothing was written


def test_reads_during_updates_see_whole_rows():
    """Readers on other threads while a writer rewrites rows, moves blocks, compacts
    and repacks: every row read is wholly one of its versions (no torn rows, no freed
    memory: this crashed or tore rows with the former arena)."""
    import threading

    g = torch.Generator().manual_seed(5)
    n, dim = 2048, 32
    a = torch.randn(n, dim, generator=g) * 0.01
    b = torch.rand(n, dim, generator=g) * 1e4 - 5e3  # incompressible: blocks must move
    u = UpdatableTable(ibp_embed.compress(a), repack_drift=0.5)
    stop = threading.Event()
    errors = []

    def reader(seed):
        rg = torch.Generator().manual_seed(seed)
        reads = 0
        while not stop.is_set() or reads < 20:
            idx = torch.randint(0, n, (256,), generator=rg)
            rows = u.gather(idx)
            ok = (rows == a[idx]).all(1) | (rows == b[idx]).all(1)
            if not bool(ok.all()):
                errors.append(f"torn row {int(idx[~ok][0])}")
                return
            pooled = u.lookup(idx[:8], torch.tensor([0, 8]))
            if not torch.isfinite(pooled).all():
                errors.append("lookup read garbage")
                return
            reads += 1

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    try:
        wg = torch.Generator().manual_seed(6)
        for step in range(60):
            ids = torch.unique(torch.randint(0, n, (300,), generator=wg))
            src = b if step % 2 == 0 else a
            u.update(ids, src[ids])
            if step % 20 == 19:
                u.compact()
        u.repack()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors[0]
    assert u.info()["moves"] > 0


def test_apply_row_gradients_sums_repeated_ids(base):
    """Pre-reduced row gradients (the GPU path's backward): one SGD step per row, an id
    given twice gets the sum of its gradients, as apply_gradients' own reduction."""
    from ibp_embed.optim import SGD

    opt = SGD(0.5)
    table = ibp_embed.compress(base, progress=False)
    w = table.decompress()
    g = torch.randn(3, w.shape[1])
    once, twice = UpdatableTable(table), UpdatableTable(table)
    once.apply_row_gradients(opt, {}, np.array([2, 7]), torch.stack([g[0] + g[1], g[2]]))
    twice.apply_row_gradients(opt, {}, np.array([2, 2, 7]), g)
    want = w.clone()
    want[2] -= 0.5 * (g[0] + g[1])
    want[7] -= 0.5 * g[2]
    for t in (once, twice):
        torch.testing.assert_close(t.decompress().float(), want.float(), rtol=0, atol=1e-6)
    assert torch.equal(once.decompress(), twice.decompress())
    once.apply_row_gradients(opt, {}, np.zeros(0, np.int64), torch.zeros(0, w.shape[1]))  # nothing to do


def test_bad_gradients_and_optimizer_state_raise(base):
    """apply_gradients hands its ids, offsets and the optimizer's state to libibp, which
    takes the ids' count from the last offset and reads and writes the state in place:
    offsets that end past the ids (a view's hidden ids, or a crash) or short of them,
    ids, offsets or grad_cols that are not integers (a float id was truncated to a row),
    and state of another shape, dtype or layout (heap corruption, or float32 bits in a
    float64 buffer) must raise before anything is written."""
    from ibp_embed.optim import SGD, Adagrad, RowWiseAdagrad

    u = UpdatableTable(ibp_embed.compress(base[:100, :8], allow_raw=False))
    before = u.decompress()
    g = torch.ones(1, 8)
    cases = [
        (ValueError, r"offsets must start at 0 and end at len\(indices\) = 1, ", SGD(0.1), {}, np.array([1, 2, 3, 4])[:1],
         [0, 4], [0]),
        (ValueError, r"= 1048576, got 0 \.\. 4194304", SGD(0.1), {},
         np.zeros(1 << 20, np.int64), [0, 1 << 22], [0]),
        (ValueError, r"= 3, got 0 \.\. 1", SGD(0.1), {}, np.array([1, 2, 3]), [0, 1], [0]),
        (TypeError, "indices must be integers, got float64", SGD(0.1), {}, np.array([1.9]), [0, 1], [0]),
        (TypeError, "offsets must be integers", SGD(0.1), {}, np.array([1]), [0.0, 1.0], [0]),
        (TypeError, "grad_cols must be integers", SGD(0.1), {}, np.array([1]), [0, 1], [0.9]),
        (ValueError, "grad_cols must be columns of grad, got -1", SGD(0.1), {}, np.array([1]), [0, 1], [-1]),
        (ValueError, r"state 'momentum1' must be of shape \(100,\) for a table of 100 x 8, got \(3,\)",
         RowWiseAdagrad(0.1), {"momentum1": torch.zeros(3)}, np.array([99]), [0, 1], [0]),
        (ValueError, r"must be of shape \(100, 8\)", Adagrad(0.1), Adagrad(0.1).init_state(1, 1), np.array([5]),
         [0, 1], [0]),
        (TypeError, "must be a contiguous float32 CPU tensor, got torch.float64", Adagrad(0.1),
         {"momentum1": torch.zeros(100, 8, dtype=torch.float64)}, np.array([1]), [0, 1], [0]),
        (TypeError, "not contiguous", Adagrad(0.1), {"momentum1": torch.zeros(8, 200).t()[:100]}, np.array([1]),
         [0, 1], [0]),
        (ValueError, "adagrad needs its state 'momentum1'", Adagrad(0.1), {}, np.array([1]), [0, 1], [0]),
    ]
    for error, match, opt, state, ids, off, cols in cases:
        with pytest.raises(error, match=match):
            u.apply_gradients(opt, state, ids, np.array(off), 1, g, cols)
    assert torch.equal(_bits(u.decompress()), _bits(before))  # nothing was written
    state = Adagrad(0.1).init_state(100, 8)
    u.apply_gradients(Adagrad(0.1), state, np.array([1, 1, 5]), np.array([0, 3]), 1, g, [0])
    assert torch.equal(state["momentum1"][1], torch.full((8,), 4.0))  # the bag's gradient 1, twice: 2^2
