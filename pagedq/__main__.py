"""`python -m pagedq ...` is the `pagedq` command."""

from pagedq.cli import main

raise SystemExit(main())
