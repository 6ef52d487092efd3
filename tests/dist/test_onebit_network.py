"""The 1-bit optimizers across separate network hosts (Linux network namespaces joined by a
100 Mbit/s link, as a pair of machines would be): the ranks meet over TCP (gloo; shared
memory never joins different hosts), training equals the one-process reference, and the
traffic crosses the link. Needs root (skipped with the reason elsewhere)."""

from __future__ import annotations

import pytest

from tests.dist.test_onebit_optimizers import ADAM, TOL, _spec, _train
from tests.helpers import onebit_reference as ref
from zerotrain.testing import netns

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))


def test_onebit_adam_across_two_hosts_matches_the_reference():
    spec = _spec("OneBitAdam", 0, {"freeze_step": 6})
    with netns.hosts(2, rate="100mbit") as (a, b):
        before = a.link_bytes()
        ranks = netns.run_on_hosts(_train, [a, b], spec, timeout=300)
        crossed = a.link_bytes() - before
    want = ref.onebit_adam(spec, 2, ranks[0]["packing"], freeze_step=6)
    for got in ranks:
        worst = max(abs(x - y) for x, y in zip(got["losses"], want["losses"], strict=True))
        assert worst <= TOL, worst
        for name, value in want["params"].items():
            assert (got["params"][name] - value).abs().max() <= TOL, name
    # At least the warm-up's gradient all-reduces went over the wire.
    numel = ranks[0]["packing"].padded
    assert crossed > 6 * 4 * numel, crossed
    assert ADAM["eps"] == 1e-4
