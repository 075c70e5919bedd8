"""Built-in gates, one module per gate family."""
