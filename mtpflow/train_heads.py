"""``python -m mtpflow.train_heads``: the command's short name; the code lives in ``mtpflow.tools.train_heads``."""
import sys

from mtpflow.tools.train_heads import main

if __name__ == "__main__":
    sys.exit(main())
