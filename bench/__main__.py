"""``python -m bench {ring,dilated,...} [options]``."""
import importlib
import sys

from . import BENCHES


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHES:
        names = ", ".join(sorted(BENCHES))
        sys.exit(f"usage: python -m bench {{{names}}} [options]  (each takes --help)")
    name = sys.argv[1]
    importlib.import_module(BENCHES[name]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
