"""Times pandas.read_csv on a CSV file, the baseline beside headroom's
CSV ingest (`cargo xtask bench-loader-one --mode csv`, which writes the
file and runs this script on it). Prints one JSON line: rows, seconds of
the fastest of --repeat reads, rows/s.

    python3 bench/pandas_read_csv.py FILE [--repeat 3]

Every column is read as float32, as headroom keeps a table's cells; the
default C engine, one thread (pandas' read_csv has no threads).
"""

import argparse
import json
import time

import pandas as pd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    best = None
    rows = 0
    for _ in range(max(1, args.repeat)):
        start = time.perf_counter()
        frame = pd.read_csv(args.file, dtype="float32")
        seconds = time.perf_counter() - start
        rows = len(frame)
        best = seconds if best is None else min(best, seconds)
    print(
        json.dumps(
            {
                "reader": f"pandas {pd.__version__} read_csv",
                "rows": rows,
                "seconds": best,
                "rows_per_s": rows / best,
            }
        )
    )


if __name__ == "__main__":
    main()
