import sys

from mtpflow.cli import main

sys.exit(main())
