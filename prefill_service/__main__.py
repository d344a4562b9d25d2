import sys

from shared.cli import main

sys.exit(main(["prefill", *sys.argv[1:]]))
