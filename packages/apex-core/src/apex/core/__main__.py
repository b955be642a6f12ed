import sys

from apex.core.cli import main

sys.exit(main())
