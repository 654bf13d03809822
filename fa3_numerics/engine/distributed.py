"""Running a sweep's tasks on dask.distributed.

Exposed: ``default_workers``, ``visible_gpus``, ``gpu_slots``, ``warn_unpinned``, ``check_scheduler``,
``run_dask``.

A sweep (``fa3_numerics.engine.runner.run_tasks``) is a list of independent tasks, one per
(cell, seed). ``run_dask`` submits them to a ``LocalCluster`` of single-threaded worker
processes (one per CPU core) or to an existing cluster at a scheduler address. Workers write
each finished variant's cache file atomically, so a sweep killed at any point resumes from what
finished; results come back to the driver, which files each at its fixed position, so the
dataset does not depend on the number of workers or the order in which tasks finish.

On CUDA the LocalCluster holds one worker per GPU, pinned: worker i starts with
``CUDA_VISIBLE_DEVICES`` set to the i-th GPU this process sees, so it sees that GPU alone, as
``cuda``/``cuda:0``, and never creates a context on another. ``--workers`` defaults to the
number of visible GPUs and may not exceed it (two workers on one GPU would contend for its memory
and its SMs). A cluster at ``--scheduler`` is used as it is: start its workers one
per GPU, each with its own ``CUDA_VISIBLE_DEVICES`` (``CUDA_VISIBLE_DEVICES=1 dask worker
tcp://HOST:8786 --nworkers 1 --nthreads 1``); a worker that sees several GPUs computes on its
first, and the run warns about it.

dask is imported only here, inside functions: runs with ``workers=0`` never need it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Callable

import torch

from ..errors import UsageError


def default_workers(device: str = "cpu") -> int:
    """One worker per visible GPU on CUDA, else one per CPU core available to this process."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def visible_gpus(env: dict | None = None, count: int | None = None) -> list[str]:
    """The GPUs this process sees, each as a worker would name it in ``CUDA_VISIBLE_DEVICES``.

    Entries of this process's own ``CUDA_VISIBLE_DEVICES`` (indices, ``GPU-`` UUIDs or MIG
    names) pass through as written, so a worker sees the same physical GPU that this process
    calls ``cuda:i``; CUDA ignores entries past the devices it finds, hence the cut at ``count``
    (torch's device count unless given).
    """
    env = os.environ if env is None else env
    if count is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [e.strip() for e in listed.split(",") if e.strip()][:count]


