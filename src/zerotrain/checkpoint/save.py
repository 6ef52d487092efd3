"""``save_checkpoint``: every rank of the job writes its share into a temporary directory,
which becomes the checkpoint only after all of them succeeded and the manifest is written.

Sequence (each arrow is an agreement over every rank of the job: all learn whether any rank
failed, and all raise together if one did, so no rank is left waiting):

1. the ranks check they were given the same directory; global rank 0 finishes or undoes a
   same-tag save a crash interrupted, creates ``SAVE_DIR/.TAG.partial`` and writes
   ``client_state.pt`` ->
2. each rank writes ``rankNNNNN.safetensors`` (NNNNN = its global rank: its shards of
   parameters, fp32 master weights and optimizer states, plus its RNG states) and a small
   index of what is where, in global coordinates ->
3. global rank 0 merges every rank's index into ``manifest.json`` (checksummed), renames the
   directory to ``SAVE_DIR/TAG`` (keeping an existing copy as ``.TAG.old`` until ``latest``
   names the new one), then rewrites ``latest`` and prunes old checkpoints (``keep_last``).

A crash at any point leaves a complete copy of every checkpoint that was complete before:
see ``checkpoint/directory.py``. A save that fails (every rank raises together) removes its
``.TAG.partial`` directory. Before writing, the ranks compare what they will write with the
free space of each filesystem they share (ranks on one host writing to one device add up),
so a full disk is reported as such, with the bytes needed and free, before anything is
written; a disk that fills up anyway is reported the same way.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint import rank_local, regions, rng
from zerotrain.checkpoint.directory import (
    check_tag,
    old_dir,
    partial_dir,
    recover,
    shard_file,
    write_latest,
)
from zerotrain.checkpoint.errors import CheckpointError
from zerotrain.checkpoint.manifest import CLIENT_STATE, MANIFEST, fsync_dir, read_manifest
from zerotrain.checkpoint.merge import merge_indexes, write_index
from zerotrain.checkpoint.plan import build_plan
from zerotrain.checkpoint.safetensors_io import StreamingWriter, TensorSpec
from zerotrain.checkpoint.state import TrainState
from zerotrain.comm import liveness
from zerotrain.comm.agreement import disagreements, failed_ranks, filesystem_needs
from zerotrain.comm.collectives import CollectiveError, Communicator
from zerotrain.utils.logging import get_logger

log = get_logger(__name__)


def agree(comm: Communicator, error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``error`` is set on any: the failing rank re-raises its own,
    the others name the ranks that failed."""
    failed = failed_ranks(comm, error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"rank {comm.rank}: rank(s) {failed} failed while {what} (their own error says "
            "why); nothing was renamed into place"
        )


def check_same_directory(comm: Communicator, what: str, path: Path) -> None:
    """Raise on every rank, naming each rank's value, unless all ranks passed the same
    directory (as an absolute path): each rank would otherwise write or read a different
    checkpoint, and the manifest would name files that are not beside it."""
    differing = disagreements(comm, [(what, os.path.abspath(path))])
    if differing:
        raise ValueError(
            f"rank {comm.rank}: every rank must pass the same {what}; they differ: "
            + "; ".join(differing)
        )


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    writer = StreamingWriter(path, specs, {"format": "zerotrain-checkpoint"})
    try:
        for key, tensor in tensors.items():
            writer.write(key, tensor)
    except BaseException:
        writer.close_quietly()  # the write's own error is the one to report
        raise
    return writer.close()


# Beyond the tensors' bytes: the shard's header, the rank's index, the manifest.
_SLACK_BYTES = 1 << 20


def _shard_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values()) + _SLACK_BYTES


