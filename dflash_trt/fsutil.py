"""Atomic file and directory writes: an interrupted run never leaves a half-written artifact.

Every artifact directory (an engine, a Triton repository, a drafter export) is written through
:func:`atomic_directory`, which also

- takes a lock per destination (``.NAME.lock`` beside it, flock'ed, holding the holder's pid, host
  and start time), so a second writer to the same path is told who holds it instead of racing;
- removes the ``.NAME.partial-*`` / ``.NAME.old-*`` directories a writer killed with SIGKILL left
  in the same parent (a name is stale when nobody holds its lock);
- turns I/O failures (read-only filesystem, no permission, disk full) into one line naming the
  path, the free space and the space needed;
- gives files and directories the modes the umask says (0644 / 0755 by default), not the 0600 /
  0700 of ``tempfile``, so another user of a shared filesystem (a Slurm container) can read them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_trt.errors import DFlashError

# A writer finding the lock held retries for LOCK_RETRIES x LOCK_RETRY_S (2 s): long enough for
# another process's stale-partial sweep, which takes a name's lock while it removes its partials.
LOCK_RETRIES, LOCK_RETRY_S = 10, 0.2
PARTIAL_RE = re.compile(r"^\.(?P<name>.+)\.(?:partial-[A-Za-z0-9_]+|old-[0-9]+)$")


def umask() -> int:
    """The process umask (read from /proc, so no other thread sees it changed; os.umask elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


def apply_umask(path: Path, executable: bool = False) -> None:
    """chmod `path` to what a plain open()/mkdir() would have made (tempfile makes 0600/0700)."""
    full = 0o777 if executable or path.is_dir() else 0o666
    path.chmod(full & ~umask())


def apply_umask_tree(root: Path) -> None:
    """:func:`apply_umask` on `root` and everything under it: tempfile's private files, and
    files copied with their source's mode (shutil.copy2), get the mode a fresh file would have;
    executable files stay executable."""
    apply_umask(root)
    for p in root.rglob("*"):
        if not p.is_symlink():
            apply_umask(p, executable=p.is_dir() or bool(p.stat().st_mode & 0o100))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Free space (for this user) on the filesystem that holds `path` or its nearest existing parent."""
    return shutil.disk_usage(_existing(Path(path))).free


def tree_bytes(root: str | Path) -> int:
    """Total size of the regular files under `root` (0 if it does not exist)."""
    root = Path(root)
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


_EXPECTED: dict[Path, tuple[int, str]] = {}  # final path -> (bytes needed, what it is), from reserve_space


def reserve_space(final: str | Path, needed_bytes: float, what: str = "the output") -> None:
    """Check now that `final`'s filesystem has `needed_bytes` free, and remember the figure so a
    disk that fills during the write (another job writing too) is reported with it."""
    final = Path(final).absolute()
    _EXPECTED[final] = (int(needed_bytes), what)
    check_free_space(final, int(needed_bytes), what)


def check_free_space(path: str | Path, needed_bytes: int, what: str = "the output") -> None:
    """DFlashError before any writing when `path`'s filesystem has less free than `needed_bytes`."""
    free = free_bytes(path)
    if free < needed_bytes:
        raise DFlashError(f"not enough disk space for {what} at {path}: {human_bytes(free)} free, about "
                          f"{human_bytes(needed_bytes)} needed; free space there or choose another location")


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def _disk_full_text(e: BaseException) -> bool:
    text = str(e)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


@contextlib.contextmanager
def io_errors(path: str | Path, needed_bytes: int | None = None, what: str = "the output") -> Iterator[None]:
    """Turn a failure to write under `path` into one actionable line (DFlashError): read-only
    filesystem or no permission (naming the path), disk full (naming the free and needed space).
    safetensors and torch report a full disk as their own exception types; their text is matched."""
    path = Path(path)
    try:
        yield
    except DFlashError:
        raise
    except OSError as e:
        where = e.filename or path
        if e.errno in _DISK_FULL:
            raise DFlashError(_full_message(path, needed_bytes, what)) from e
        if e.errno in _NOT_WRITABLE and _under(Path(where), path):
            reason = "read-only filesystem" if e.errno == errno.EROFS else "permission denied"
            raise DFlashError(f"cannot write {what} at {path}: {reason} ({where}); choose a writable location "
                              "(e.g. --out under your home or scratch directory)") from e
        raise
    except Exception as e:
        if _disk_full_text(e):
            raise DFlashError(_full_message(path, needed_bytes, what)) from e
        raise


def _under(p: Path, root: Path) -> bool:
    """`p` is `root`, inside it, a parent that could not be created, or a sibling (the lock and
    temporary files we write beside `root`)."""
    p, root = p.absolute(), root.absolute()
    return p == root or root in p.parents or p in root.parents or p.parent == root.parent


def _full_message(path: Path, needed_bytes: int | None, what: str) -> str:
    need = f", about {human_bytes(needed_bytes)} needed" if needed_bytes else ""
    return (f"disk full writing {what} at {path}: {human_bytes(free_bytes(path))} free{need}; "
            "free space there or choose another location")


@contextlib.contextmanager
def atomic_file(path: str | Path, what: str | None = None, needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path` for the caller to write; when the block ends without an
    exception the file gets the umask's mode (not tempfile's 0600) and is renamed over `path`,
    otherwise it is removed and `path` is untouched. Every artifact file is written through here;
    a failure to write is one line naming `what` (default: the file's name), see :func:`io_errors`."""
    path = Path(path)
    with io_errors(path, needed_bytes, what=what or path.name):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            apply_umask(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """`text` into `path` through :func:`atomic_file`, fsync'ed before the rename."""
    data = text.encode("utf-8")
    with atomic_file(path, needed_bytes=len(data)) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def lock_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.lock")


def _try_flock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path` (created if needed), or None when another
    process holds it. Retries when the holder unlinked the file between our open and flock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # we locked a file its holder had just removed: lock the current one


def _holder(path: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
        return f"pid {info['pid']} on {info['host']} since {info['started']} ({info.get('command', '?')})"
    return "another process"


@contextlib.contextmanager
def directory_lock(final: str | Path) -> Iterator[None]:
    """Hold ``.NAME.lock`` beside `final` for the duration; DFlashError naming the holder when
    another writer holds it. flock is released by the kernel when its holder dies (SIGKILL
    included), so a stale lock file never blocks anyone."""
    import sys

    final = Path(final)
    path = lock_path(final)
    fd = _try_flock(path)
    for _ in range(LOCK_RETRIES):  # remove_stale_partials may hold a name's lock for a moment
        if fd is not None:
            break
        time.sleep(LOCK_RETRY_S)
        fd = _try_flock(path)
    if fd is None:
        raise DFlashError(f"{final} is being written by {_holder(path)}; wait for it to finish, or choose "
                          f"another --out (lock {path})")
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv[:3])[:200]}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        with contextlib.suppress(OSError):
            apply_umask(path)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still locked: a waiter that opened it re-checks the inode
        os.close(fd)


def remove_stale_partials(parent: Path, own_name: str | None = None) -> list[Path]:
    """Remove the ``.NAME.partial-*`` / ``.NAME.old-*`` directories in `parent` whose writer is
    gone (nobody holds ``.NAME.lock``); `own_name`: a name whose lock the caller holds. Returns
    what was removed."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for entry in sorted(parent.iterdir()):
        m = PARTIAL_RE.match(entry.name)
        if not m or not entry.is_dir() or entry.is_symlink():
            continue
        name = m.group("name")
        if name == own_name:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
            continue
        lock = lock_path(parent / name)
        fd = _try_flock(lock)
        if fd is None:
            continue  # a live writer of that name
        try:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
            os.close(fd)
    return removed


def _say_removed(paths: list[Path]) -> None:
    import sys

    for p in paths:
        print(f"removed {p}: a partial write left by a process that died", file=sys.stderr)


@contextlib.contextmanager
def atomic_directory(final: str | Path, overwrite: bool = False, needed_bytes: int | None = None,
                     what: str = "the output", on_stale: Any = None) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; rename it into place only on success.

    On any exception (Ctrl-C included) the temporary directory is removed and `final` is
    untouched, so a directory at `final` always means a completed write. One writer per `final`
    at a time (:func:`directory_lock`); stale partial directories of dead writers in the same
    parent are removed first (`on_stale(paths)` is told which); `needed_bytes`: checked against
    the free space before anything is written, and named if the disk fills anyway.
    """
    final = Path(final)
    if final.absolute() in _EXPECTED:  # the caller reserved the space: its figure and its words
        reserved, reserved_what = _EXPECTED[final.absolute()]
        needed_bytes = needed_bytes or reserved
        what = reserved_what if what == "the output" else what
    if on_stale is None:
        on_stale = _say_removed
    with io_errors(final, needed_bytes, what):
        final.parent.mkdir(parents=True, exist_ok=True)
        with directory_lock(final):
            stale = remove_stale_partials(final.parent, own_name=final.name)
            if stale and on_stale is not None:
                on_stale(stale)
            if needed_bytes:
                check_free_space(final, needed_bytes, what)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
            try:
                yield tmp
                apply_umask_tree(tmp)
                if final.exists():
                    if not overwrite:
                        raise DFlashError(f"{final} already exists; pass --force to replace it, or choose another path")
                    old = final.with_name(f".{final.name}.old-{os.getpid()}")
                    os.replace(final, old)
                    os.replace(tmp, final)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.replace(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
