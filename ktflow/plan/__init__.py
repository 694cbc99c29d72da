"""The plan artifact: options in, the plan file, its load-time check, timeline, diff and report."""
