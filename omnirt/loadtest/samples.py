"""Raw samples: Locust rounds the response times it stores to two significant digits, so every request
event (the custom audio metrics included) is also appended, unrounded, to a CSV, and exact (nearest-rank)
percentiles per metric are written to a JSON summary when the run stops; a tail percentile with too few
samples for it is null there, beside the maximum (`omnirt/loadtest/stats.py`)."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import numpy as np

from omnirt.loadtest.stats import summary


class RawSamples:
    def __init__(self, environment, prefix: str):
        self.csv_path, self.json_path = Path(f"{prefix}_samples.csv"), Path(f"{prefix}_summary.json")
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.csv_path.open("w", newline="")
        self._csv = csv.writer(self._file)
        self._csv.writerow(["t", "request_type", "name", "value_ms", "length", "failed"])
        self.values: dict[tuple[str, str], list[float]] = {}
        self.failures: dict[tuple[str, str], int] = {}
        environment.events.request.add_listener(self.on_request)
        environment.events.quitting.add_listener(self.write_summary)

    def on_request(self, request_type, name, response_time, response_length, exception=None, **_):
        key = (request_type, name)
        self._csv.writerow([f"{time.time():.3f}", request_type, name, f"{response_time:.3f}", response_length,
                            int(exception is not None)])
        if exception is None:
            self.values.setdefault(key, []).append(float(response_time))
        else:
            self.failures[key] = self.failures.get(key, 0) + 1

    def write_summary(self, **_) -> None:
        self._file.close()
        out = {}
        for key in sorted(set(self.values) | set(self.failures)):
            v = np.array(self.values.get(key, []))
            row = {"count": int(v.size), "failures": self.failures.get(key, 0)}
            if v.size:
                stats = summary(v.tolist(), (50, 90, 95, 99))
                row.update({k: None if x is None else round(float(x), 3) for k, x in stats.items() if k != "n"})
                row.update(mean=round(float(v.mean()), 3))
            out[" ".join(key)] = row
        self.json_path.write_text(json.dumps(out, indent=1))
