import sys

from tokenmill.entrypoints.cli import main

sys.exit(main())
