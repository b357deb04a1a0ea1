import sys

from services.cli import main

sys.exit(main(["verifier", *sys.argv[1:]]))
