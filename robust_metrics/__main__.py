import sys

from robust_metrics.cli import main

sys.exit(main())
