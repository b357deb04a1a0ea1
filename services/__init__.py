"""aerie's shared core: the algorithm (`services.spec`), the models (`services.model`), the in-process
engine and the CLI. No server starts on import."""
