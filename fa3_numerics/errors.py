"""User-facing errors.

Exposed: ``UsageError``, ``KernelDeclined``, ``NonFiniteError``, ``require``.

``UsageError`` is raised for bad input anywhere in the library. The CLI turns it into one line
on stderr and exit code 2; library users get an ordinary exception. The message should name
the fix, not only the fault.

``NonFiniteError`` ends a command whose results hold NaN or Inf (after its files are written):
one line on stderr and exit code 3, unless the user passed ``--allow-nonfinite``.
"""


class UsageError(ValueError):
    """Bad input that the user can fix: one line, naming the fix."""

    exit_code = 2


class KernelDeclined(UsageError):
    """A kernel refuses this shape or configuration (its own planner said no): a validation records
    the case as skipped with this reason and goes on; anywhere else it is a ``UsageError``."""


class NonFiniteError(RuntimeError):
    """Results hold non-finite values; the command wrote them and says so."""

    exit_code = 3


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)
