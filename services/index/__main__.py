"""`python -m services.index --nats-url URL --redis-url URL`: run the index service."""

import sys

from services.index.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
