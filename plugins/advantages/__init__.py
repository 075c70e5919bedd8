"""Built-in advantage estimators, one module per family."""
