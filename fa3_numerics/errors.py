"""User-facing errors.

Exposed: ``UsageError`` -- raised for bad input anywhere in the library. The CLI turns it
into one line on stderr and exit code 2; library users get an ordinary exception. The
message should name the fix, not only the fault.
"""


class UsageError(ValueError):
    """Bad input that the user can fix: one line, naming the fix."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)
