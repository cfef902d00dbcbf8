"""Collect the experiments' results into experiments/RESULTS.md, with plots.

    python experiments/report.py                  # after the experiments (make reproduce)
    python experiments/report.py --results results --out experiments/RESULTS.md

Reads the CSV and run.json files the experiment scripts wrote under --results (one folder per
experiment and world size, e.g. results/zero_tables_n4), draws the figures into
<results>/figures/ (matplotlib, from the `bench` extra), and writes RESULTS.md: each table
beside the papers' numbers, the figures, the command that made it and how to run it at full
scale. It measures nothing itself; a result folder that is missing is reported as such, never
filled in.
"""
import argparse
from pathlib import Path

from report_extensions import ExtensionSections
from report_parallel import ParallelSections
from report_zero import ZeroSections
from reporting import ReportBase


class Report(ZeroSections, ParallelSections, ExtensionSections, ReportBase):
    """RESULTS.md: every section, in the order main() calls them."""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results")
    parser.add_argument("--out", default="experiments/RESULTS.md")
    args = parser.parse_args()
    report = Report(Path(args.results), Path(args.out))
    for section in (report.memory, report.lab, report.communication, report.largest,
                    report.throughput, report.tensor, report.pipeline, report.recompute,
                    report.plan, report.nvme, report.onebit, report.zeropp, report.sparse,
                    report.published_memory, report.moe_training, report.llama_gpt):
        section()
    report.write()
    print(f"wrote {args.out} and {report.figures}/")


if __name__ == "__main__":
    main()
