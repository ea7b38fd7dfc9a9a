"""``python -m bench {ring,dilated,...} [options]``."""
import importlib
import sys

from . import BENCHES


def main() -> None:
    names = ", ".join(sorted(BENCHES))
    usage = f"usage: python -m bench {{{names}}} [options]  (each takes --help)"
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(usage)
        return
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHES:
        print(usage, file=sys.stderr)
        sys.exit(2)  # a usage error, as argparse exits
    name = sys.argv[1]
    importlib.import_module(BENCHES[name]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
