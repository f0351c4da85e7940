"""``python -m mtpflow.train_domain``: the command's short name; the code lives in ``mtpflow.tools.train_domain``."""
import sys

from mtpflow.tools.train_domain import main

if __name__ == "__main__":
    sys.exit(main())
