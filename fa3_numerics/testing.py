"""Helpers shared by the test suite.

Exposed: ``run_cli``.
"""

from __future__ import annotations


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr). ``capsys`` is pytest's fixture."""
    import pytest

    from .cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    code = exc.value.code if isinstance(exc.value.code, int) else (0 if exc.value.code is None else 1)
    return code, out.out, out.err
