"""The one door for untrusted bytes: regular files only, size caps before reads, bounded JSON, shape checks, guarded parsers."""
