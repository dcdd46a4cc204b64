"""Tolerances for comparing float results of two different kernel paths.

A batched and an unbatched matrix product, the first k of K batched products and all K, a tree forward
and a sequential one: BLAS promises none of them the same summation order, so their results agree to
rounding, not bit for bit, and which bits differ depends on the CPU (and its BLAS build). Tests compare
such pairs within these tolerances, or on what the code promises (the same argmax, candidates, tokens);
bitwise equality is kept for the same call on the same data, copies and file round trips.
"""

from __future__ import annotations

FP32 = {"rtol": 1e-5, "atol": 1e-6}
"""float32: ``torch.testing.assert_close(a, b, **FP32)``; a few ulp of a logit, far below any top-k gap."""
