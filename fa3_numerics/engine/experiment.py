"""Names that lived here before the one-engine layout, kept importable for scripts that use them
(``kernels/device/h200.py``, notebooks). New code imports from where each thing lives:

- the runner: ``fa3_numerics.engine.runner`` (``Task``, ``Job``, ``run_tasks``, ``compute_task``);
- cache keys: ``fa3_numerics.engine.cache``; inputs and histograms: ``fa3_numerics.engine.inputs``;
- checks: ``fa3_numerics.engine.checks``; row sampling: ``fa3_numerics.engine.sampling``;
- `run outliers` experiments: ``fa3_numerics.studies.outliers``.
"""

from __future__ import annotations

from ..studies.outliers import (SHAPE_SWEEPABLE, Experiment, list_experiments, load_experiment, read_toml,
                                run_experiment)
from .cache import cache_key, numerics_version
from .checks import check_backend, check_shape
from .inputs import HIST_EDGES, input_histogram
from .runner import Job, Task, compute_task, run_tasks
from .sampling import ROWS_SEED

SWEEPABLE = SHAPE_SWEEPABLE

__all__ = ["Experiment", "load_experiment", "list_experiments", "read_toml", "run_experiment", "SWEEPABLE",
           "SHAPE_SWEEPABLE", "HIST_EDGES", "ROWS_SEED", "input_histogram", "cache_key", "numerics_version",
           "check_backend", "check_shape", "Job", "Task", "compute_task", "run_tasks"]
