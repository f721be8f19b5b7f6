"""``python -m zerorun ...``: the same CLI as the ``zerorun`` command."""

from zerorun.cli.main import main

main()
