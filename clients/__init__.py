"""Client-side handlers: one ClientApp serves every method (the message says what to do)."""