def gpu_slots(workers: int, gpus: list[str]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each of ``workers`` pinned workers: worker i holds GPU i."""
    if not gpus:
        raise UsageError("--device cuda with --workers needs a GPU, and this process sees none "
                         "(check CUDA_VISIBLE_DEVICES and nvidia-smi, or run with --device cpu)")
    if workers > len(gpus):
        raise UsageError(f"--workers {workers} exceeds the {len(gpus)} visible GPU(s) "
                         f"({','.join(gpus)}): one worker per GPU, so use --workers {len(gpus)} or fewer")
    return gpus[:workers]


def _placement(todo: list, workers: int) -> list[str] | None:
    """The GPU of each LocalCluster worker when the tasks run on CUDA, else None (CPU workers)."""
    devices = {sub.device for _, sub in todo}
    if not any(d.startswith("cuda") for d in devices):
        return None
    if devices != {"cuda"}:
        named = ", ".join(sorted(d for d in devices if d != "cuda"))
        raise UsageError(f"--device {named} names one GPU, but --workers places one worker on each GPU: "
                         "write --device cuda, or run on that GPU alone with --workers 0")
    return gpu_slots(workers, visible_gpus())


def _worker_gpus() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def warn_unpinned(client, progress: Callable[[str], None]) -> list[str]:
    """Warn about the workers of an existing cluster that may see several GPUs (no
    ``CUDA_VISIBLE_DEVICES``, or a list): each would compute on its first GPU only, so workers
    sharing a host would share that GPU. Returns their addresses."""
    seen = client.run(_worker_gpus)
    bad = sorted(a for a, v in seen.items() if v is None or "," in v)
    if bad:
        shown = ", ".join(f"{a} ({'unset' if seen[a] is None else seen[a]})" for a in bad[:3])
        progress(f"warning: {len(bad)} of {len(seen)} dask worker(s) are not pinned to one GPU "
                 f"(CUDA_VISIBLE_DEVICES: {shown}{', ...' if len(bad) > 3 else ''}); each computes on its first "
                 "GPU: start one worker per GPU, each with its own CUDA_VISIBLE_DEVICES")
    return bad


def check_scheduler(address: str | None) -> None:
    """Refuse a scheduler address that is not ``scheme://host:port`` before anything runs."""
    if address is None:
        return
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(address)
        ok = bool(parts.scheme and parts.hostname and parts.port)
    except ValueError:
        ok = False
    if not ok:
        raise UsageError(f"--scheduler {address!r} is not a dask scheduler address; write it as tcp://HOST:PORT "
                         "(e.g. tcp://10.0.0.5:8786)")


# Where a LocalCluster listens: this machine only. dask's ":0" binds every interface, which would
# put the dashboard (and its task graph, worker logs, profiles) on the network. A user who wants
# it elsewhere says so: FA3N_DASHBOARD=0.0.0.0:8787.
LOOPBACK = "127.0.0.1"


def dashboard_address() -> str:
    """The dashboard's address: FA3N_DASHBOARD, else a free port on the loopback interface
    (a free port so that two runs never collide)."""
    return os.environ.get("FA3N_DASHBOARD", "").strip() or f"{LOOPBACK}:0"


@contextlib.contextmanager
def _children_ignore_ctrl_c():
    """Start processes that ignore SIGINT: a terminal's Ctrl-C reaches every process of its
    group, and a dask worker process that gets it prints two tracebacks of its event loop
    (36 lines for two workers) before the driver, which handles Ctrl-C, closes the cluster and
    its workers anyway. An ignored signal stays ignored through fork and exec, and Python and
    asyncio install their own SIGINT handlers only over the default one, so the workers never
    see it. This process ignores it too while the workers start (seconds), then handles it again."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class _HeartbeatAfterScheduler(logging.Filter):
    """Drops a LocalCluster worker's "failed to communicate with scheduler during heartbeat" and its
    traceback: the scheduler lives in the driver, so it is gone only when the driver closes the
    cluster (a Ctrl-C, an error), and a worker still beating then has nothing to tell the user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to communicate with scheduler during heartbeat")


def dask_setup(worker) -> None:
    """Preloaded by each LocalCluster worker (``local_cluster``): quiet the shutdown race's log."""
    logging.getLogger("distributed.worker").addFilter(_HeartbeatAfterScheduler())


def local_cluster(workers: int, gpus: list[str] | None = None):
    """A LocalCluster of ``workers`` single-threaded worker processes, scheduler, workers and
    dashboard listening on the loopback interface (the dashboard where FA3N_DASHBOARD says).
    With ``gpus`` (one ``CUDA_VISIBLE_DEVICES`` value per worker), worker i sees ``gpus[i]`` only."""
    from dask.distributed import LocalCluster

    # Without bokeh the scheduler still serves a few HTTP routes at this address: keep it local too.
    options = dict(threads_per_worker=1, processes=True, host=LOOPBACK, dashboard_address=dashboard_address(),
                   worker_dashboard_address=None, silence_logs=logging.ERROR, preload=[__name__])
    with _children_ignore_ctrl_c():
        if gpus is None:
            return LocalCluster(n_workers=workers, **options)
        # The nanny sets ``env`` in the worker process before the worker starts, hence before any task
        # imports torch and long before CUDA reads CUDA_VISIBLE_DEVICES (at its first call).
        cluster = LocalCluster(n_workers=0, **options)
        cluster.worker_spec.update({i: {"cls": cluster.new_spec["cls"],
                                        "options": {**cluster.new_spec["options"],
                                                    "env": {"CUDA_VISIBLE_DEVICES": gpu}}}
                                    for i, gpu in enumerate(gpus)})
        cluster.sync(cluster._correct_state)  # start them now, while the caller's dask.config applies
        return cluster


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None


def _dashboard(client, local: bool) -> str:
    """The dashboard's address, or how to get one. A LocalCluster without bokeh still serves a
    few JSON routes at that address, but no dashboard: the hint is then the useful line."""
    if local and not _has_bokeh():
        return "no dashboard (it needs bokeh: pip install 'bokeh>=3.1')"
    try:
        link = client.dashboard_link
    except Exception:  # noqa: BLE001 - a scheduler without a dashboard raises various errors
        link = ""
    if link and (client.scheduler_info().get("services") or {}).get("dashboard"):
        return f"dashboard {link}"
    return "the scheduler serves no dashboard"


def run_dask(todo: list, compute: Callable, *, cache_dir: Path | None, workers: int, scheduler: str | None,
             finish: Callable, progress: Callable[[str], None]) -> None:
    """Compute ``todo`` ([(index, task)]) with ``compute(task, cache_dir, threads)`` on dask;
    call ``finish(index, task, result)`` on the driver as each task completes."""
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise UsageError("parallel runs need dask.distributed: pip install 'dask[distributed]' "
                         "(or run with --workers 0)") from None

    cdir = str(cache_dir) if cache_dir else None
    cluster = None
    if scheduler:
        check_scheduler(scheduler)
        try:
            client = Client(scheduler, timeout="20s")
        except (OSError, TimeoutError, ValueError) as exc:
            raise UsageError(f"cannot reach the dask scheduler at {scheduler}: {exc}") from None
        threads = 0  # an existing cluster's workers keep their own thread settings
        progress(f"dask: connected to {scheduler} ({len(client.scheduler_info()['workers'])} worker(s)); "
                 f"{_dashboard(client, local=False)}")
        if any(sub.device.startswith("cuda") for _, sub in todo):
            warn_unpinned(client, progress)
    else:
        if workers < 1:
            raise UsageError(f"--workers must be >= 0, got {workers}")
        import dask

        # dask's nanny sets MALLOC_TRIM_THRESHOLD_=65536 in workers, which switches off glibc's
        # dynamic mmap threshold: every large temporary tensor is then a fresh mmap and the
        # emulator spends more time in page faults than computing (measured 3.8 s of system
        # time against 2.5 s of user time per task). Workers get the thread caps only.
        with dask.config.set({"distributed.nanny.pre-spawn-environ": {
                "OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1}}):
            gpus = _placement(todo, workers)
            cluster = local_cluster(workers, gpus)
        client = Client(cluster)
        threads = 1
        where = f", one per GPU (CUDA_VISIBLE_DEVICES {' / '.join(gpus)})" if gpus else ""
        progress(f"dask: LocalCluster with {workers} single-threaded worker process(es){where}; "
                 f"{_dashboard(client, local=True)}")
    try:
        futures = {client.submit(compute, sub, cdir, threads, pure=False, key=f"fa3n-task-{ti}"): (ti, sub)
                   for ti, sub in todo}
        for fut in as_completed(futures):
            ti, sub = futures[fut]
            finish(ti, sub, fut.result())
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
