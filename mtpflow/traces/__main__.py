"""Entry point of ``python -m mtpflow.traces``."""
import sys

from mtpflow.traces.cli import main

sys.exit(main())
