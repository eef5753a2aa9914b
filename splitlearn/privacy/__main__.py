import sys

from ..apps.defensetrain import main

sys.exit(main())
