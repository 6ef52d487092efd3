"""What one test may leave behind in a process that the next test will run in.

A pooled test worker (``testing/pool.py``) runs many tests one after another. Before each it
takes nothing for granted: it resets what a fresh process would start with (random number
generators) and after each it compares the process with the :class:`ProcessSnapshot` taken
when the worker was ready. Anything left that would change the next test's behaviour or
grow without bound over a session is a finding, reported against the test that left it:

* the default process group destroyed or replaced, or a process group left that zerotrain
  did not create (zerotrain's own groups, described ``zerotrain:...``, belong to the engines
  of the finished test and are released here, as process exit would release them);
* environment variables set, changed or removed;
* functions of torch replaced (monkey-patches not undone), global module hooks, torch
  function or dispatch modes left active, grad mode, default dtype, thread count changed;
* the working directory changed, signal handlers left installed;
* shared-memory segments this process created and did not remove (NVMe swap directories
  are closed, as exit would close them: a live engine's files stay until then by design);
* threads still running, files and sockets still open.

Nothing here imports pytest; ``pool.py`` reports the findings as the test's failure.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.modules.module as module_globals

from zerotrain.comm import departures, shm
from zerotrain.offload import swap
from zerotrain.utils.torch_compat import active_mode_counts

# Threads that live as long as the process by design, started by the first test that needs
# them: zerotrain's heartbeat and the peer watchdog (one per process, replaced per job;
# comm/liveness.py), the exit marker's signal reader (comm/departures.py), tqdm's
# progress-bar monitor (one per process, started with the first bar).
PROCESS_THREADS = (
    "zerotrain-heartbeat",
    "zerotrain-watchdog",
    "zerotrain-exit-marker",
    "tqdm_monitor",
)
# Installed once per process by design: NVMe offload's swap clean-up on SIGTERM, and the
# exit marker on SIGTERM and SIGHUP (comm/departures.py).
PROCESS_SIGNAL_HANDLERS = (
    swap._close_open_directories_on_sigterm,
    departures.marked_signal_handler,
)
ZEROTRAIN_GROUP_PREFIX = "zerotrain:"
_SETTLE_S = 2.0
_SIGNALS = tuple(
    s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2, signal.SIGCHLD)
)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_parameter_registration_hooks",
    "_global_module_registration_hooks",
    "_global_buffer_registration_hooks",
)


def _patchable() -> dict[str, Any]:
    """The namespaces whose functions tests (and zero.Init) patch."""
    import torch.nn.functional
    import torch.utils.checkpoint

    return {
        "torch": torch,
        "torch.Tensor": torch.Tensor,
        "torch.nn.Module": torch.nn.Module,
        "torch.nn.Parameter": torch.nn.Parameter,
        "torch.nn.functional": torch.nn.functional,
        "torch.distributed": dist,
        "torch.distributed.distributed_c10d": dist.distributed_c10d,
        "torch.autograd": torch.autograd,
        "torch.optim.Optimizer": torch.optim.Optimizer,
        "torch.utils.checkpoint": torch.utils.checkpoint,
    }


def _functions(namespace: ModuleType | type) -> dict[str, int]:
    """Identity of every callable attribute of ``namespace`` (by name)."""
    out: dict[str, int] = {}
    with warnings.catch_warnings():  # deprecated aliases warn when looked at
        warnings.simplefilter("ignore")
        for name, value in list(vars(namespace).items()):
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                out[name] = id(value)
    return out


def _open_files() -> dict[int, str]:
    """This process's open file descriptors and what each points at."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            found[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
    return found


def _torch_state() -> dict[str, Any]:
    return {
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "default dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "anomaly detection": torch.is_anomaly_enabled(),
        "active torch function and dispatch modes": active_mode_counts(),
        "autocast (cpu)": torch.is_autocast_enabled("cpu"),
    }


