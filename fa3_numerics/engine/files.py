"""Files written whole or not at all: ``fa3_numerics.files``, below every layer (the data layer
writes captures with it), re-exported here where the engine and its callers import it."""

from __future__ import annotations

from ..files import (PLACE_ERRNOS, TEMP_GLOB, OutputFileLock, OutputFolder, atomic_path, atomic_write,
                     clean_dead_temps, clean_stale_temps, folder_error, is_own_temp, make_folder, output_file,
                     output_folder, temp_file, write_error)

__all__ = ["atomic_path", "atomic_write", "write_error", "folder_error", "make_folder", "temp_file", "is_own_temp",
           "OutputFolder", "OutputFileLock", "output_folder", "output_file", "clean_stale_temps", "clean_dead_temps",
           "TEMP_GLOB", "PLACE_ERRNOS"]
