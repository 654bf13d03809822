"""The engine's defences, as units (no CLI run): the cache and the refusal of unusable inputs.

Each was a defect found with no test: a truncated ``.cells/*.npz`` raised
``zipfile.BadZipFile`` out of ``cache.load``; an Inf in K gave FP8 results that a saturating cast
made finite while the float64 reference was NaN. The CLI behaviour around both is tested in
test_engine_robustness.py."""

import numpy as np
import pytest
import torch

from fa3_numerics.engine import cache
from fa3_numerics.engine.inputs import check_inputs
from fa3_numerics.errors import UsageError


@pytest.mark.parametrize("cut", [0, 10, 40, 200, -1])
def test_an_unreadable_cache_file_is_reported_removed_and_recomputed(tmp_path, cut):
    """Cut anywhere (empty, inside the zip header, inside the data, one byte short): ``load``
    returns None (recompute), warns once naming the file, and removes it."""
    path = tmp_path / "cell.npz"
    cache.save(path, {"rmse": np.arange(64.0), "max_abs": np.ones(64)})
    whole = path.read_bytes()
    assert cache.load(path, ["rmse"], warn=pytest.fail)["rmse"].tolist() == list(range(64))
    path.write_bytes(whole[:cut])
    warned = []
    assert cache.load(path, ["rmse", "max_abs"], warn=warned.append) is None
    assert len(warned) == 1 and "cell.npz is unreadable" in warned[0] and "recomputing it" in warned[0]
    assert not path.exists()


def test_a_cache_file_without_a_newer_metric_is_recomputed_silently(tmp_path):
    path = tmp_path / "cell.npz"
    cache.save(path, {"rmse": np.zeros(3)})
    assert cache.load(path, ["rmse", "new_metric"], warn=pytest.fail) is None
    assert cache.load(tmp_path / "missing.npz", ["rmse"], warn=pytest.fail) is None


@pytest.mark.parametrize("name,bad", [("Q", float("nan")), ("K", float("inf")), ("V", -float("inf"))])
def test_non_finite_inputs_are_refused_naming_the_tensor(name, bad):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 64, generator=g, dtype=torch.float64) for _ in range(3))
    {"Q": q, "K": k, "V": v}[name][0, 1, 3, 5] = bad
    with pytest.raises(UsageError, match=f"cell A: 1 non-finite value\\(s\\) in {name}"):
        check_inputs(q, k, v, scale=0.125, where="cell A")


def test_inputs_whose_float64_attention_overflows_are_refused():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 16, 64, generator=g, dtype=torch.float64) for _ in range(3))
    check_inputs(q, k, v, scale=0.125, where="x")  # ordinary inputs pass
    k[0, 0, 0, 0] = 1e300
    q[0, 0, 0, 0] = 1e10
    with pytest.raises(UsageError, match="overflow float64"):
        check_inputs(q, k, v, scale=0.125, where="x")


def test_every_study_path_checks_its_inputs(inf_k):
    """``run outliers`` (and with it ablation, audit and validate, which run through the same
    engine task) refuses an Inf in K before computing anything."""
    from fa3_numerics.studies.outliers import load_experiment, run_experiment

    exp = load_experiment("outliers", {"dist": inf_k, "seqlen": [64], "batch": 1, "heads": 1, "rows": 8,
                                       "variants": ["fa3-fp8"]})
    with pytest.raises(UsageError, match="1 non-finite value\\(s\\) in K"):
        run_experiment(exp, progress=lambda m: None)


def test_prefetch_imports_in_the_background_and_leaves_failures_to_the_caller():
    """The report's modules load in a daemon thread; a module that cannot be imported is skipped
    there (the step that needs it reports the error), and the rest still load."""
    import sys

    from fa3_numerics.cli.run import REPORT_IMPORTS
    from fa3_numerics.engine.prefetch import prefetch

    import threading

    for other in [th for th in threading.enumerate() if th.name == "fa3n-prefetch"]:
        other.join(timeout=60)  # an in-process command of an earlier test may still be importing
    sys.modules.pop("colorsys", None)
    before = sys.getswitchinterval()
    t = prefetch(("fa3n_no_such_module", "colorsys"))
    t2 = prefetch(("colorsys",))  # overlapping prefetches restore the interval from before both
    t.join(timeout=60)
    t2.join(timeout=60)
    assert not t.is_alive() and t.daemon
    assert "colorsys" in sys.modules and "fa3n_no_such_module" not in sys.modules
    assert sys.getswitchinterval() == before == pytest.approx(0.005)  # restored once the imports end
    assert "scipy.stats" in REPORT_IMPORTS and "matplotlib.figure" in REPORT_IMPORTS


