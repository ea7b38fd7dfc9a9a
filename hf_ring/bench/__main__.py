"""``python -m hf_ring.bench {ring,dilated,...} [options]``."""
import importlib
import sys

BENCHES = {"ring": "hf_ring.bench.ring", "dilated": "hf_ring.bench.dilated", "generate": "hf_ring.bench.generate",
           "scale": "hf_ring.bench.scale", "model": "hf_ring.bench.model",
           "gpu": "hf_ring.bench.gpu", "quality": "hf_ring.bench.quality",
           "linear": "hf_ring.bench.linear",
           "tables": "hf_ring.bench.tables", "plan": "hf_ring.bench.plan", "compat": "hf_ring.bench.compat",
           "compile": "hf_ring.bench.compile"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHES:
        names = ", ".join(sorted(BENCHES))
        sys.exit(f"usage: python -m hf_ring.bench {{{names}}} [options]  (each takes --help)")
    name = sys.argv[1]
    importlib.import_module(BENCHES[name]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
