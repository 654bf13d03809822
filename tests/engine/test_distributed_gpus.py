"""One dask worker per GPU: which GPU each worker is given (with fake GPU counts, on the CPU),
the refusals, and, with real worker processes, that each worker sees its own
CUDA_VISIBLE_DEVICES and nothing else."""

import os

import pytest

from fa3_numerics.engine import distributed
from fa3_numerics.engine.distributed import default_workers, gpu_slots, visible_gpus
from fa3_numerics.errors import UsageError


@pytest.mark.parametrize("count", [1, 2, 4])
def test_one_worker_per_gpu_each_on_its_own(count):
    gpus = visible_gpus({}, count)
    assert gpus == [str(i) for i in range(count)]
    slots = gpu_slots(count, gpus)
    assert slots == gpus and len(set(slots)) == count  # worker i holds GPU i, none shared
    assert gpu_slots(1, gpus) == ["0"]  # fewer workers than GPUs: the first ones


@pytest.mark.parametrize("count", [1, 2, 4])
def test_more_workers_than_gpus_is_refused(count):
    with pytest.raises(UsageError, match=rf"--workers {count + 1} exceeds the {count} visible GPU\(s\).*"
                                         rf"--workers {count} or fewer"):
        gpu_slots(count + 1, visible_gpus({}, count))


def test_no_gpu_is_refused():
    with pytest.raises(UsageError, match="sees none"):
        gpu_slots(1, visible_gpus({}, 0))
    with pytest.raises(UsageError, match="sees none"):
        gpu_slots(1, visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 4))


def test_this_process_s_own_visible_devices_pass_through():
    # The driver's cuda:1 is physical GPU 3: its worker must be given "3", not "1".
    assert gpu_slots(2, visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}, 2)) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa,MIG-bb"}, 2) == ["GPU-aa", "MIG-bb"]
    # CUDA ignores entries past the devices it finds; so do the workers.
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2) == ["0", "1"]


def test_workers_default_to_the_gpu_count(monkeypatch):
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 4)
    assert default_workers("cuda") == 4
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_workers("cpu") == cores


class _Task:
    def __init__(self, device):
        self.device = device


def test_placement_by_the_tasks_device(monkeypatch):
    monkeypatch.setattr(distributed, "visible_gpus", lambda: ["0", "1"])
    assert distributed._placement([(0, _Task("cpu")), (1, _Task("cpu"))], 2) is None
    assert distributed._placement([(0, _Task("cuda"))], 2) == ["0", "1"]
    with pytest.raises(UsageError, match="--device cuda:1 names one GPU"):
        distributed._placement([(0, _Task("cuda:1"))], 1)
    with pytest.raises(UsageError, match="--workers 3 exceeds"):
        distributed._placement([(0, _Task("cuda"))], 3)


def test_run_dask_refuses_before_starting_a_cluster(monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.setattr(distributed, "visible_gpus", lambda: ["0", "1"])
    started = []
    monkeypatch.setattr(distributed, "local_cluster", lambda *a: started.append(a))
    with pytest.raises(UsageError, match="--workers 3 exceeds the 2 visible GPU"):
        distributed.run_dask([(0, _Task("cuda"))], lambda *a: None, cache_dir=None, workers=3, scheduler=None,
                             finish=lambda *a: None, progress=lambda m: None)
    assert started == []


def _seen(dask_worker):
    return dask_worker.name, os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_each_pinned_worker_process_sees_its_gpu_alone(monkeypatch):
    """Real worker processes (on the CPU: CUDA_VISIBLE_DEVICES is only read, never used here).
    The control: unpinned workers inherit this process's list, all of it."""
    pytest.importorskip("distributed")
    from distributed import Client

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,GPU-x")
    for gpus, want in ((["5", "GPU-x"], {0: "5", 1: "GPU-x"}), (None, {0: "5,GPU-x", 1: "5,GPU-x"})):
        cluster = distributed.local_cluster(2, gpus)
        msgs = []
        try:
            with Client(cluster) as client:
                client.wait_for_workers(2, timeout=60)
                seen = dict(client.run(_seen).values())
                # As a cluster at --scheduler: pinned workers pass, unpinned ones are named.
                unpinned = distributed.warn_unpinned(client, msgs.append)
        finally:
            cluster.close()
        assert seen == want
        assert len(unpinned) == (0 if gpus else 2) and len(msgs) == (0 if gpus else 1)
        assert not msgs or "2 of 2 dask worker(s) are not pinned" in msgs[0]
