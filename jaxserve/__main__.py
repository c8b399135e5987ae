"""`python -m jaxserve` is the `jaxserve` command (jaxserve.cli): `python -m jaxserve generate "..."`."""

from jaxserve.cli import main

raise SystemExit(main())
