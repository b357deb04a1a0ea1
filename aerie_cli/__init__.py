"""The `aerie` command line: the one package that imports every command (`aerie_cli.main`).

Building the parser imports no torch, grpc or redis; each command imports what it runs inside its
function. `python -m aerie_cli ...` is how `aerie up` starts each service."""
