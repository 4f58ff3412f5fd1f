import sys

from inflight.server.main import main

sys.exit(main())
