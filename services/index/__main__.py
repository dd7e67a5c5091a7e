"""`python -m services.index --nats-url URL --redis-url URL`: run the index service."""

import sys

from services.index.service import main

sys.exit(main())
