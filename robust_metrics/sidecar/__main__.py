"""`python -m robust_metrics.sidecar`: the same as `robust-metrics sidecar`."""

import argparse
import sys

from robust_metrics.sidecar.cli import configure, run

parser = argparse.ArgumentParser(prog="python -m robust_metrics.sidecar",
                                 description="robust-metrics node sidecar")
configure(parser)
sys.exit(run(parser.parse_args()))
