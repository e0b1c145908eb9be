"""`python -m jaxserve.native [--all]`: builds the native CPU kernels now (scripts/setup.sh runs
it): this machine's instruction-set level, or with --all every x86-64 level (isa.py)."""

import sys

from jaxserve.native import build
from jaxserve.native.isa import ISA_BUILDS

if __name__ == "__main__":
    for isa in ISA_BUILDS if "--all" in sys.argv[1:] else [None]:
        print(build(isa))
