import sys

from gradwire.coordinator.cli import main

sys.exit(main())
