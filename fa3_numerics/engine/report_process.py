"""A process forked before a run that imports the report's modules while the run computes, then
writes the dataset and the report from the run's numbers.

Exposed: ``ReportProcess``.

A run's last steps import xarray, h5netcdf, scipy.stats and matplotlib: about 1.5 s of Python on
the H200 machine, where the paper-shape Table 3 computes in 1.7 s. Imported in a thread beside
the runs (``engine.prefetch``) they compete with the runs' kernel launches for the GIL: the runs
took 1.1 s longer and the imports hid only 0.35 s (``tools/device/cli_profile.sh``). A forked
process imports them on another core, with a GIL of its own. It is forked before the run's first
tensor operation and never uses CUDA or torch's thread pools itself.

Forked only where ``engine.forking`` allows it: from the console script, unless
``FA3N_FORKS=0``. The child's exit code is the command's; the caller waits for it.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
from typing import Callable

from .forking import flush_output, read_all


def _place_errors_as_usage(fn: Callable, args: tuple) -> None:
    """``fn(*args)``, a folder or file it could not make (full, read-only, no permission, a file in
    the way: ``files.PLACE_ERRNOS``) raised as the one-line ``UsageError`` of ``files.folder_error``:
    the report's writers make their figure folders themselves."""
    from .files import PLACE_ERRNOS, folder_error

    try:
        fn(*args)
    except OSError as exc:
        if exc.errno not in PLACE_ERRNOS or not exc.filename:
            raise
        raise folder_error(exc, exc.filename) from None


class ReportProcess:
    """``start(modules)`` forks a child that imports ``modules`` and waits; ``run(fn, *args)``
    sends it ``fn(*args)`` (pickled; ``fn`` must be a module-level function) and returns its exit
    code; ``cancel()`` ends it unused. ``guard`` turns the child's exceptions into an exit code
    (and says what went wrong), as the command line does for its own."""

    def __init__(self, pid: int, wfd: int):
        self.pid = pid
        self._wfd: int | None = wfd

    @classmethod
    def start(cls, modules: tuple[str, ...], guard: Callable[[Callable[[], None]], int]) -> "ReportProcess":
        from .cuda_start import settle

        settle()  # not mid-way through the CUDA driver's start (its locks would be copied held)
        flush_output()  # buffered output would otherwise be written twice, once by each process
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(wfd)
                for name in modules:
                    try:
                        importlib.import_module(name)
                    except Exception:  # noqa: BLE001 - the step that needs it reports the error with its fix
                        pass
                data = read_all(rfd)
                if not data:  # cancelled
                    code = 0
                else:
                    fn, args = pickle.loads(data)
                    code = guard(lambda: _place_errors_as_usage(fn, args))
            except KeyboardInterrupt:
                code = 130  # the parent got the same Ctrl-C and says so
            except BaseException:  # noqa: BLE001 - the child must end here whatever happens
                import traceback

                traceback.print_exc()
            finally:
                try:
                    flush_output()
                finally:  # whatever flushing raised: the child must never return into its caller
                    os._exit(code)
        os.close(rfd)
        return cls(pid, wfd)

    def run(self, fn: Callable, *args) -> int:
        """``fn(*args)`` in the child; its exit code (a signal that ended it: 1, said on stderr)."""
        data = pickle.dumps((fn, args))
        flush_output()
        wfd, self._wfd = self._wfd, None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(wfd, view):]
        finally:
            os.close(wfd)
        return self._wait()

    def cancel(self) -> None:
        """End the child without work (after an error or Ctrl-C in the run); no-op after ``run``."""
        if self._wfd is None:
            return
        os.close(self._wfd)
        self._wfd = None
        try:
            os.kill(self.pid, signal.SIGTERM)  # it may still be importing
        except ProcessLookupError:
            pass
        self._wait(quiet=True)

    def _wait(self, quiet: bool = False) -> int:
        while True:
            try:
                _, status = os.waitpid(self.pid, 0)
                break
            except InterruptedError:
                continue
        code = os.waitstatus_to_exitcode(status)
        if code < 0 and not quiet:
            print(f"error: the process writing the dataset and report ended by signal {-code}; "
                  "rerun with FA3N_FORKS=0 to write them in this process", file=sys.stderr, flush=True)
            return 1
        return code


__all__ = ["ReportProcess"]
