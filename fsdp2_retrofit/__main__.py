"""`python -m fsdp2_retrofit`: the same as the `fsdp2-retrofit` console script."""
from fsdp2_retrofit.cli import main

main()
