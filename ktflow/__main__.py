import sys

from .tools.entry import main

sys.exit(main())
