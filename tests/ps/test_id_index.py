"""The vectorised id -> value map of the parameter-server tier against a Python dict, over random
interleavings of inserts, deletes and lookups (enough to trigger many delta merges)."""
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recom_rec.ps.id_index import MISSING, IdIndex


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), universe=st.sampled_from([50, 5000, 2**62]))
def test_matches_a_dict_under_random_operations(seed, universe):
    rng = random.Random(seed)
    index, ref = IdIndex(), {}
    for _ in range(60):
        op = rng.random()
        batch = rng.randrange(0, 3000)
        ids = list({rng.randrange(universe) for _ in range(batch)})
        if op < 0.5:
            vals = [rng.randrange(1 << 40) for _ in ids]
            index.insert(torch.tensor(ids, dtype=torch.int64), torch.tensor(vals, dtype=torch.int64))
            ref.update(zip(ids, vals))
        elif op < 0.75:
            present = list(ref)
            gone = rng.sample(present, min(len(present), batch // 2)) + ids[: batch // 4]
            index.delete(torch.tensor(gone, dtype=torch.int64))
            for i in gone:
                ref.pop(i, None)
        probe = ids + rng.sample(list(ref), min(len(ref), 200))
        got = index.lookup(torch.tensor(probe, dtype=torch.int64)).tolist()
        assert got == [ref.get(i, MISSING) for i in probe]
        assert len(index) == len(ref)
    keys, vals = index.items()
    assert keys.tolist() == sorted(ref)
    assert vals.tolist() == [ref[k] for k in sorted(ref)]


def test_empty_and_negative_free_values():
    index = IdIndex()
    assert index.lookup(torch.tensor([0, 5, -3])).tolist() == [MISSING] * 3
    index.insert(torch.tensor([7, 3]), torch.tensor([0, 1]))
    index.delete(torch.tensor([3, 99]))
    assert index.lookup(torch.tensor([3, 7])).tolist() == [MISSING, 0]
    index.insert(torch.tensor([3]), torch.tensor([5]))  # revived in place
    assert index.lookup(torch.tensor([3, 7])).tolist() == [5, 0] and len(index) == 2
