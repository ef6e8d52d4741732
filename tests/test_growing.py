"""Growing: the verified positions' feature rows (EAGLE-2, Falcon, TokenSwift), appended without
copying the whole history at each commit."""
from __future__ import annotations

import torch

from splitspec.client.drafters.base import Growing


def test_appends_equal_concatenation_across_growth():
    generator = torch.Generator().manual_seed(0)
    rows = Growing(torch.zeros(0, 8, dtype=torch.bfloat16))
    reference = torch.zeros(0, 8, dtype=torch.bfloat16)
    for size in [0, 1, 5, 250, 3, 0, 600, 1, 1, 40]:  # crosses the first capacity and two doublings
        new = torch.randn(size, 8, generator=generator)  # float32 in: cast like the drafters' old .to(dtype)
        rows.append(new)
        reference = torch.cat([reference, new.to(torch.bfloat16)])
        assert len(rows) == reference.shape[0]
        assert torch.equal(rows[:], reference) and rows[:].dtype == torch.bfloat16
    assert torch.equal(rows[7], reference[7]) and torch.equal(rows[-1], reference[-1])
    assert torch.equal(rows[100:350], reference[100:350])
    assert rows[:].shape == (len(rows), 8)  # only the filled rows, not the spare capacity


def test_grows_along_another_dimension():
    """A [1, H, T, D] tensor grows along T (dim 2)."""
    generator = torch.Generator().manual_seed(1)
    keys = Growing(torch.zeros(1, 3, 0, 4), dim=2)
    reference = torch.zeros(1, 3, 0, 4)
    for size in [7, 300, 1, 0, 260]:
        new = torch.randn(1, 3, size, 4, generator=generator)
        keys.append(new)
        reference = torch.cat([reference, new], dim=2)
        assert len(keys) == reference.shape[2] and torch.equal(keys.tensor, reference)
