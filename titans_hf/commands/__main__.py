"""`python -m titans_hf.commands ...` is `titans-hf ...`."""

from titans_hf.commands import cli

cli()