def _check_space(comm: Communicator, path: Path, needed: int) -> OSError | None:
    """Collective: whether the ranks writing to ``path``'s filesystem on this host fit in
    its free space; the error to raise (ENOSPC, naming path, bytes needed and free), if not.
    """
    total, sharing = filesystem_needs(comm, {path: needed})[path]
    free = shutil.disk_usage(path).free
    if total <= free:
        return None
    return OSError(
        errno.ENOSPC,
        f"no space left on device for checkpoint {path}: the {sharing} rank(s) writing "
        f"to this filesystem need {total:,} bytes ({total / 2**20:.1f} MiB), "
        f"{free:,} bytes ({free / 2**20:.1f} MiB) are free; free space or save elsewhere",
    )


def _no_space(exc: OSError, path: Path, needed: int) -> OSError:
    """``exc`` (ENOSPC while writing) with the path and the bytes needed and free."""
    free = shutil.disk_usage(path).free
    return OSError(
        errno.ENOSPC,
        f"no space left on device while writing checkpoint {path}: this rank needed "
        f"{needed:,} bytes, {free:,} bytes are free now (the disk filled up after the "
        f"check before the save); free space or save elsewhere ({exc})",
    )


def _check_same_tag(comm: Communicator, tag: str, validation: str) -> None:
    if comm.world_size == 1 or validation == "ignore":
        return
    differing = disagreements(comm, [("tag", repr(tag))])
    if not differing:
        return
    message = (
        f"rank {comm.rank} saves checkpoint tag {tag!r}, but the ranks passed different "
        f"tags: {differing[0]}"
    )
    if validation == "fail":
        raise ValueError(message + " (checkpoint.tag_validation is 'Fail')")
    log.warning("%s; each rank writes into its own tag's directory", message)


def _save_client_state(path: Path, client_state: Any) -> None:
    torch.save(client_state, path)
    try:
        torch.load(path, weights_only=True)
    except Exception as exc:
        path.unlink()
        raise ValueError(
            "client_state must be loadable without unpickling arbitrary code (tensors, "
            "numbers, strings, and lists, tuples and dicts of them); torch.load("
            f"weights_only=True) refuses it: {exc}"
        ) from exc


def _prune(root: Path, keep_last: int, current: str) -> None:
    """Remove the oldest complete checkpoints beyond ``keep_last`` (never ``current``)."""
    found = []
    for manifest in root.glob(f"[!.]*/{MANIFEST}"):
        try:
            found.append((read_manifest(manifest.parent).created, manifest.parent))
        except CheckpointError:
            continue  # not ours, or damaged: left for a person to look at
    found.sort()
    for _, path in found[: max(0, len(found) - keep_last)]:
        if path.name != current:
            shutil.rmtree(path)
            log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", path, keep_last)


def _write_rank(state: TrainState, partial: Path) -> None:
    """Step 2 on one rank: its shard file and its index, after the job-wide space check
    (collective: every rank takes part, also one whose plan failed)."""
    placement = state.placement
    # Swapped-out states (NVMe offload) are read back for as long as they are written.
    with state.sharded.resident(write_back=False):
        error: Exception | None = None
        needed = 0
        try:
            state.sharded.adopt_outside_changes()  # what the user wrote since the last step
            plan, tensors, aliases = build_plan(state, shard_file(placement.global_rank))
            rng_state, rng_tensors = rng.capture(placement.device)
            plan.tensors.update(rng_tensors)
            local_entry, local_tensors = rank_local.capture(state.optimizer)
            plan.tensors.update(local_tensors)
            needed = _shard_bytes(plan.tensors)
        except Exception as exc:
            error = exc
        space = _check_space(placement.world, partial, needed)
        if error is not None or space is not None:
            raise error or space  # type: ignore[misc]
        try:
            size, crc = _write_shard(partial / plan.file, plan.tensors)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise _no_space(exc, partial, needed) from exc
            raise
    write_index(
        partial,
        placement.global_rank,
        plan,
        size,
        crc,
        rng_state,
        tensors,
        aliases,
        local_entry,
        regions.group_members(state),
    )


