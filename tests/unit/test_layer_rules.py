"""The layer rules of docs/architecture.md, checked from the import graph of src/zerotrain.

A rule written only in prose drifts (the architecture page said for weeks that ``shard``
never imports ``zero``). Known violations are listed with the file that holds them; the
layer clean-up of the composable-core issue removes them, and the test then fails until
the exception is deleted here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "zerotrain"

# Modules that may import torch.distributed, each with its reason.
DISTRIBUTED_ALLOWED = {
    "comm/": "the communication layer: the only caller of torch.distributed",
    "testing/dist.py": "spawns ranks and owns the rendezvous store for tests",
    "testing/pool.py": "test worker pools: one process group made per pool, run many jobs",
    "testing/isolation.py": "checks, between pooled tests, what a test left in the process groups",
    "cli/bootstrap.py": "torchrun's error recorder around the user's script",
    "cli/run.py": "the launcher runs torchrun itself",
    "checkpoint/dcp_export.py": "writes torch.distributed.checkpoint files (a file format: "
    "no process group)",
}

# What a plain-torch feature package (no engine, no process group, no config) never imports.
_PLAIN_TORCH = frozenset(
    {
        "comm",
        "shard",
        "zero",
        "offload",
        "optim",
        "engine",
        "checkpoint",
        "parallel",
        "cli",
        "config",
    }
)

# package -> packages it must never import (DESIGN.md §2, "knows nothing of").
FORBIDDEN = {
    "config": {
        "comm",
        "shard",
        "zero",
        "precision",
        "offload",
        "optim",
        "engine",
        "checkpoint",
        "parallel",
        "cli",
        "sparse_attention",
    },
    "comm": {
        "shard",
        "zero",
        "precision",
        "offload",
        "optim",
        "engine",
        "checkpoint",
        "parallel",
        "cli",
        "config",
    },
    "parallel": {"zero", "shard", "offload", "engine", "checkpoint", "cli"},
    # shard/ describes what to communicate (shard/io.py); zero/ issues it through comm/.
    "shard": {"engine", "checkpoint", "cli", "zero", "comm", "offload"},
    "optim": {"comm", "shard", "zero", "engine", "checkpoint", "cli", "parallel"},
    "precision": {"comm", "shard", "zero", "engine", "checkpoint", "cli"},
    "utils": {"comm", "shard", "zero", "engine", "checkpoint", "cli", "config", "optim"},
    "checkpoint": {"cli", "engine"},
    "zero": {"engine", "checkpoint", "cli"},
    # Attention kernels and layouts: plain torch, usable without an engine or a process group.
    "sparse_attention": _PLAIN_TORCH,
    # Layer drop, curriculum, random-LTD: plain torch (engine/efficiency.py applies them).
    "efficiency": _PLAIN_TORCH,
}

# (importing file, imported package): violations that exist today, to be removed. None left;
# a new one needs its reason written here.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()

# (importing file, imported package) -> why: permanent exceptions, not violations. The rules
# keep a lower layer from depending on a higher one; a public module that only gives a
# higher layer's functions DeepSpeed's import path is no part of the lower layer's
# machinery, as long as nothing inside zerotrain imports it (checked below), so importing
# the lower layer never loads the higher one.
PUBLIC_PATH_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("utils/zero_to_fp32.py", "checkpoint"): "deepspeed.utils.zero_to_fp32's path and script; "
    "the implementation is checkpoint/fp32_export.py",
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def test_only_comm_imports_torch_distributed() -> None:
    offenders = []
    for path in _sources():
        rel = _relative(path)
        uses = any(
            n == "torch.distributed" or n.startswith("torch.distributed.") for n in _imports(path)
        ) or "torch.distributed." in path.read_text().replace("``torch.distributed.", "")
        if uses and not any(rel.startswith(prefix) for prefix in DISTRIBUTED_ALLOWED):
            offenders.append(rel)
    assert not offenders, f"torch.distributed outside comm/: {offenders}"


def test_layers_import_only_what_they_may() -> None:
    found = set()
    for path in _sources():
        rel = _relative(path)
        package = rel.split("/")[0].removesuffix(".py")
        for name in _imports(path):
            parts = name.split(".")
            if (
                parts[0] == "zerotrain"
                and len(parts) > 1
                and parts[1] in FORBIDDEN.get(package, ())
            ):
                found.add((rel, parts[1]))
    new = found - KNOWN_VIOLATIONS - PUBLIC_PATH_EXCEPTIONS.keys()
    assert not new, f"imports against the layer rules (docs/architecture.md): {sorted(new)}"
    fixed = {v for v in KNOWN_VIOLATIONS if v not in found}
    assert not fixed, f"fixed, so delete them from KNOWN_VIOLATIONS: {sorted(fixed)}"
    unused = {v for v in PUBLIC_PATH_EXCEPTIONS if v not in found}
    assert not unused, f"no longer needed, so delete them from PUBLIC_PATH_EXCEPTIONS: {unused}"


def test_public_path_modules_are_imported_by_nothing_inside_zerotrain() -> None:
    facades = {
        "zerotrain." + file.removesuffix(".py").replace("/", ".")
        for file, _ in PUBLIC_PATH_EXCEPTIONS
    }
    users = {
        (_relative(path), name)
        for path in _sources()
        for name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in facades)
    }
    assert not users, f"import the implementation, not the public-path module: {sorted(users)}"


def test_nothing_uses_the_default_group_implicitly() -> None:
    # Every collective goes through a Communicator over a group passed in explicitly; a
    # helper on the default group bypasses stats and signature checks, and under a grid
    # reaches ranks that hold other parameters.
    users = {
        _relative(p)
        for p in _sources()
        if "broadcast_without_engine" in p.read_text() or "group=None" in p.read_text()
    }
    assert not users, users


# Private PyTorch APIs the package relies on; each may appear only in utils/torch_compat.py
# (torch._foreach_* are left in place: torch's own optimizers use them as their fast path).
PRIVATE_TORCH = ("torch._C.", "torch.utils._pytree", "_unsafe_preserve", "torch._fused", "._cdata")


def test_private_torch_calls_live_in_one_compat_module() -> None:
    offenders = {
        _relative(p): [name for name in PRIVATE_TORCH if name in code]
        for p in _sources()
        if _relative(p) != "utils/torch_compat.py"
        for code in [_code_only(p)]
        if any(name in code for name in PRIVATE_TORCH)
    }
    assert not offenders, offenders


def _code_only(path: Path) -> str:
    # Docstrings and comments may name the private calls they explain.
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            node.value = ast.Constant("")
    return ast.unparse(tree)
