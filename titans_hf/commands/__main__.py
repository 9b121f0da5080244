"""`python -m titans_hf.commands ...` is `titans-hf ...`."""

import sys

from titans_hf.commands import main

sys.exit(main())
