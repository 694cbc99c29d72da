"""Small helpers with no ktflow imports: atomic files, notices, progress bars."""
