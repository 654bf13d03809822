"""engine.forking.forked_map: the results of the calls, in order, whether they ran in forked
children or here; a child's exception raised in the caller; nothing forked where forks are not
allowed."""

from __future__ import annotations

import os

import pytest

from fa3_numerics.engine import forking


@pytest.fixture
def forks():
    forking.allow_forks(True)
    yield
    forking.allow_forks(False)


def _pid_and(x):
    return lambda: (os.getpid(), x * x)


def test_forked_map_returns_every_result_in_order_from_other_processes(forks):
    out = forking.forked_map([_pid_and(i) for i in range(4)])
    assert [v for _, v in out] == [0, 1, 4, 9]
    pids = [p for p, _ in out]
    assert pids[-1] == os.getpid()  # the last call runs here
    assert len(set(pids[:-1])) == 3 and os.getpid() not in pids[:-1]


def test_forked_map_raises_a_childs_exception_here(forks):
    def bad():
        raise ValueError("figure 1 failed")

    with pytest.raises(ValueError, match="figure 1 failed"):
        forking.forked_map([bad, _pid_and(2)])


def test_forked_map_passes_large_results_through_the_pipe(forks):
    big = b"x" * (3 << 20)  # far beyond a pipe's buffer: the child blocks until it is read
    assert forking.forked_map([lambda: big, lambda: b""]) == [big, b""]


def test_forked_map_runs_here_without_forks(monkeypatch):
    forking.allow_forks(True)
    monkeypatch.setenv("FA3N_FORKS", "0")
    try:
        out = forking.forked_map([_pid_and(i) for i in range(3)])
    finally:
        forking.allow_forks(False)
    assert out == [(os.getpid(), 0), (os.getpid(), 1), (os.getpid(), 4)]


def test_forked_map_ends_every_child_when_one_fails(forks, monkeypatch):
    def bad():
        raise KeyError("first")

    pids, fork = [], os.fork

    def recording_fork():
        pid = fork()
        if pid:
            pids.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", recording_fork)
    with pytest.raises(KeyError):
        forking.forked_map([bad, _pid_and(1), _pid_and(2)])
    assert len(pids) == 2
    for pid in pids:  # every child was waited for: none is left to reap
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
