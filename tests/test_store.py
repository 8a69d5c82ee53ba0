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
    assert u.dead_bytes > 0  # rows grew and moved
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
    ref[ids] = torch.randn(ids.numel(), 48)  # far from the masks' statistics
    u.update(ids, ref[ids])
    assert u.dead_bytes > 0
    u.compact()
    assert u.dead_bytes == 0
    assert torch.equal(_bits(u.decompress()), _bits(ref))
    before = u.live_bytes
    u.repack()
    assert torch.equal(_bits(u.decompress()), _bits(ref))
    assert u.live_bytes <= before
    t = u.to_table()
    assert torch.equal(_bits(t.decompress()), _bits(ref))
    t.save(tmp_path / "t.ibp")
    assert torch.equal(_bits(ibp_embed.load(tmp_path / "t.ibp").decompress()), _bits(ref))


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
        assert u.dead_bytes <= u._arena.nbytes
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
