import sys

from torchforge.cli import main

sys.exit(main())
