"""Tools that run on this machine: the hardware probe."""
