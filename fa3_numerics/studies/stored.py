"""What every study class shares on top of ``engine.study.Study``: reading a saved dataset of its
kind back with its findings (``studies.findings``: computed on load for a dataset written before
findings were stored). ``engine.dataset.read`` calls ``upgrade`` through the study registry, so
``fa3-numerics report`` hands the report page a dataset that holds every finding it renders."""

from __future__ import annotations


class StoredFindings:
    kind: str = ""

    @classmethod
    def upgrade(cls, ds):
        from .findings import upgrade  # xarray and the study's statistics: only when a dataset is read

        return upgrade(ds, cls.kind)


__all__ = ["StoredFindings"]
