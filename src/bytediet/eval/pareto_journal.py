"""A ``--kv-pareto`` run's finished entries on disk, one JSON line each, so a stopped run resumes where it stopped.

The first line is the run's key (model and settings); a journal with another key is refused, so entries measured on
other windows are never mixed in. The entries to measure are not part of the key: a later run may add codecs or
budgets and reuse what is done. A last line cut short by a kill is ignored (that entry is measured again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from ..errors import ConfigError


class ParetoJournal:
    def __init__(self, path, key: dict) -> None:
        self.path = Path(path)
        self.key = json.loads(json.dumps(key, default=float))  # as it reads back
        self.records: dict[str, dict] = {}  # spec → its record, from earlier runs and this one
        self.reference: Optional[dict] = None  # the bf16 row's passkey and capacity
        self.resumed = 0  # entries an earlier run had measured
        if self.path.is_file() and self.path.stat().st_size:
            self._read()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"key": self.key})

    def _read(self) -> None:
        lines = []
        for text in self.path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:  # a line cut short by a kill: its entry is measured again
                continue
        if not lines or lines[0].get("key") != self.key:
            raise ConfigError(
                f"--kv-pareto-journal {self.path} holds another run (another model or other windows, calibration or "
                "passkey settings); give a new file, or delete this one to start over"
            )
        for line in lines[1:]:
            if "reference" in line:
                self.reference = line["reference"]
            elif "record" in line:
                self.records[line["record"]["spec"]] = line["record"]
        self.resumed = len(self.records)

    def _append(self, obj: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(obj, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def done(self, spec: str) -> bool:
        return spec in self.records

    def add(self, record: dict) -> None:
        self.records[record["spec"]] = record
        self._append({"record": record})

    def set_reference(self, row: dict) -> None:
        self.reference = row
        self._append({"reference": row})
