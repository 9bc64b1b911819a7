"""``python -m torch_mp_ext demo|doctor|cleanup``."""

from .cli import main

raise SystemExit(main())
