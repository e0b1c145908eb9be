"""`python -m jaxserve.native`: builds the native CPU kernels now (scripts/setup.sh runs it)."""

from jaxserve.native import build

if __name__ == "__main__":
    print(build())
