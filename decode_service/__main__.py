import sys

from shared.cli import main

sys.exit(main(["decode", *sys.argv[1:]]))
