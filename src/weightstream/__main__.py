"""``python -m weightstream``: the command line."""

from weightstream.cli.main import main

raise SystemExit(main())
