"""The training loop and what it decides each step: which groups start (staleness), which
prompt a group gets (data cursor), held-out validation, idle ratios."""
