"""MASTER_PORT held by another program at an ``env://`` launch (issue 29, item 7).

Before, rank 0 failed at once with EADDRINUSE and the other ranks waited for their
collective timeout (150 s and more) connected to the other program. Now every rank fails
within ``ZEROTRAIN_RENDEZVOUS_TIMEOUT``, naming the address and port. Real processes,
a real socket listening on the port (accepting, never answering).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

_JOB = "from zerotrain.comm.env import init_distributed; init_distributed()"


def test_a_held_port_fails_every_rank_within_the_rendezvous_timeout():
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(8)  # accepts connections, never answers: another program's server
    port = holder.getsockname()[1]
    try:
        start = time.monotonic()
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", _JOB],
                env={
                    **os.environ,
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "ZEROTRAIN_DEVICE": "cpu",
                    "ZEROTRAIN_RENDEZVOUS_TIMEOUT": "5",
                },
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        outcomes = [(p.wait(timeout=60), p.stderr.read() if p.stderr else "") for p in ranks]
        seconds = time.monotonic() - start
    finally:
        holder.close()
    print(f"every rank failed within {seconds:.1f} s")
    assert seconds < 30, seconds
    for rank, (code, err) in enumerate(outcomes):
        assert code != 0, f"rank {rank} did not fail"
        assert f"127.0.0.1:{port}" in err, err[-2000:]
    assert "another program holds the port" in outcomes[0][1]
    assert "ZEROTRAIN_RENDEZVOUS_TIMEOUT" in outcomes[1][1]
