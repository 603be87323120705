"""``Checkpointer``: periodic saves under ``root/step_<N>``, ``keep_last``, async saves, and the
newest complete checkpoint agreed by every rank for a resume."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import warnings
from pathlib import Path

import torch.distributed as dist

from .group import _distributed, _rank, new_group
from .integrity import MANIFEST, list_checkpoints, prune, step_dir, verify_together
from .state import Stager, load, save


class Checkpointer:
    """Saves ``engine`` under ``root/step_<N>`` and finds the newest complete one.

    ``keep_last`` (>= 2): complete checkpoints to keep (an older one survives while the newest is
    written). ``async_save``: ``save`` returns once the state is staged (copied into CPU buffers
    kept for the next save); the finiteness check, DCP's planning and the writes run in a background
    thread, and the manifest follows when every rank has written. A new save, ``latest`` and
    ``load`` first wait for the previous save. Construct on every rank (it creates a gloo group).

    A full disk: the save removes what it wrote, keeps every complete checkpoint and raises
    ``CheckpointDiskFull`` (naming the directory, the bytes it needs and the bytes free) on every
    rank; an async save's failure is raised by the next ``save``, ``latest``, ``load`` or ``close``.
    The first save warns when the filesystem cannot hold ``keep_last + 1`` checkpoints of its size
    (the ones kept and the one being written)."""

    def __init__(
        self,
        engine,
        root: str | os.PathLike,
        *,
        keep_last: int = 2,
        async_save: bool = False,
        rng: bool = True,
        group="new",
    ):
        if not isinstance(keep_last, int) or keep_last < 2:
            raise ValueError(
                f"keep_last={keep_last!r} must be an integer >= 2: the newest checkpoint is only "
                f"complete once written, so one older complete checkpoint must survive meanwhile"
            )
        self.engine = engine
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.rng = rng
        self.group = new_group() if group == "new" else group
        self.rank = _rank(self.group)
        self._pending = None  # (future, path) of an async save
        self._stager = Stager() if async_save else None
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if async_save else None
        )
        self.last_saved: Path | None = None
        self._warned_room = False  # the first save checks the room for keep_last + 1 checkpoints

    def save(self, step: int, extra: dict | None = None, files: dict | None = None) -> Path:
        self.wait()
        path = step_dir(self.root, step)
        fut = save(
            self.engine,
            path,
            step=step,
            extra=extra,
            files=files,
            group=self.group,
            rng=self.rng,
            async_save=self.async_save,
            stager=self._stager,
            executor=self._executor,
            after=functools.partial(prune, self.root, self.keep_last),
            warn_room_for=None if self._warned_room else self.keep_last + 1,
        )
        self._warned_room = True
        if fut is None:
            self.last_saved = path
        else:
            self._pending = (fut, path)
        return path

    def wait(self) -> None:
        """Block until the pending async save (if any) is written, then complete it."""
        if self._pending is None:
            return
        fut, path = self._pending
        self._pending = None
        fut.result()
        self.last_saved = path

    def latest(self, check: bool = True, root: str | os.PathLike | None = None) -> Path | None:
        """The newest complete checkpoint under ``root`` (default: this checkpointer's), verified
        against its manifest by all ranks together (``verify_together``), skipping and naming broken
        ones (a warning on rank 0); the same on every rank; None if there is none."""
        self.wait()
        root = self.root if root is None else Path(root)
        found = [str(p) for _, p in list_checkpoints(root)] if self.rank == 0 else None
        if _distributed(self.group):  # rank 0's listing, so every rank walks the same candidates
            box = [found]
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group
            )
            found = box[0]
        for path in map(Path, found):
            if check:
                problem = verify_together(path, self.group)
            else:
                problem = None if (path / MANIFEST).is_file() else f"no {MANIFEST}"
            if problem is None:
                return path
            if self.rank == 0:
                warnings.warn(f"skipping checkpoint {path}: {problem}; trying the next older one", stacklevel=2)
        return None

    def load(self, path: str | os.PathLike, check: bool = True) -> dict:
        self.wait()
        return load(self.engine, path, group=self.group, rng=self.rng, check=check)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