def _agree_or_discard(
    comm: Communicator, error: BaseException | None, what: str, partial: Path, leader: bool
) -> None:
    """``agree``; when the save failed, the leader removes the partial directory first.
    When the agreement itself failed (a rank died or stopped answering: maybe the leader),
    every surviving rank removes it."""
    try:
        agree(comm, error, what)
    except BaseException as exc:
        if (leader or isinstance(exc, CollectiveError)) and partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
            log.info("removed the incomplete checkpoint directory %s", partial)
        raise


def save_checkpoint(
    state: TrainState,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: Any = None,
    keep_last: int | None = None,
) -> str:
    """Write a checkpoint of ``state`` to ``save_dir/tag``; returns its path.

    Collective over every rank of the job. ``tag`` defaults to ``global_step{N}``;
    ``keep_last`` (default: the job's ``checkpoint.keep_last``) removes older checkpoints.

    Raises:
        ValueError: the ranks passed different directories (each rank's is named), a bad
            tag or ``keep_last``, or a ``client_state`` that cannot be loaded safely.
        CheckpointError: a rank failed to write (every rank raises, naming it).
    """
    placement = state.placement
    world = placement.world
    tag = check_tag(tag if tag is not None else f"global_step{state.counters().global_steps}")
    _check_same_tag(world, tag, state.tag_validation)
    keep_last = keep_last if keep_last is not None else state.keep_last
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    root = Path(save_dir)
    check_same_directory(world, "save_dir", root)
    final, partial = root / tag, partial_dir(root, tag)
    started = time.perf_counter()
    leader = placement.global_rank == 0

    # A rank ended by the peer watchdog mid-save (a peer stopped answering) removes the
    # partial directory on its way out, as a raised error would have.
    with liveness.undone_if_given_up(functools.partial(shutil.rmtree, partial, True)):
        _save_into(state, world, root, partial, final, tag, client_state, keep_last, leader)
    if leader:
        total = sum(p.stat().st_size for p in final.iterdir())
        log.info(
            "saved checkpoint %s (%s in %.2f s)",
            final,
            f"{total / 2**20:.1f} MiB",
            time.perf_counter() - started,
        )
    return str(final)


def _save_into(
    state: TrainState,
    world: Communicator,
    root: Path,
    partial: Path,
    final: Path,
    tag: str,
    client_state: Any,
    keep_last: int | None,
    leader: bool,
) -> None:
    """Write the checkpoint into ``partial`` on every rank, then commit it as ``final``."""
    error: BaseException | None = None
    if leader:
        try:
            root.mkdir(parents=True, exist_ok=True)
            recover(root)  # a save that died replacing a tag: finish or undo it first
            partial.mkdir()
            if client_state is not None:
                _save_client_state(partial / CLIENT_STATE, client_state)
        except Exception as exc:
            error = exc
    _agree_or_discard(world, error, f"creating {partial}", partial, leader)

    try:
        _write_rank(state, partial)
    except Exception as exc:
        error = exc
    _agree_or_discard(world, error, f"writing their shards into {partial}", partial, leader)

    if leader:
        try:
            checksum = merge_indexes(state, partial, tag, client_state is not None)
            _commit(root, partial, final, tag, checksum)
            if keep_last is not None:
                _prune(root, keep_last, tag)
        except Exception as exc:
            error = exc
    _agree_or_discard(world, error, f"writing the manifest of {final}", partial, leader)


def _commit(root: Path, partial: Path, final: Path, tag: str, checksum: str) -> None:
    """Rename the complete ``partial`` into place and point ``latest`` at it. After each
    step one complete copy of the tag exists where ``locate`` looks for it (TAG, or
    ``.TAG.old`` while ``latest`` still names the old manifest), and ``recover`` finishes or
    undoes whatever a crash interrupted."""
    fsync_dir(partial)
    if final.exists():  # the same tag saved again
        old = old_dir(root, tag)
        os.replace(final, old)
        os.replace(partial, final)
        write_latest(root, tag, checksum)
        fsync_dir(root)
        shutil.rmtree(old)
    else:
        os.replace(partial, final)
        write_latest(root, tag, checksum)
    fsync_dir(root)