@dataclasses.dataclass
class ProcessSnapshot:
    """The state of a ready worker, which every test must leave as it found it."""

    environ: dict[str, str]
    cwd: str
    default_group: Any
    functions: dict[str, dict[str, int]]
    hooks: dict[str, int]
    torch_state: dict[str, Any]
    signals: dict[int, Any]
    threads: set[int]
    files: dict[int, str]
    rng: torch.Tensor
    probe_timeout_s: float

    @classmethod
    def take(cls, probe_timeout_s: float) -> ProcessSnapshot:
        """The state now; ``probe_timeout_s``: how long the check's probe collective may
        wait (the process group's timeout)."""
        return cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            default_group=dist.group.WORLD if dist.is_initialized() else None,
            functions={k: _functions(v) for k, v in _patchable().items()},
            hooks={h: len(getattr(module_globals, h, {})) for h in _GLOBAL_HOOKS},
            torch_state=_torch_state(),
            signals={s: signal.getsignal(s) for s in _SIGNALS},
            threads={t.ident for t in threading.enumerate() if t.ident is not None},
            files=_open_files(),
            rng=torch.get_rng_state(),
            probe_timeout_s=probe_timeout_s,
        )

    def prepare(self, env: Mapping[str, str]) -> None:
        """Start a test as a fresh process would: the RNG as it was when the worker
        started, the snapshot's environment plus ``env``."""
        torch.set_rng_state(self.rng)
        import random

        import numpy as np

        random.seed()
        np.random.seed()
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(env)

    def findings(self, env: Mapping[str, str]) -> list[str]:
        """What the test that just ran left behind (each a sentence), after releasing what
        is the pool's to release (zerotrain's process groups, garbage). Restores the
        environment either way: a finding fails the test and retires the worker."""
        gc.collect()
        swap.close_open_directories()  # an engine's swap files live until exit by design
        found = _group_findings(self.default_group, self.probe_timeout_s)
        found += self._environ_findings(env)
        if os.getcwd() != self.cwd:
            found.append(f"the working directory changed to {os.getcwd()} (was {self.cwd})")
        found += self._torch_findings()
        for sig, handler in self.signals.items():
            now = signal.getsignal(sig)
            if now != handler and now not in PROCESS_SIGNAL_HANDLERS:
                found.append(f"a handler for {signal.Signals(sig).name} is still installed")
        found += _segment_findings()
        return found + self._resource_findings()

    def _resource_findings(self) -> list[str]:
        """Threads and open files, given a moment: a thread may be finishing, and garbage
        that holds a file may still be reachable from another thread's frame."""
        deadline = time.monotonic() + _SETTLE_S
        while True:
            found = self._thread_findings() + self._file_findings()
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)
            gc.collect()

    def _environ_findings(self, env: Mapping[str, str]) -> list[str]:
        expected = {**self.environ, **env}
        now = dict(os.environ)
        found = [
            f"environment variable {k} was set to {now[k]!r}"
            if k not in expected
            else f"environment variable {k} was changed to {now[k]!r} (was {expected[k]!r})"
            for k in sorted(now)
            if now[k] != expected.get(k)
        ]
        found += [f"environment variable {k} was removed" for k in sorted(expected) if k not in now]
        os.environ.clear()
        os.environ.update(self.environ)
        return found

    def _torch_findings(self) -> list[str]:
        found = []
        for space, before in self.functions.items():
            after = _functions(_patchable()[space])
            # Names added are not counted: importing a library may add methods for good
            # (transformers adds nn.Module.smart_apply); existing ones must stay themselves.
            for name in sorted(before):
                if before[name] != after.get(name):
                    verb = "removed" if name not in after else "replaced"
                    found.append(f"{space}.{name} was {verb} and not restored")
        for hook, count in self.hooks.items():
            if len(getattr(module_globals, hook, {})) != count:
                found.append(f"a global module hook is still registered ({hook})")
        state = _torch_state()
        found += [
            f"torch {k} is {state[k]!r} (was {v!r})"
            for k, v in self.torch_state.items()
            if state[k] != v
        ]
        return found

    def _thread_findings(self) -> list[str]:
        return [
            f"thread {t.name!r} is still running"
            for t in threading.enumerate()
            if t.ident not in self.threads and t.name not in PROCESS_THREADS
        ]

    def _file_findings(self) -> list[str]:
        now = _open_files()
        new = {fd: path for fd, path in now.items() if self.files.get(fd) != path}
        return [f"file descriptor {fd} -> {path} is still open" for fd, path in sorted(new.items())]


def _group_findings(default_group: Any, probe_timeout_s: float) -> list[str]:
    """Release zerotrain's process groups left by finished engines; name any other."""
    if not dist.is_initialized() or dist.group.WORLD is not default_group:
        return [
            "the default process group was destroyed or replaced (the test must leave the "
            "one it was given)"
        ]
    found = []
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is default_group:
            continue
        desc = getattr(group, "group_desc", "") or ""
        if not desc.startswith(ZEROTRAIN_GROUP_PREFIX):
            ranks = dist.get_process_group_ranks(group)
            named = "" if desc in ("", "undefined") else f" {desc!r}"
            found.append(f"process group{named} of ranks {ranks} was left (never destroyed)")
        dist.destroy_process_group(group)
    return found + _health_findings(probe_timeout_s)


def _health_findings(timeout_s: float) -> list[str]:
    """One all-reduce over the default group: a test that let a collective time out or fail
    (and caught the error) can leave the ranks' gloo pairs out of step, which the next test
    would meet as a hang or someone else's data. It waits as long as the group's collectives
    may (a rank can finish its job well after another)."""
    probe = torch.ones(1)
    try:
        work = dist.all_reduce(probe, async_op=True)
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # gloo raises on a broken pair or a timeout
        return [f"the default process group no longer works ({type(exc).__name__}: {exc})"]
    if not ok or probe.item() != dist.get_world_size():
        return [f"the default process group no longer works (a probe summed to {probe.item()})"]
    return []


def _segment_findings() -> list[str]:
    left = shm.remove_segments_of({os.getpid()})
    return [f"shared-memory segment /dev/shm/{name} was left" for name in left]


def describe(findings: Iterable[str]) -> str:
    return "".join(f"\n  - {f}" for f in findings)
