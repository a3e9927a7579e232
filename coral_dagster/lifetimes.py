"""Worker processes that never outlive their parent: Linux's parent-death signal and a thread watching the parent,
and a pool that terminates its workers on any way out (an error, Ctrl-C, SIGTERM)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import InvalidStateError, ProcessPoolExecutor
from concurrent.futures.process import _ExecutorManagerThread
from contextlib import contextmanager

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """SIGKILL this process as soon as process `parent` exits, however it exits.

    `prctl(PR_SET_PDEATHSIG)` fires when the thread that forked this process ends (man 2 prctl), so a thread
    also waits on a pidfd of `parent` (Linux 5.3+); a parent already gone ends this process at once.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="coral-die-with-parent", daemon=True).start()


def _worker_start(parent: int) -> None:
    # Ctrl-C reaches the whole foreground process group: the parent terminates the pool, workers stay quiet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with(parent)


def stop_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, `kill`) raise SystemExit in the main thread, so that `finally` blocks (a pool's
    termination, a store's connection) run as they do for Ctrl-C."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def quiet_cancelled_teardown(previous):
    """`previous` (a `threading.excepthook`) without the traceback CPython 3.11 prints when a pool's workers are
    killed while its futures are being cancelled: the executor's manager thread then sets the broken-pool error on
    a cancelled future and dies of InvalidStateError (`terminate_broken` does not check the future's state). Every
    other thread's exception still reaches `previous`."""
    if getattr(previous, "quiet_cancelled_teardown", False):
        return previous

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.exc_value, InvalidStateError) and isinstance(args.thread, _ExecutorManagerThread)):
            previous(args)

    hook.quiet_cancelled_teardown = True  # type: ignore[attr-defined]
    return hook


@contextmanager
def worker_pool(processes: int) -> Iterator[ProcessPoolExecutor]:
    """A process pool whose workers die with this process; leaving the block by an exception (Ctrl-C included)
    kills them at once instead of waiting for their tasks.

    The workers are SIGKILLed (the children this process gained since the pool started), not asked to stop:
    `multiprocessing.Pool.terminate` can block for ever on a queue lock an idle worker holds, and an executor's
    shutdown waits for running tasks. The executor then finds its workers gone and shuts down without blocking.
    """
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(processes, initializer=_worker_start, initargs=(os.getpid(),))
    try:
        yield pool
    except BaseException:
        threading.excepthook = quiet_cancelled_teardown(threading.excepthook)
        for child in set(multiprocessing.active_children()) - before:
            child.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    else:
        pool.shutdown()
