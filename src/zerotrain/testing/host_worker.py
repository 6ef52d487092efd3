"""One rank of a job whose ranks run on separate hosts (``testing.netns.run_on_hosts``):
``python -m zerotrain.testing.host_worker CALL RESULT`` joins the job's process group from
its ``env://`` variables, runs the pickled call and pickles ``("ok", result)`` or
``("error", traceback)`` into RESULT."""

from __future__ import annotations

import pickle
import sys
import traceback
from pathlib import Path


def main(call: str, result: str) -> int:
    try:
        from zerotrain.comm.env import init_distributed

        fn, args = pickle.loads(Path(call).read_bytes())
        init_distributed()
        outcome = ("ok", fn(*args))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    Path(result).write_bytes(pickle.dumps(outcome))
    return 0 if outcome[0] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
