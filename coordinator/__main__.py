import sys

from services.cli import main

sys.exit(main(["coordinator", *sys.argv[1:]]))
