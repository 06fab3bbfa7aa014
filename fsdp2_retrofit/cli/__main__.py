"""`python -m fsdp2_retrofit.cli`: the same as the `fsdp2-retrofit` console script."""
from fsdp2_retrofit.cli import main

main()
