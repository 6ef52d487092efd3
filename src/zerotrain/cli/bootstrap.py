"""Entry point each rank runs under ``zerotrain run``: executes the user's script or module
and, if it raises, records the traceback in torchrun's error file so the launcher's summary
shows which rank failed and why."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    """``python -m zerotrain.cli.bootstrap (--script PATH | --module NAME) [args...]``."""
    if len(sys.argv) < 3 or sys.argv[1] not in ("--script", "--module"):
        raise SystemExit(
            "usage: python -m zerotrain.cli.bootstrap (--script PATH | --module NAME) ..."
        )
    kind, target, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.argv = [target, *rest]
    if kind == "--module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(target).resolve().parent))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
