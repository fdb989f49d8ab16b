import sys

from fdeplb.cli import main

sys.exit(main())
