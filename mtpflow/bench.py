"""``python -m mtpflow.bench``: the command's short name; the code lives in ``mtpflow.tools.bench``."""
import sys

from mtpflow.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
