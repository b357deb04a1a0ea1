import sys

from services.cli import main

sys.exit(main(["drafter", *sys.argv[1:]]))
