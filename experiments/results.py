"""Writing an experiment's results: a Markdown table, a CSV of its rows, and run.json.

    from results import write_results
    write_results("results/bench", rows, markdown_lines, comm, argv=sys.argv, model=...)

run.json holds the config, git revision and environment (`zmpi.runinfo.run_metadata`), so
every table can be traced back to the code and machine that produced it.
"""
import csv
import json
from pathlib import Path

from zmpi.runinfo import run_metadata


def write_results(out, rows: list[dict], markdown: list[str], comm, name: str = "table",
                  **meta) -> Path:
    """Write OUT/<name>.md, OUT/<name>.csv (scalar columns of `rows`) and OUT/run.json."""
    # the revision before the files change: rewriting a committed table is not "+dirty"
    metadata = json.dumps(run_metadata(comm, rows=rows, **meta), indent=2, default=str)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(markdown) + "\n")
    columns = [k for k, v in rows[0].items() if not isinstance(v, (dict, list))]
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "run.json").write_text(metadata)
    return out


def write_losses(out, rows: list[dict], label: str) -> None:
    """OUT/losses.csv: a column of per-step losses for each row (its `label` field names the
    column, its "losses" list the values), one line per step."""
    with open(Path(out) / "losses.csv", "w") as f:
        f.write("step," + ",".join(r[label] for r in rows) + "\n")
        for step, values in enumerate(zip(*(r["losses"] for r in rows), strict=True)):
            f.write(f"{step}," + ",".join(f"{v:.5f}" for v in values) + "\n")
