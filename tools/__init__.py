"""Command-line entry points (flags -> config -> library call); importable so tests can call ``main(argv)``."""
