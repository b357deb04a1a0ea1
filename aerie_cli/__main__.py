import sys

from aerie_cli.main import main

sys.exit(main())
