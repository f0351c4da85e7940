"""``python -m mtpflow.tune``: the command's short name; the code lives in ``mtpflow.tools.tune``."""
import sys

from mtpflow.tools.tune import main

if __name__ == "__main__":
    sys.exit(main())
