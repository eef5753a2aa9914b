import sys

from ..defensetrain import main

sys.exit(main())
