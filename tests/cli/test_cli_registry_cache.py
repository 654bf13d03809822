"""The command line's registry cache (``cli._registry_cache``): building the app reads the
registries' texts from disk, so a warm ``--help`` imports neither torch nor numpy, and any
change to the package's sources gives a new key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = ("import sys; from fa3_numerics.cli import build_app; app = build_app(); "
         "import typer.main; typer.main.get_command(app); "
         "print(','.join(m for m in ('torch', 'numpy', 'xarray') if m in sys.modules))")


def _probe(env) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow
def test_a_warm_app_imports_no_heavy_module(tmp_path):
    env = dict(os.environ, FA3N_CACHE=str(tmp_path))
    assert "torch" in _probe(env)  # cold: the texts are computed from the registries
    files = list((tmp_path / "cli").glob("registry-*.json"))
    assert len(files) == 1
    assert _probe(env) == ""  # warm: read from the cache, nothing heavy imported
    off = dict(env, FA3N_CLI_CACHE="0")
    assert "torch" in _probe(off)  # the switch really bypasses it


def test_the_fingerprint_follows_the_sources(tmp_path, monkeypatch):
    from fa3_numerics.cli import _registry_cache as rc

    rc.fingerprint.cache_clear()
    before = rc.fingerprint()
    src = os.path.join(os.path.dirname(rc.__file__), "_registry_cache.py")
    st = os.stat(src)
    try:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        rc.fingerprint.cache_clear()
        assert rc.fingerprint() != before
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
        rc.fingerprint.cache_clear()
    assert rc.fingerprint() == before


def test_in_process_registrations_are_never_served_stale(tmp_path, monkeypatch):
    """With the registry imported (a process that may have registered its own entries), the
    text is computed, not read: a family registered at run time shows at once."""
    from fa3_numerics.cli import options
    from fa3_numerics.data import distributions

    monkeypatch.setenv("FA3N_CACHE", str(tmp_path))
    distributions.available()
    entry = distributions.Entry("fa3n-test-dist:", lambda shape, seed, **p: None, "test",
                                {"fa3n_knob": (1.0, "a knob")})
    monkeypatch.setitem(distributions._REGISTRY, entry.name, entry)
    assert "fa3n_knob" in options.dist_params()
