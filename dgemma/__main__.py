import sys

from dgemma.cli.main import main

sys.exit(main())
