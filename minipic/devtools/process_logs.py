"""Per-process JSON-line logs of the devtools that watch every vLLM process.

A tool named by an environment variable (gc_pauses.py, step_phases.py) writes one file per
process, `<folder>/<pid><suffix>`; the benchmark reads all of them back after its requests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def this_process_log(env_folder: str, suffix: str) -> Path | None:
    """This process's log in the folder `env_folder` names (made if missing); None when the
    variable is unset (unset before a fork: the child is not recorded)."""
    folder = os.environ.get(env_folder)
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder) / f"{os.getpid()}{suffix}"


def read_records(folder: Path, suffix: str) -> list[tuple]:
    """Every record of every process's log; a line cut short by a killed process is skipped."""
    return [record for records in records_by_process(folder, suffix).values()
            for record in records]


def records_by_process(folder: Path, suffix: str) -> dict[str, list[tuple]]:
    """Each process's records (its log's name less `suffix`: its pid), in file order; a line
    cut short by a killed process is skipped."""
    found = {}
    for path in sorted(Path(folder).glob(f"*{suffix}")):
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(tuple(json.loads(line)))
            except ValueError:
                continue
        found[path.name[: -len(suffix)]] = records
    return found
