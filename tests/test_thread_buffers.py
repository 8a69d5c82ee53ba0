"""The buffers lookups keep with their threads, and ibp_embed.release_thread_buffers."""
import pytest
import torch

import ibp_embed
from ibp_embed import _native
from ibp_embed.datasets import zipf_ids


@pytest.mark.parametrize("threads", [1, 2])
def test_release_frees_every_threads_buffers_and_lookups_go_on(threads):
    before = _native.lib.ibp_get_num_threads()
    _native.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(5)
        # larger than a thread's row cache, with enough ids to deduplicate (Zipf), too
        # few repeats to (uniform: windows of decoded rows) and too few ids to (the
        # row cache): every buffer kind
        w = torch.randn(40_000, 64, generator=g) * 0.01
        t = ibp_embed.compress(w, progress=False)
        ids = zipf_ids(8192 * 4, 40_000, 1.05, seed=2, perm_seed=3)
        offsets = torch.arange(0, ids.numel() + 1, 4)
        want = torch.nn.functional.embedding_bag(ids, w, offsets[:-1], mode="sum")
        uniform = torch.randint(0, 40_000, (ids.numel(),), generator=g)
        ibp_embed.release_thread_buffers()
        got = t.lookup(ids, offsets)
        t.lookup(uniform, offsets)
        t.lookup(ids[:12], offsets[:4])  # under 16 ids: the row cache
        held = ibp_embed.release_thread_buffers()
        assert held > 4 * 40_000  # the lookup's row cache and scratch, on every thread
        assert ibp_embed.release_thread_buffers() == 0  # nothing left to free
        torch.testing.assert_close(t.lookup(ids, offsets), got, rtol=0, atol=0)  # buffers come back
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        _native.set_num_threads(before)
