"""``ZEROTRAIN_PEER_TIMEOUT``: the peer watchdog is on by default, at the heartbeat timeout,
and can be switched off (issue 42)."""

from __future__ import annotations

import pytest

from zerotrain.comm import liveness


def test_the_watchdog_is_on_by_default_at_the_heartbeat_timeout(monkeypatch):
    monkeypatch.delenv("ZEROTRAIN_PEER_TIMEOUT", raising=False)
    monkeypatch.delenv("ZEROTRAIN_HEARTBEAT_TIMEOUT", raising=False)
    assert liveness.peer_timeout() == 10.0
    monkeypatch.setenv("ZEROTRAIN_HEARTBEAT_TIMEOUT", "3")
    assert liveness.peer_timeout() == 3.0


@pytest.mark.parametrize("off", ["0", "off", "OFF"])
def test_the_watchdog_can_be_switched_off(monkeypatch, off):
    monkeypatch.setenv("ZEROTRAIN_PEER_TIMEOUT", off)
    assert liveness.peer_timeout() is None


def test_an_explicit_timeout_is_taken(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_PEER_TIMEOUT", "60")
    assert liveness.peer_timeout() == 60.0


@pytest.mark.parametrize("bad", ["1", "soon", "-5"])
def test_a_bad_timeout_says_what_is_allowed(monkeypatch, bad):
    monkeypatch.setenv("ZEROTRAIN_PEER_TIMEOUT", bad)
    with pytest.raises(ValueError, match="0 / off"):
        liveness.peer_timeout()