def _raise_usage():
    raise UsageError("bad thing; do this instead")


def _write_marker(path):
    import sys

    with open(path, "w") as f:
        f.write(str("fa3n_report_marker" in sys.modules))


def test_report_process_runs_a_step_in_a_forked_child_with_the_command_lines_exit_codes(tmp_path, capfd):
    """The child imports its modules first, runs the function it is sent, and its exit code is
    the command line's for what ended it: 0, 2 with the one-line error for bad input; cancelled
    unused, it ends and leaves no process behind."""
    import os
    import sys

    from fa3_numerics.cli import guarded
    from fa3_numerics.engine.report_process import ReportProcess

    (tmp_path / "fa3n_report_marker.py").write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        ok = ReportProcess.start(("fa3n_report_marker", "fa3n_no_such_module"), guarded)
        assert ok.run(_write_marker, str(tmp_path / "m.txt")) == 0
        assert (tmp_path / "m.txt").read_text() == "True"  # imported in the child before the step
        assert "fa3n_report_marker" not in sys.modules  # and not here
        bad = ReportProcess.start((), guarded)
        assert bad.run(_raise_usage) == 2
        assert capfd.readouterr().err.strip().splitlines()[-1] == "error: bad thing; do this instead"
        idle = ReportProcess.start(("fa3n_report_marker",), guarded)
        idle.cancel()
        with pytest.raises(ChildProcessError):
            os.waitpid(idle.pid, os.WNOHANG)  # reaped: no zombie left
    finally:
        sys.path.remove(str(tmp_path))


def test_report_process_says_when_its_child_dies_by_a_signal(capfd):
    import os
    import signal

    from fa3_numerics.cli import guarded
    from fa3_numerics.engine.report_process import ReportProcess

    proc = ReportProcess.start((), guarded)
    assert proc.run(os.kill, proc.pid, signal.SIGKILL) == 1  # os.kill(own pid) in the child
    assert "ended by signal 9" in capfd.readouterr().err


@pytest.mark.parametrize("argv,device", [
    (["run", "outliers", "--device", "cuda"], "cuda"),
    (["run", "outliers", "--device=cuda:1"], "cuda:1"),
    (["run", "outliers", "--device", "cpu"], None),
    (["run", "outliers"], None),
    (["run", "outliers", "--device", "cuda", "--workers", "2"], None),  # forked workers must not inherit CUDA
    (["run", "outliers", "--device", "cuda", "--workers", "0"], "cuda"),
    (["run", "outliers", "--device", "cuda", "--scheduler", "tcp://h:8786"], None),
])
def test_cuda_starts_early_only_for_a_cuda_device_in_this_process(argv, device):
    from fa3_numerics.engine.cuda_start import start_cuda_early, wants_cuda

    assert wants_cuda(argv) == device
    t = start_cuda_early(argv)
    assert (t is None) == (device is None)
    if t is not None:
        t.join(timeout=60)  # without a GPU or driver it ends quietly
        assert not t.is_alive()


def test_input_summary_is_the_histogram_and_the_checks_of_separate_passes():
    """One pass per tensor gives what check_inputs and input_histogram compute on their own: the
    same counts, amaxes and non-finite counts; and check_inputs refuses from it as from its own pass."""
    import numpy as np
    import torch

    from fa3_numerics.engine.inputs import _nonfinite_and_amax, check_inputs, input_histogram, input_summary
    from fa3_numerics.errors import UsageError

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g, dtype=torch.float64) * 30 for _ in range(3))
    summary = input_summary(q, k, v)
    if summary is None:
        pytest.skip("no compiled fast paths here")
    assert np.array_equal(summary.hist, input_histogram(q, k, v))
    assert summary.checks == tuple(_nonfinite_and_amax(t) for t in (q, k, v))
    check_inputs(q, k, v, scale=0.25, where="here", summary=summary)
    k[0, 1, 7, 3] = float("inf")
    bad = input_summary(q, k, v)
    assert bad.checks[1][0] == 1 and bad.checks[0][0] == bad.checks[2][0] == 0
    with pytest.raises(UsageError, match="1 non-finite value"):
        check_inputs(q, k, v, scale=0.25, where="here", summary=bad)
