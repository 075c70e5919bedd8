"""Built-in regularizers: per-token terms added to the policy loss with a coefficient (KL, entropy)."""
