"""`python -m splitspec.cli ...` runs the `splitspec` command."""
import sys

from .main import main

sys.exit(main())
