import sys

from torchweave.cli import main

sys.exit(main())
