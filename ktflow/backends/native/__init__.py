"""The native CPU backend: the C++ extension's binding, the backend over it, expert staging."""
